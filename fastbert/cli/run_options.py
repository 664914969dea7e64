"""The run options that ``fastbert pretrain`` and ``fastbert distill`` share (checkpoints, evaluation, logging, seed,
resume, threads, device, backend, optimisation, progress): the fields of `fastbert.training.settings.RunSettings`.

Imports nothing heavy (no torch), so that building a command's parser (``--help``) stays light; `fastbert.cli.shared`
imports torch and is for what runs."""

from __future__ import annotations

import argparse

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
    parser.add_argument("--backend", default="auto", help="fastbert backend for fastbert.optimize (default auto)")
    parser.add_argument("--no-optimize", action="store_true", help=text["--no-optimize"])
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="redraw the progress line in place (default: when stderr is a terminal)")
