"""transformers pipelines on an optimized model against the same pipeline on the untouched model.

Each pipeline runs on a list of texts one text per forward (batch1) and in padded batches of 4 (batch4); outputs
must agree (labels, tokens, words and offsets exactly; scores and features within 1e-5 relative, fill-mask
scores within 2e-5, since a lone "[MASK]" measured 5e-6) and fastbert's
encoder must have run on every forward of the optimized run.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import transformers

from tests.helpers import (
    BATCHING,
    FAMILY_INPUT_NAMES,
    OTHER_FAMILIES,
    PAIRS,
    TEXTS,
    TOL,
    assert_close,
    optimized_copy,
    run_both,
    split_records,
    tiny_family_model,
)

NER_TEXTS = [
    "My name is Sarah and I live in London.",
    "Angela Merkel met Emmanuel Macron in Paris on Tuesday.",
    "Hi",
    "The river Thames flows through Oxford and Reading before it reaches the sea.",
    "Where is Berlin?",
]
MASKED_TEXTS = [
    "The capital of France is [MASK].",
    "I like to eat [MASK] for breakfast.",
    "[MASK]",
    "She plays the [MASK] every evening after a long day at the office.",
    "The [MASK] sat on the mat.",
]
ZERO_SHOT_LABELS = ["weather", "technology", "mountains", "nature"]


def _pipe(task: str, model, tokenizer, **kwargs):
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, **kwargs)


def _compare_features(expected, actual, texts, tokenizer) -> None:
    """Feature-extraction outputs, one [1, padded length, H] per text: same shapes; equal features at the text's
    real tokens (fastbert leaves padded positions at zero where transformers computes unused values: README)."""
    assert len(actual) == len(expected) == len(texts)
    for text, want, got in zip(texts, expected, actual, strict=True):
        want, got = np.asarray(want), np.asarray(got)
        assert got.shape == want.shape, text
        real = len(tokenizer(text)["input_ids"])
        assert_close(got[0, :real], want[0, :real], f"features of {text!r}")


def _compare_records(expected, actual, numeric=("score",), tol: float = TOL) -> None:
    """Lists (per input) of lists of result dicts: non-numeric fields equal, numeric ones within tolerance."""
    assert len(actual) == len(expected)
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        want_exact, want_values = split_records(want, numeric)
        got_exact, got_values = split_records(got, numeric)
        assert got_exact == want_exact, f"input {index}"
        assert_close(got_values, want_values, f"scores of input {index}", tol=tol)


# -------------------------------------------------------------------------------------------- MiniLM (BERT)
@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
def test_feature_extraction(minilm_pair, tokenizer, batch_size):
    expected, actual = run_both(
        lambda model: _pipe("feature-extraction", model, tokenizer)(TEXTS, batch_size=batch_size), *minilm_pair)
    _compare_features(expected, actual, TEXTS, tokenizer)


def test_feature_extraction_single_text(minilm_pair, tokenizer):
    text = TEXTS[2]
    expected, actual = run_both(lambda model: _pipe("feature-extraction", model, tokenizer)(text), *minilm_pair)
    _compare_features([expected], [actual], [text], tokenizer)


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
@pytest.mark.parametrize("inputs", [TEXTS, PAIRS], ids=["single-sentence", "sentence-pair"])
def test_text_classification(nli_pair, tokenizer, inputs, batch_size):
    expected, actual = run_both(
        lambda model: _pipe("text-classification", model, tokenizer)(inputs, top_k=None, batch_size=batch_size),
        *nli_pair)
    _compare_records(expected, actual)
    assert {r["label"] for r in expected[0]} == {"contradiction", "neutral", "entailment"}


def test_text_classification_single_text(nli_pair, tokenizer):
    expected, actual = run_both(lambda model: _pipe("text-classification", model, tokenizer)(TEXTS[1]), *nli_pair)
    _compare_records([expected], [actual])


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
@pytest.mark.parametrize("multi_label", [False, True], ids=["single-label", "multi-label"])
def test_zero_shot_classification(nli_pair, tokenizer, multi_label, batch_size):
    def call(model):
        pipe = _pipe("zero-shot-classification", model, tokenizer)
        return pipe(TEXTS, candidate_labels=ZERO_SHOT_LABELS, multi_label=multi_label, batch_size=batch_size)

    expected, actual = run_both(call, *nli_pair)
    assert len(actual) == len(expected) == len(TEXTS)
    for want, got in zip(expected, actual, strict=True):
        assert got["sequence"] == want["sequence"]
        assert got["labels"] == want["labels"], want["sequence"]
        assert_close(got["scores"], want["scores"], f"zero-shot scores of {want['sequence']!r}")


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
def test_token_classification(ner_pair, tokenizer, batch_size):
    def call(model):
        pipe = _pipe("token-classification", model, tokenizer, aggregation_strategy="simple")
        return pipe(NER_TEXTS, batch_size=batch_size)

    expected, actual = run_both(call, *ner_pair)
    assert sum(len(entities) for entities in expected) > len(NER_TEXTS), "too few entities to compare"
    _compare_records(expected, actual)


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
def test_fill_mask(mlm_pair, tokenizer, batch_size):
    expected, actual = run_both(
        lambda model: _pipe("fill-mask", model, tokenizer)(MASKED_TEXTS, top_k=5, batch_size=batch_size), *mlm_pair)
    assert all(len(candidates) == 5 for candidates in expected)
    # Softmaxes over 30522 logits of magnitude ~20 (a LayerNorm'd hidden state against the word embeddings): the
    # encoder's float32 rounding grows by that scale (5e-6 measured on "[MASK]" alone), so twice the usual bound.
    _compare_records(expected, actual, tol=2 * TOL)


# ------------------------------------------------------------------------------ tiny models of other families
@functools.cache
def _family_tokenizer(path: str, family: str):
    """MiniLM's tokenizer returning the inputs the family's own tokenizer returns."""
    return transformers.AutoTokenizer.from_pretrained(path, model_input_names=FAMILY_INPUT_NAMES[family])


def _family_pair(family: str, head: str, tokenizer):
    reference = tiny_family_model(family, head, vocab_size=len(tokenizer))
    return reference, optimized_copy(reference)


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_feature_extraction(minilm_dir, family, batch_size):
    tokenizer = _family_tokenizer(minilm_dir, family)
    pair = _family_pair(family, "Model", tokenizer)
    expected, actual = run_both(
        lambda model: _pipe("feature-extraction", model, tokenizer)(TEXTS, batch_size=batch_size), *pair)
    _compare_features(expected, actual, TEXTS, tokenizer)


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_text_classification(minilm_dir, family, batch_size):
    tokenizer = _family_tokenizer(minilm_dir, family)
    pair = _family_pair(family, "ForSequenceClassification", tokenizer)
    expected, actual = run_both(
        lambda model: _pipe("text-classification", model, tokenizer)(TEXTS, top_k=None, batch_size=batch_size),
        *pair)
    _compare_records(expected, actual)


def test_distilbert_with_a_bert_tokenizer(minilm_dir, tokenizer):
    """MiniLM's tokenizer as it is returns token_type_ids, which transformers' DistilBERT accepts and ignores:
    the optimized model must give the untouched model's results too (whether or not fastbert's path runs)."""
    reference, optimized = _family_pair("distilbert", "ForSequenceClassification", tokenizer)
    assert "token_type_ids" in tokenizer(TEXTS[0])
    expected = _pipe("text-classification", reference, tokenizer)(TEXTS, top_k=None, batch_size=4)
    actual = _pipe("text-classification", optimized, tokenizer)(TEXTS, top_k=None, batch_size=4)
    _compare_records(expected, actual)


@pytest.mark.parametrize("batch_size", BATCHING.values(), ids=BATCHING.keys())
def test_modernbert_fill_mask(minilm_dir, batch_size):
    """ModernBERT's masked-LM class (prediction head, decoder tied to the token embeddings) under fill-mask."""
    tokenizer = _family_tokenizer(minilm_dir, "modernbert")
    pair = _family_pair("modernbert", "ForMaskedLM", tokenizer)
    expected, actual = run_both(
        lambda model: _pipe("fill-mask", model, tokenizer)(MASKED_TEXTS, top_k=5, batch_size=batch_size), *pair)
    assert all(len(candidates) == 5 for candidates in expected)
    _compare_records(expected, actual, tol=2 * TOL)
