"""What the bench tests share."""

import pytest


@pytest.fixture
def bert_ops() -> set[str]:
    """The fused ops a BERT encoder (MiniLM here) runs: ModernBERT's qkv_rotary, linear_glu and
    linear_residual_prenorm are not among them, so a BERT forward records a subset of `fastbert.bench.recording.OPS`."""
    return {"embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm"}
