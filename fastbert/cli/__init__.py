"""The ``fastbert`` command.

    fastbert                      demo: the embedded all-MiniLM-L6-v2 on real sentences, transformers vs fastbert
    fastbert demo [options]       the same, with options
    fastbert check [options]      fastbert against transformers on a checkpoint: errors, PASS/FAIL (exit 1 on FAIL)
    fastbert embed [TEXT...]      embeddings of texts or a corpus (streaming, resumable, --ray), or --similarity
    fastbert bench [options]      end-to-end benchmark against HF eager/SDPA, torch.compile, ONNX Runtime
    fastbert finetune --task T -o DIR   fine-tune a classifier on a real labelled set built offline (held-out accuracy)
    fastbert pretrain -o DIR [FILE...]  pretrain a small BERT/RoBERTa/ALBERT from scratch (CPython's docs by default)
    fastbert distill --teacher DIR -o DIR   distil a teacher into a smaller student (DistilBERT, or sentence embeddings)
    fastbert serve [options]      an HTTP server: embeddings, reranking or classification, batched by a token budget
    fastbert tune [options]       measure the fastest backend per op and shape ahead of time (the tuning cache)

Each command has its options in `fastbert.cli.parsers.<command>` (``add_parser(subparsers)``; what several share in
`fastbert.cli.parsers`) and runs in `fastbert.cli.<command>` (``run(args)``; what several share in
`fastbert.cli.shared`). Errors the user can fix (a missing path, an unsupported model family, a device that is not
there, a bad dtype) print one line, ``fastbert: error: ...``, on stderr and exit non-zero. The parsers import
nothing heavy and only the command that runs is imported, so ``fastbert --help``, ``fastbert <command> --help`` and
``--version`` import neither torch nor transformers (``fastbert.__version__`` comes from the package metadata).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterable, Sequence
from types import FrameType, ModuleType
from typing import Any, NoReturn

from fastbert import __version__

# command -> its one-line summary in ``fastbert --help`` (each command's add_parser gives the same as
# ``help``; tests/cli checks that they agree)
SUMMARIES = {
    "demo": "transformers vs fastbert on 16 real sentences (the default command)",
    "check": "compare fastbert with transformers on a checkpoint; PASS/FAIL",
    "embed": "embed texts or a whole corpus: streaming, one output row per input row, resumable",
    "bench": "end-to-end benchmark against transformers, torch.compile, ONNX Runtime",
    "finetune": "fine-tune a sequence/token classifier on a small real labelled set built offline",
    "pretrain": "pretrain a small BERT/RoBERTa/ALBERT from scratch on CPython's docs or text files",
    "distill": "distil a teacher into a smaller student: DistilBERT (mlm) or a sentence-embedding model",
    "serve": "an embedding / rerank / classification HTTP server with token-budget dynamic batching",
    "tune": "measure which backend is fastest per op and shape; fill the tuning cache",
}
COMMANDS = tuple(SUMMARIES)


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line on stderr (exit status 2, no usage text)."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        sys.stderr.write(f"fastbert: error: {message}\n")
        sys.exit(2)


def _model_hint(args: argparse.Namespace, extras: list[str]) -> str:
    """For ``fastbert check DIR``: a directory among the unrecognized arguments of a command that takes --model is
    likely its checkpoint."""
    directories = [word for word in extras if os.path.isdir(word)]
    if not directories or not hasattr(args, "model"):
        return ""
    return f" (a checkpoint directory is given as --model {directories[0]})"


def command_module(name: str) -> ModuleType:
    """The module that runs command ``name`` (`fastbert.cli.<name>`), imported on first use."""
    return importlib.import_module(f"fastbert.cli.{name}")


def parser_module(name: str) -> ModuleType:
    """The module of command ``name``'s options (`fastbert.cli.parsers.<name>`): light, imports no torch."""
    return importlib.import_module(f"fastbert.cli.parsers.{name}")


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser with the options of ``commands`` (default: every command); the other commands are
    listed with their summary only, so that building it imports only the parsers it needs."""
    full = set(COMMANDS if commands is None else commands)
    parser = Parser(prog="fastbert", description="Fast BERT-family encoders: compare them with transformers, embed, "
                    "serve, benchmark, tune, pretrain, fine-tune and distil them. With no command, runs the demo on "
                    "the embedded all-MiniLM-L6-v2.", epilog="fastbert COMMAND --help: the options of one command")
    parser.add_argument("--version", action="version", version=f"fastbert {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name in COMMANDS:
        if name in full:
            parser_module(name).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=SUMMARIES[name], add_help=False)
    return parser


def _chosen(argv: Sequence[str]) -> str | None:
    """The command that ``argv`` names: its first word that is not an option (the top-level options take no
    value); None when there is none."""
    return next((word for word in argv if not word.startswith("-")), None)


_PYTHON_FORMAT = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """fastbert's own warnings as the line they say (they start with 'fastbert:'); others as Python writes them."""
    text = str(message)
    if text.startswith("fastbert"):
        return text + "\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastbert`` console script; returns the exit status."""
    try:
        return _run_command(argv)
    except KeyboardInterrupt:  # Ctrl-C while the command's modules (torch) are still importing
        sys.stderr.write("fastbert: interrupted\n")
        return 130


def _run_command(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _chosen(argv)
    parser = build_parser([name] if name in SUMMARIES else ())
    args, extras = parser.parse_known_args(argv)
    if extras:  # what parse_args says, and where a directory was likely meant as --model, so
        parser.error(f"unrecognized arguments: {' '.join(extras)}{_model_hint(args, extras)}")
    if args.command is None:
        args = build_parser(["demo"]).parse_args(["demo"])
    from fastbert.backends import BackendUnavailable
    from fastbert.common.resolve import UserError
    from fastbert.loading import CheckpointError

    warnings.formatwarning = _one_line_warning
    previous = _stop_on_sigterm()
    try:
        return command_module(args.command).run(args)
    except (UserError, CheckpointError, BackendUnavailable) as err:
        sys.stderr.write(f"fastbert: error: {err}\n")
        return 1
    except Terminated:
        sys.stderr.write("fastbert: terminated\n")
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        sys.stderr.write("fastbert: interrupted\n")
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`fastbert embed ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except OSError as err:  # the system refused (a full disk, a path that is a file, no permission): what it said
        sys.stderr.write(f"fastbert: error: {os_error_line(err)}\n")
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM (what timeout, Docker, Kubernetes and Slurm send) as an interrupt: a command closes its output as on
    Ctrl-C (a Parquet file is completed, a training run keeps its checkpoints) instead of dying mid-write."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _stop_on_sigterm() -> Any:
    """Install `_raise_terminated` for SIGTERM (in the main thread only, where Python delivers signals); the handler
    it replaced, or None. `fastbert serve` installs its own (a drained shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def os_error_line(err: OSError) -> str:
    """An OSError in one line: its reason and the path it concerns, else its message."""
    if err.strerror and err.filename:
        return f"{err.strerror}: {err.filename}"
    return " ".join((err.strerror or str(err) or type(err).__name__).split())
