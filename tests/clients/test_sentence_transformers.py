"""sentence-transformers: `SentenceTransformer.encode` on an optimized all-MiniLM-L6-v2 against an untouched
instance, over its options, and from 8 threads at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer

import fastbert
from fastbert.bench.recording import backends_used, record_backends
from fastbert.common.text import SENTENCES
from tests.helpers import ARCHITECTURE_OPS, assert_close, run_both

# Mixed lengths: a 1-word text, sentences, and one longer than the model's max_seq_length (truncated).
LONG_TEXT = " ".join(SENTENCES * 2)
ST_TEXTS = ["Hello", *SENTENCES[:6], LONG_TEXT, "Is it safe?"]


@pytest.fixture(scope="module")
def st_pair(minilm_dir):
    """(untouched SentenceTransformer, a second instance optimized)."""
    reference = SentenceTransformer(minilm_dir, device="cpu")
    return reference, fastbert.optimize(SentenceTransformer(minilm_dir, device="cpu"))


def test_long_text_is_truncated(st_pair):
    reference, _ = st_pair
    assert len(reference.tokenizer(LONG_TEXT)["input_ids"]) > reference.max_seq_length


ENCODE_OPTIONS = {
    "numpy": dict(convert_to_numpy=True),
    "numpy-normalized": dict(convert_to_numpy=True, normalize_embeddings=True),
    "tensor": dict(convert_to_tensor=True),
    "tensor-normalized": dict(convert_to_tensor=True, normalize_embeddings=True),
    "list-of-tensors": dict(convert_to_numpy=False),
}


@pytest.mark.parametrize("batch_size", [1, 4], ids=["batch1", "batch4"])
@pytest.mark.parametrize("options", ENCODE_OPTIONS.values(), ids=ENCODE_OPTIONS.keys())
def test_encode(st_pair, options, batch_size):
    def call(model):
        return model.encode(ST_TEXTS, batch_size=batch_size, precision="float32", show_progress_bar=False,
                            **options)

    expected, actual = run_both(call, *st_pair)
    assert type(actual) is type(expected)
    if isinstance(expected, list):  # convert_to_numpy=False: one tensor per text
        assert len(actual) == len(expected) == len(ST_TEXTS)
        expected, actual = torch.stack(expected), torch.stack(actual)
    assert actual.shape == expected.shape == (len(ST_TEXTS), 384)
    assert actual.dtype == expected.dtype
    assert_close(actual, expected, "sentence embeddings")


def test_encode_one_string(st_pair):
    expected, actual = run_both(lambda model: model.encode(ST_TEXTS[1], show_progress_bar=False), *st_pair)
    assert isinstance(actual, np.ndarray) and actual.shape == expected.shape == (384,)
    assert_close(actual, expected, "sentence embedding")


@pytest.mark.parametrize("batch_size", [1, 4], ids=["batch1", "batch4"])
def test_encode_token_embeddings(st_pair, batch_size):
    """Per-text token embeddings, cut to each text's real tokens by sentence-transformers (the long text to
    max_seq_length)."""
    def call(model):
        return model.encode(ST_TEXTS, output_value="token_embeddings", batch_size=batch_size,
                            show_progress_bar=False)

    expected, actual = run_both(call, *st_pair)
    assert len(actual) == len(expected) == len(ST_TEXTS)
    tokenizer = st_pair[0].tokenizer
    for text, want, got in zip(ST_TEXTS, expected, actual, strict=True):
        real = min(len(tokenizer(text)["input_ids"]), st_pair[0].max_seq_length)
        assert got.shape == want.shape == (real, 384), text
        assert_close(got, want, f"token embeddings of {text[:40]!r}")


def test_encode_from_threads(minilm_dir, st_pair):
    """8 threads encode different subsets at once with one freshly optimized model (its first calls race):
    each gets what a sequential encode of its subset gives, and the untouched model's embeddings."""
    model = fastbert.optimize(SentenceTransformer(minilm_dir, device="cpu"))
    subsets = [[ST_TEXTS[(start + k) % len(ST_TEXTS)] for k in range(1 + start % 4)] for start in range(8)]

    def encode(texts):
        return model.encode(texts, batch_size=2, show_progress_bar=False)

    with record_backends() as seen, ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(encode, subsets))
    assert set(seen) == set(ARCHITECTURE_OPS["post"]), (
        f"fastbert's path did not run in the threads: {backends_used(seen)}")
    reference = st_pair[0]
    for texts, got in zip(subsets, concurrent, strict=True):
        sequential = encode(texts)
        assert got.shape == sequential.shape == (len(texts), 384)
        assert_close(got, sequential, f"threaded vs sequential encode of {len(texts)} texts")
        assert_close(got, reference.encode(texts, batch_size=2, show_progress_bar=False), "threaded vs untouched")


def test_training_with_a_sentence_transformers_loss(minilm_dir):
    """A sentence-transformers training loop (MultipleNegativesRankingLoss, SGD) on an optimized model: fastbert's
    path on every training forward, losses and the fine-tuned embeddings those of the untouched model (dropout
    off on both)."""
    import copy

    from sentence_transformers import losses

    anchors = ["How do I open a file?", "What is a list comprehension?", "How to sort a dict by value", "Read JSON"]
    positives = ["Use open() with a mode.", "A concise way to build lists.", "sorted(d.items(), key=...)", "json.load"]
    reference = SentenceTransformer(minilm_dir, device="cpu")
    for module in reference.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = reference[0].auto_model.config
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    optimized = fastbert.optimize(copy.deepcopy(reference))

    def train(model) -> list[float]:
        model.train()
        loss_fn = losses.MultipleNegativesRankingLoss(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        history = []
        for _ in range(3):
            features = [model.preprocess(anchors), model.preprocess(positives)]
            loss = loss_fn(features, None)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        model.eval()
        return history

    expected, actual = run_both(train, reference, optimized, forwards=6)
    assert_close(actual, expected, "training losses")
    with torch.inference_mode():
        assert_close(optimized.encode(anchors), reference.encode(anchors), "embeddings after training")
