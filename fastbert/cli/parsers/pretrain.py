"""``fastbert pretrain``'s options (the command: `fastbert.cli.pretrain`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``pretrain`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser(
        "pretrain", help="pretrain a small BERT/RoBERTa/ALBERT from scratch on CPython's docs or text files",
        description="Pretrain a small BERT-family model from scratch: a WordPiece (bert, albert) or byte-level BPE "
        "(roberta) vocabulary, masked LM + "
        "next-sentence (bert), masked LM only (roberta) or + sentence order (albert); checkpoints in HF format "
        "(resumable), metrics.jsonl, loss_curve.png.")
    add_data_options(parser)
    add_model_options(parser)
    add_training_options(parser)
    return parser


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """The corpus, the output directory, the objective and how examples are built."""
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help="text files (a blank line ends a document); default: CPython's documentation "
                        "(pydoc_data.topics, one document per topic)")
    parser.add_argument("--corpus", choices=parsers.CORPORA, default=None,
                        help="without FILEs: pydoc (default: the reference topics, one document each) or cpython "
                        "(also the standard library's docstrings, one document per module)")
    parser.add_argument("-o", "--output-dir", required=True, metavar="DIR", help="checkpoints, metrics, curve")
    parser.add_argument("--objective", choices=parsers.PRETRAIN_OBJECTIVES, default="bert",
                        help="bert: MLM + NSP (BertForPreTraining); roberta: MLM only, dynamic masking "
                        "(RobertaForMaskedLM); albert: MLM + SOP (AlbertForPreTraining). Default bert")
    parser.add_argument("--whole-word-masking", action="store_true", help="mask whole words, not tokens")
    parser.add_argument("--pack", action="store_true",
                        help="fill sequences with consecutive sentences up to --max-length")
    parser.add_argument("--mlm-probability", type=float, default=0.15, help="share of tokens chosen (default 0.15)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per sequence (default 128, or the positions of --config's "
                        "max_position_embeddings when fewer)")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """The vocabulary and the model's size."""
    parser.add_argument("--vocab-size", type=int, default=8000,
                        help="vocabulary size: WordPiece (bert, albert; at least every character of the corpus) or "
                        "byte-level BPE (roberta; at least 261: the 256 bytes and 5 special tokens); default 8000")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="use this transformers tokenizer (with [PAD] [CLS] [SEP] [MASK]) instead of training one")
    parser.add_argument("--config", metavar="FILE.json", default=None,
                        help="model config fields (JSON) over the small default (H=256, 4 layers, 4 heads)")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--num-heads", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default 4 x hidden size")


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """Optimisation, evaluation, checkpoints, logging and where the run runs."""
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="default 10%% of --max-steps")
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping (default 1.0)")
    parser.add_argument("--held-out", type=float, default=0.05,
                        help="share of the documents held out for evaluation (default 0.05; with fewer than 20 "
                        "documents, the share of each document's last sentences)")
    parsers.add_loop_options(parser)
