"""Every command's options: ``fastbert.cli.parsers.<command>.add_parser(subparsers)`` adds the command to the
``fastbert`` parser, and this module holds what several of them share. Nothing here imports torch, transformers or
any module that does, so ``fastbert <command> --help`` answers at once; the command runs in `fastbert.cli.<command>`,
which imports what it needs.

The choices an option offers are copies of the core's own tuples (importing those would import torch):
tests/cli/test_parsers.py holds each equal to its source."""

from __future__ import annotations

import argparse

BACKENDS = ("eager", "triton", "cpp", "vendor", "onednn")  # fastbert.backends.BACKENDS
POOLINGS = ("mean", "cls")  # fastbert.embedding.POOLINGS
OUTPUT_FORMATS = ("jsonl", "npy", "parquet")  # fastbert.embedding.FORMATS
# fastbert.bench.peers.PEERS and DEFAULT_PEERS
PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime", "onnxruntime-int8", "openvino", "openvino-default",
         "fastbert-optimize", "fastbert-static", "fastbert-int8", "fastbert-bf16")
DEFAULT_PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime")
FINETUNE_TASKS = ("topic", "pair", "code")  # fastbert.training.finetune.TASK_NAMES
PRETRAIN_OBJECTIVES = ("bert", "roberta", "albert")  # fastbert.training.pretrain.OBJECTIVES
DISTILL_OBJECTIVES = ("mlm", "embedding")  # fastbert.training.distill.OBJECTIVES
CORPORA = ("pydoc", "cpython")  # fastbert.training.corpus.CORPORA's keys
SERVE_TASKS = ("embed", "rerank", "classify")  # fastbert.serving.engines.TASKS
WARMUPS = ("none", "quick", "full")  # fastbert.serving.warmup.WARMUPS


def add_model_options(parser: argparse.ArgumentParser, backend: bool = True, dtype: str | None = None) -> None:
    """--model, --device, --dtype (default ``dtype``) and (``backend``) --backend: the options of every command
    that runs a checkpoint."""
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="HF checkpoint directory (config.json + weights); default: the embedded all-MiniLM-L6-v2")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if present, else cpu")
    default = ("auto (said once on stderr; --dtype float32 keeps the exact path)" if dtype == "auto" else
               "float32 on CPU, float16 on CUDA (check: float32)")
    parser.add_argument("--dtype", default=dtype, help="float32, float16, bfloat16, auto (bfloat16 on a CPU with "
                        "AMX, or with AVX-512 BF16 where it measures faster than float32, else float32; float16 on "
                        f"CUDA) or int8 (CPU; embed and serve); default: {default}")
    if backend:
        parser.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                            help="fastbert backend (default auto: the fastest the device allows, measured per op and "
                            "shape: see fastbert tune)")


def add_workload_options(parser: argparse.ArgumentParser) -> None:
    """--batch, --seq, --varlen: the shapes `fastbert.bench.workloads.make_workloads` builds (bench and tune)."""
    parser.add_argument("--batch", type=int, nargs="+", default=None, metavar="N",
                        help="batch sizes (default: 1 8 on CPU, 1 32 128 on CUDA)")
    parser.add_argument("--seq", type=int, nargs="+", default=None, metavar="N",
                        help="sequence lengths (default: 128 on CPU, 128 512 on CUDA)")
    parser.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                        help="also variable-length batches, lengths uniform in [seq/8, seq] (default: on)")


DEFAULT_HELP = {
    "--save-every": "checkpoint every N steps (default 200; 0: only at the end)",
    "--eval-every": "held-out evaluation every N steps (default 200; 0: only at the end)",
    "--resume": "continue the run in --output-dir from its latest checkpoint (same settings)",
    "--no-optimize": "train the plain transformers model",
}


def add_loop_options(parser: argparse.ArgumentParser, helps: dict[str, str] | None = None) -> None:
    """Add --save-every, --keep-checkpoints, --eval-every, --log-every, --seed, --resume, --threads, --device,
    --backend, --no-optimize and --progress to ``parser``; ``helps`` replaces the help of the options it names among
    those of `DEFAULT_HELP`."""
    text = {**DEFAULT_HELP, **(helps or {})}
    parser.add_argument("--save-every", type=int, default=200, help=text["--save-every"])
    parser.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (default 2)")
    parser.add_argument("--eval-every", type=int, default=200, help=text["--eval-every"])
    parser.add_argument("--log-every", type=int, default=10, help="progress line every N steps (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help=text["--resume"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                        help="fastbert backend for fastbert.optimize (default auto)")
    parser.add_argument("--no-optimize", action="store_true", help=text["--no-optimize"])
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="redraw the progress line in place (default: when stderr is a terminal)")
