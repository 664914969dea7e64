"""Embedding whole corpora (`fastbert embed`): reading rows, token-budget batching, output writers and resumable
shards (`embedder`), and the same pipeline on a Ray cluster (`ray`)."""
