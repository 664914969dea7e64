"""Losses whose labels reach padded positions (a collator that does not write -100 there, question answering's
span softmax over the whole row) equal transformers': those calls run fastbert's padded form, which computes
padded positions as transformers does (the padding-free form leaves zeros there)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fastbert
from tests.helpers import HEADS, optimize_inputs, padded_batch, tiny_model

TOKEN_HEADS = ("ForTokenClassification", "ForMaskedLM", "ForQuestionAnswering")
CASES = [(family, head) for family, heads in HEADS.items() for head in heads if head in TOKEN_HEADS]


def labels_at_padding(family: str, head: str, model: torch.nn.Module) -> dict:
    """``optimize_inputs`` on a right-padded batch (odd sizes: 5 x 11), with labels at every position, padding
    included (QA: span positions on rows that have padding)."""
    inputs = optimize_inputs(family, head, model)
    ids, mask = padded_batch(5, 11, pad_id=model.config.pad_token_id or 0, generator_seed=3)
    inputs.update(input_ids=ids, attention_mask=mask)
    if "token_type_ids" in inputs:
        inputs["token_type_ids"] = torch.zeros_like(ids)
    gen = torch.Generator().manual_seed(4)
    if head == "ForQuestionAnswering":
        inputs["start_positions"] = torch.randint(0, 3, (5,), generator=gen)
        inputs["end_positions"] = inputs["start_positions"] + 1
    else:
        classes = model.config.vocab_size if head == "ForMaskedLM" else model.config.num_labels
        inputs["labels"] = torch.randint(0, classes, ids.shape, generator=gen)
    return inputs


@pytest.mark.parametrize(("family", "head"), CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_loss_with_labels_at_padded_positions_equals_transformers(family, head):
    """Every family's token heads; ModernBERT's sliding-window layers hand the call to transformers, with a
    warning that says why (its padded form gives zeros where a window holds no real key)."""
    reference = tiny_model(family, head)
    optimized = fastbert.optimize(copy.deepcopy(reference))
    inputs = labels_at_padding(family, head, reference)
    assert not inputs["attention_mask"].all()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        expected, got = reference(**inputs).loss, optimized(**inputs).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    handed_back = [str(w.message) for w in caught if "loss reads padded positions" in str(w.message)]
    assert len(handed_back) == (1 if family == "modernbert" else 0), handed_back


def test_modernbert_without_sliding_windows_takes_the_padded_form():
    family, head = "modernbert", "ForTokenClassification"
    reference = tiny_model(family, head, local_attention=64)  # wider than the batch: every layer sees every key
    optimized = fastbert.optimize(copy.deepcopy(reference))
    inputs = labels_at_padding(family, head, reference)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no hand-back
        expected, got = reference(**inputs).loss, optimized(**inputs).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_training_loss_and_gradients_with_labels_at_padding_equal_transformers():
    family, head = "bert", "ForTokenClassification"
    reference = tiny_model(family, head, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0).train()
    optimized = fastbert.optimize(copy.deepcopy(reference))
    inputs = labels_at_padding(family, head, reference)
    expected, got = reference(**inputs).loss, optimized(**inputs).loss
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    expected.backward()
    got.backward()
    for (name, want), have in zip(reference.named_parameters(), optimized.parameters(), strict=True):
        torch.testing.assert_close(have.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_ignored_labels_at_padding_keep_the_padding_free_form():
    """-100 at padding (transformers' collators): the loss reads no padded position, the call stays padding-free
    (zeros at padded positions), and the next call without labels is padding-free too."""
    family, head = "bert", "ForTokenClassification"
    optimized = fastbert.optimize(tiny_model(family, head))
    inputs = labels_at_padding(family, head, optimized)
    padded = inputs["attention_mask"] == 0
    hidden = []
    optimized.bert.register_forward_hook(lambda module, args, output: hidden.append(output.last_hidden_state))
    with torch.no_grad():
        optimized(**{**inputs, "labels": inputs["labels"].masked_fill(padded, -100)})
        optimized(**inputs)  # labels at padding: the padded form (values there, as transformers')
        optimized(**{k: v for k, v in inputs.items() if k != "labels"})
    assert [bool(state[padded].abs().max() == 0) for state in hidden] == [True, False, True]
