"""The ``fastbert`` command.

    fastbert                      demo: the embedded all-MiniLM-L6-v2 on real sentences, transformers vs fastbert
    fastbert demo [options]       the same, with options
    fastbert check [options]      fastbert against transformers on a checkpoint: errors, PASS/FAIL (exit 1 on FAIL)
    fastbert embed [TEXT...]      embeddings of texts or a corpus (streaming, resumable, --ray), or --similarity
    fastbert bench [options]      end-to-end benchmark against HF eager/SDPA, torch.compile, ONNX Runtime
    fastbert finetune --task T -o DIR   fine-tune a classifier on a real labelled set built offline (held-out accuracy)
    fastbert pretrain -o DIR [FILE...]  pretrain a small BERT/RoBERTa/ALBERT from scratch (CPython's docs by default)
    fastbert serve [options]      an HTTP server: embeddings, reranking or classification, batched by a token budget

One module per command (`fastbert.cli.demo`, ...), each with ``add_parser(subparsers)`` and ``run(args)``; what
several of them share is in `fastbert.cli.shared`. Errors the user can fix (a missing path, an unsupported model
family, a device that is not there, a bad dtype) print one line, ``fastbert: error: ...``, on stderr and exit
non-zero. transformers, onnxruntime and matplotlib are imported inside the commands, so ``fastbert --help`` stays
fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from fastbert import __version__
from fastbert.backends import BackendUnavailable
from fastbert.cli import bench, check, demo, embed, finetune, pretrain, serve, shared
from fastbert.common.resolve import UserError
from fastbert.loading import CheckpointError

COMMANDS = {"demo": demo, "check": check, "embed": embed, "bench": bench, "finetune": finetune, "pretrain": pretrain,
            "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = shared.Parser(prog="fastbert", description="Fast BERT-family encoders: demo, check, embed, bench. With "
                           "no command, runs the demo on the embedded all-MiniLM-L6-v2.")
    parser.add_argument("--version", action="version", version=f"fastbert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for command in COMMANDS.values():
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastbert`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo"])
    try:
        return COMMANDS[args.command].run(args)
    except (UserError, CheckpointError, BackendUnavailable) as err:
        sys.stderr.write(f"fastbert: error: {err}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("fastbert: interrupted\n")
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`fastbert embed ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
