"""``fastbert demo``'s options (the command: `fastbert.cli.demo`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``demo`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser("demo", help="transformers vs fastbert on 16 real sentences (the default command)")
    parsers.add_model_options(parser)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per implementation (median reported)")
    parser.add_argument("--no-optimize", action="store_true", help="leave out fastbert.optimize(HF model)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    return parser
