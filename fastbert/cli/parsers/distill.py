"""``fastbert distill``'s options (the command: `fastbert.cli.distill`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``distill`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser(
        "distill", help="distil a teacher into a smaller student: DistilBERT (mlm) or a sentence-embedding model",
        description="Distil a teacher checkpoint into a student with fewer layers, through fastbert's kernels. "
        "mlm: a BERT/RoBERTa masked-LM teacher -> a DistilBERT student (no token types, no pooler, half the layers, "
        "initialised from the teacher's), DistilBERT's triple loss (soft targets at temperature 2, masked LM, "
        "cosine of hidden states: weights 5/2/1), dynamic masking, no NSP. embedding: a sentence-transformers "
        "teacher (default the embedded all-MiniLM-L6-v2) -> the same model with N of its layers, MSE between "
        "sentence embeddings. Checkpoints in HF format (resumable), metrics.jsonl, loss_curve.png, the final "
        "student in DIR/model.")
    add_run_options(parser)
    add_loss_options(parser)
    add_training_options(parser)
    return parser


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """Teacher, output, objective, the student's layers and the corpus."""
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="text files (a blank line ends a document); default: CPython's documentation")
    parser.add_argument("--teacher", metavar="DIR", default=None,
                        help="the teacher checkpoint: a BERT/RoBERTa ...ForMaskedLM or ...ForPreTraining (mlm, "
                        "required), a sentence-transformers model (embedding; default the embedded all-MiniLM-L6-v2)")
    parser.add_argument("-o", "--output-dir", required=True, metavar="DIR",
                        help="checkpoints, metrics, curve, and the student in DIR/model")
    parser.add_argument("--objective", choices=parsers.DISTILL_OBJECTIVES, default="mlm",
                        help="mlm: DistilBERT's distillation (default); embedding: sentence embeddings")
    parser.add_argument("--student-layers", type=int, default=None, metavar="N",
                        help="layers of the student (default half the teacher's), spread over the teacher's "
                        "depth, first and last included (12 -> 6: layers 0 2 4 7 9 11, DistilBERT's choice)")
    parser.add_argument("--teacher-layers", default=None, metavar="I,J,...",
                        help="the teacher layers the student starts from, instead of the spread default")
    parser.add_argument("--init", choices=("teacher", "random"), default="teacher",
                        help="teacher: copy the teacher's weights (default); random: a student from scratch")
    parser.add_argument("--corpus", choices=parsers.CORPORA, default=None,
                        help="without FILEs: pydoc (the reference topics; mlm default) or cpython (also the standard "
                        "library's docstrings; embedding default)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per sequence (default 128, or the teacher's positions when fewer)")
    parser.add_argument("--mlm-probability", type=float, default=0.15, help="mlm: share of tokens masked (0.15)")
    parser.add_argument("--pack", action="store_true",
                        help="mlm: fill sequences with consecutive sentences up to --max-length")


def add_loss_options(parser: argparse.ArgumentParser) -> None:
    """The loss's weights (defaults: DistilBERT's for mlm, MSE for embedding)."""
    parser.add_argument("--temperature", type=float, default=None, help="mlm: softmax temperature (default 2.0)")
    parser.add_argument("--alpha-ce", type=float, default=None, help="mlm: weight of the soft-target loss (5.0)")
    parser.add_argument("--alpha-mlm", type=float, default=None, help="mlm: weight of the masked-LM loss (2.0)")
    parser.add_argument("--alpha-cos", type=float, default=None,
                        help="weight of the cosine loss: of hidden states (mlm, default 1.0) or of sentence "
                        "embeddings (embedding, default 0)")
    parser.add_argument("--alpha-mse", type=float, default=None,
                        help="embedding: weight of the MSE between sentence embeddings (default 1.0)")
    parser.add_argument("--alpha-hidden", type=float, default=None,
                        help="embedding: weight of the cosine loss between the last hidden states, token by token, "
                        "[CLS] included (what a fine-tuned classifier reads; default 0)")
    parser.add_argument("--alpha-layers", type=float, default=None,
                        help="embedding: weight of the cosine loss between each intermediate student layer's output "
                        "and that of the teacher layer it was copied from, token by token (TinyBERT's hidden-state "
                        "loss; default 0)")
    parser.add_argument("--pairs", type=float, default=0.0, metavar="FRACTION",
                        help="embedding: share of each batch that is sentence pairs (two segments: a sentence and the "
                        "next one, or half the time a sentence of another document), as pair tasks read them "
                        "(default 0)")


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Optimisation (DistilBERT's defaults), evaluation, checkpoints, logging and where the run runs."""
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="peak learning rate (default 5e-4 for mlm, DistilBERT's; 1e-4 for embedding)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default 5%% of --max-steps")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="default 0 (DistilBERT's)")
    parser.add_argument("--max-grad-norm", type=float, default=5.0, help="0: no clipping (default 5.0, DistilBERT's)")
    parser.add_argument("--held-out", type=float, default=0.05, help="share of the documents held out (0.05)")
    parser.add_argument("--eval-sentences", type=int, default=512, help="held-out sequences evaluated (512)")
    parsers.add_loop_options(parser, helps={
        "--save-every": "checkpoint every N steps (0: at the end)",
        "--eval-every": "held-out evaluation every N steps (0: at the end)",
        "--resume": "continue the run in -o from its latest checkpoint",
        "--no-optimize": "run the plain transformers models"})
