"""``fastbert tune``'s options (the command: `fastbert.cli.tune`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``tune`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser("tune", help="measure which backend is fastest per op and shape; fill the "
                                   "tuning cache")
    parsers.add_model_options(parser, backend=False)  # tune measures every backend: none is forced
    parsers.add_workload_options(parser)
    parser.add_argument("--training", action="store_true",
                        help="also training steps (train() mode with dropout, forward + backward)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's); the "
                        "choices are kept per thread count")
    parser.add_argument("--clear", action="store_true", help="remove every tuning file from the cache and stop")
    return parser
