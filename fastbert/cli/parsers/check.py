"""``fastbert check``'s options (the command: `fastbert.cli.check`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``check`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser("check", help="compare fastbert with transformers on a checkpoint; PASS/FAIL")
    parsers.add_model_options(parser)
    return parser
