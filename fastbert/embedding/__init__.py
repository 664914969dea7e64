"""Embedding whole corpora (`fastbert embed`), one module per role:

- `reading`: input files and stdin, rows with their line numbers, `InputError`;
- `batching`: rows into windows, a window's texts into token-budget batches;
- `checkpoint`: what a checkpoint's sentence-transformers files declare (pooling, normalisation, max length);
- `embedder`: the `Embedder` (tokenizer + fastbert model), texts in, embeddings in the same order out;
- `formats`: JSONL, .npy and Parquet encodings; `outputs`: one file, or resumable shards with a manifest;
- `stats`: the counts of a run; `pipeline`: the run over windows (`run`) and its progress line;
- `ray`: the same pipeline on a Ray cluster (imported on its own since it needs Ray).

Import the public names from this package."""

from fastbert.embedding.batching import real_token_batches, windows
from fastbert.embedding.checkpoint import default_max_length, sentence_transformers_head
from fastbert.embedding.embedder import DEFAULT_BATCH_TOKENS, POOLINGS, Embedder, NonFiniteEmbedding
from fastbert.embedding.formats import FORMATS
from fastbert.embedding.outputs import (
    MANIFEST,
    FileOutput,
    ShardedOutput,
    check_run_directory,
    check_stream,
    is_stream,
    own_descriptor,
    read_output,
    release_reader,
)
from fastbert.embedding.pipeline import Progress, run, skip_rows
from fastbert.embedding.reading import (
    InputError,
    Row,
    check_input_path,
    invisible_note,
    is_blank,
    open_input,
    read_rows,
    text_row,
)
from fastbert.embedding.stats import EmbedStats, invisible_rows_note, truncation_note

__all__ = [
    "DEFAULT_BATCH_TOKENS", "FORMATS", "MANIFEST", "POOLINGS", "EmbedStats", "Embedder", "FileOutput", "InputError",
    "NonFiniteEmbedding", "Progress", "Row", "ShardedOutput", "check_input_path", "check_run_directory", "check_stream",
    "default_max_length", "invisible_note", "invisible_rows_note", "is_blank", "is_stream", "open_input",
    "own_descriptor", "read_output", "read_rows", "release_reader", "run", "sentence_transformers_head", "skip_rows",
    "real_token_batches", "text_row", "truncation_note", "windows",
]
