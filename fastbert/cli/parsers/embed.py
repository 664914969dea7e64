"""``fastbert embed``'s options (the command: `fastbert.cli.embed`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``embed`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser(
        "embed", help="embed texts or a whole corpus: streaming, one output row per input row, resumable",
        description="Embeddings of TEXT arguments, or of every row of --input (a text file with one text per line, "
        "JSONL, or stdin), written as they are computed, in input order: a blank text gives a null row, never a "
        "skipped one. Texts are sorted by length within a window of rows and batched by a token budget on the "
        "padding-free encoder. A progress line and a summary go to stderr.")
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (none: read --input, default stdin)")
    parsers.add_model_options(parser, dtype="auto")  # the fastest precision this machine runs well
    add_io_options(parser)
    add_model_run_options(parser)
    add_ray_options(parser)
    parser.add_argument("--similarity", action="store_true",
                        help="print the cosine similarity matrix of the TEXTs instead")
    return parser


def add_io_options(parser: argparse.ArgumentParser) -> None:
    """Where rows come from and where embeddings go."""
    parser.add_argument("-i", "--input", metavar="FILE", default=None,
                        help="one text per line, or JSONL with --field; '-' = stdin (the default without TEXT)")
    parser.add_argument("--input-format", choices=("auto", "text", "jsonl"), default="auto",
                        help="auto (default): jsonl for *.jsonl / *.ndjson, else text")
    parser.add_argument("--field", default=None, help="JSONL: the field holding the text (default: text)")
    parser.add_argument("--id-field", default=None,
                        help="JSONL: the field written as each row's id (default: the line number)")
    parser.add_argument("-o", "--output", metavar="FILE", default=None,
                        help="one output file, written as rows are done; format from the extension (.jsonl, .npy, "
                        ".parquet) or --format (default, and '-': JSONL on stdout). A stream takes JSONL only and is "
                        "never emptied nor replaced: /dev/stdout, /dev/stderr, /dev/fd/N are written through the "
                        "descriptor as the shell opened it (-o /dev/stdout >> FILE appends); a named pipe, a "
                        "terminal or another device is opened without truncating")
    parser.add_argument("--output-dir", metavar="DIR", default=None,
                        help="write shards (one per window) and manifest.json, each atomically: resumable with "
                        "--resume")
    parser.add_argument("--format", choices=parsers.OUTPUT_FORMATS, default=None,
                        help="output format (default: from --output's extension; jsonl otherwise)")
    parser.add_argument("--output-dtype", choices=("float32", "float16"), default="float32",
                        help="npy/parquet value type (default float32)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the interrupted run in --output-dir (same input and settings) after its last "
                        "complete shard")


def add_model_run_options(parser: argparse.ArgumentParser) -> None:
    """Pooling, normalisation, truncation, batching, windows, blank rows, progress and threads."""
    parser.add_argument("--pooling", choices=parsers.POOLINGS, default=None,
                        help="mean over real tokens or cls (default: what the checkpoint's sentence-transformers "
                        "1_Pooling declares, else mean)")
    parser.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                        help="L2-normalise each embedding (default: as the checkpoint's sentence-transformers "
                        "modules declare, else on)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per text, longer texts truncated and counted (default: the checkpoint's "
                        "sentence-transformers max_seq_length, else the model's limit)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="token budget per batch, real tokens (default 4096 on CPU, 16384 on CUDA, at least "
                        "--max-length)")
    parser.add_argument("--batch-size", type=int, default=None, help="at most this many texts per batch")
    parser.add_argument("--window-rows", type=int, default=None,
                        help="rows read, sorted and written together; one shard each with --output-dir (default "
                        "2048; with --ray 16384)")
    parser.add_argument("--on-blank", choices=("null", "error"), default="null",
                        help="a blank text: a null row (default) or stop with its line number. Blank is empty, "
                        "whitespace or only invisible characters (Unicode control and format characters: U+200B "
                        "zero width space, U+FEFF, direction marks, NUL...), or a text the tokenizer keeps nothing "
                        "of (a lone accent for an uncased model); error names its characters")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress on stderr (default: on when stderr is a terminal)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")


def add_ray_options(parser: argparse.ArgumentParser) -> None:
    """--ray and the cluster's settings."""
    parser.add_argument("--ray", action="store_true",
                        help="embed on a Ray cluster (fastbert.embedding.ray.RayEmbedder actors; pip install "
                             "'fastbert[ray]')")
    parser.add_argument("--ray-address", default=None,
                        help="the cluster to join, e.g. ray://head:10001 or auto (default: RAY_ADDRESS, else a new "
                        "local cluster)")
    parser.add_argument("--ray-actors", type=int, default=1, help="model replicas on Ray (default 1)")
    parser.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs per Ray actor (default 1)")
    parser.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs per Ray actor (default 0)")
