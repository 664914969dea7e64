"""Embedding whole corpora (`fastbert embed`): reading rows, token-budget batching, output writers and resumable
shards, progress, and the same pipeline on a Ray cluster (`fastbert.embedding.ray`, imported on its own since it
needs Ray). Import the public names from this package."""

from fastbert.embedding.embedder import (
    DEFAULT_BATCH_TOKENS,
    FORMATS,
    MANIFEST,
    POOLINGS,
    Embedder,
    EmbedStats,
    FileOutput,
    InputError,
    NonFiniteEmbedding,
    Progress,
    Row,
    ShardedOutput,
    default_max_length,
    open_input,
    read_output,
    read_rows,
    run,
    sentence_transformers_head,
    skip_rows,
    windows,
)

__all__ = [
    "DEFAULT_BATCH_TOKENS", "FORMATS", "MANIFEST", "POOLINGS", "EmbedStats", "Embedder", "FileOutput", "InputError",
    "NonFiniteEmbedding", "Progress", "Row", "ShardedOutput", "default_max_length", "open_input", "read_output",
    "read_rows", "run", "sentence_transformers_head", "skip_rows", "windows",
]
