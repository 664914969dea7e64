"""``fastbert finetune``'s options (the command: `fastbert.cli.finetune`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``finetune`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser(
        "finetune", help="fine-tune a sequence/token classifier on a small real labelled set built offline",
        description="Fine-tunes a checkpoint (default all-MiniLM-L6-v2) on a labelled set built from CPython's own "
        "text (fastbert.training.finetune), through fastbert.optimize and fastbert.training.loop; reports held-out "
        "accuracy "
        "against the majority-class baseline and saves the model in HF format.")
    parser.add_argument("--task", required=True, choices=parsers.FINETUNE_TASKS,
                        help="topic: docstring sentences -> stdlib package; pair: does sentence B follow A; code: "
                        "which words of a pydoc sentence are inline code")
    parser.add_argument("-o", "--output-dir", required=True, metavar="DIR",
                        help="checkpoints, metrics.jsonl, results.json and the fine-tuned model (DIR/model)")
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="HF checkpoint directory with its tokenizer (e.g. a `fastbert pretrain` checkpoint); "
                        "default: the embedded all-MiniLM-L6-v2")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if present, else cpu")
    parser.add_argument("--backend", default="auto", choices=("auto",) + parsers.BACKENDS, help="fastbert backend")
    parser.add_argument("--no-optimize", action="store_true", help="train the plain transformers model")
    add_training_options(parser)
    add_teacher_options(parser)
    return parser


def add_teacher_options(parser: argparse.ArgumentParser) -> None:
    """Task distillation from a fine-tuned teacher, and the pair task's resampling."""
    parser.add_argument("--teacher", metavar="DIR", default=None,
                        help="a classifier already fine-tuned on this task with the same tokenizer (DIR/model of "
                        "a `fastbert finetune` run): the model learns from its outputs too (task distillation)")
    parser.add_argument("--alpha-soft", type=float, default=None,
                        help="with --teacher: weight of the teacher's soft targets; the labels' loss gets 1 - it "
                        "(default 0.5)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="with --teacher: softmax temperature of the soft targets (default 2.0)")
    parser.add_argument("--alpha-hidden", type=float, default=None,
                        help="with --teacher: weight of the cosine loss between each layer's hidden states and "
                        "those of the teacher layer it maps to, token by token (TinyBERT's m*N/M; default 1.0)")
    parser.add_argument("--resample-pairs", action="store_true",
                        help="pair task: new partners each epoch from the training documents (the held-out pairs "
                        "stay the same)")


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Steps, batches, learning rate, lengths, samples, seed, threads, resume and logging."""
    parser.add_argument("--epochs", type=float, default=1.0, help="passes over the training split (default 1)")
    parser.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    parser.add_argument("--learning-rate", type=float, default=1e-4, help="peak AdamW learning rate (default 1e-4)")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="linear warmup share of the steps")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per example, up to the model's positions (default 128, or the positions if fewer)")
    parser.add_argument("--train-limit", type=int, default=None, help="use a seeded sample of this many examples")
    parser.add_argument("--eval-limit", type=int, default=None, help="evaluate on a seeded sample of this many")
    parser.add_argument("--seed", type=int, default=0, help="data order, pair partners and head initialisation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output-dir")
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (default: at the end)")
    parser.add_argument("--log-every", type=int, default=10, help="a progress line every N steps")
