"""``fastbert bench``'s options (the command: `fastbert.cli.bench`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser("bench", help="end-to-end benchmark against transformers, torch.compile, ONNX "
                                   "Runtime")
    parsers.add_model_options(parser)
    parsers.add_workload_options(parser)
    parser.add_argument("--peers", nargs="+", default=None, metavar="PEER",
                        help=f"implementations to compare with, from {', '.join(parsers.PEERS)} (default: "
                        f"{' '.join(parsers.DEFAULT_PEERS)}; --quick: hf-eager hf-sdpa)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: a smoke run")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s for the roofline column (default: measured with one large matmul)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op threads for torch and ONNX Runtime (default: torch's)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write e2e.json, e2e.md and the PNGs (default: a new folder "
                        "bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS> under the current directory; the "
                        "committed benchmarks/results/ change only when --out names them)")
    parser.add_argument("--note", default=None, help="free text stored in the JSON and shown in the Markdown")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    return parser
