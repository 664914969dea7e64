"""fastbert.optimize on live transformers models: every family, every head class, against the untouched model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import transformers

import fastbert
from fastbert import backends
from fastbert.bench.recording import backends_used, record_backends
from tests.helpers import HEADS, fused_ops, optimize_inputs, padded_batch, rel_err, tiny_model

# CI builds the C++ extension: every op must run on it (a `supports` regression that falls back to eager fails).
EXPECTED_BACKEND = "eager" if os.environ.get("FASTBERT_SKIP_EXT", "0").lower() in ("1", "true", "yes") else "cpp"
PER_TOKEN = {"last_hidden_state", "prediction_logits", "start_logits", "end_logits"}
CASES = [(family, head) for family, heads in HEADS.items() for head in heads]


def expected_backends(model) -> dict[str, str]:
    """op -> the backend it must run on: EXPECTED_BACKEND wherever that backend implements the op (an op it has
    not implemented yet runs on eager)."""
    return {op: EXPECTED_BACKEND if EXPECTED_BACKEND in backends.implementations(op) else "eager"
            for op in fused_ops(model)}


def _compare(reference, optimized, mask: torch.Tensor) -> dict[str, float]:
    errors = {}
    keep = mask.bool().reshape(-1, mask.shape[-1])
    for name, expected in reference.items():
        if not isinstance(expected, torch.Tensor):
            continue
        actual = optimized[name]
        assert actual.shape == expected.shape, name
        if name in PER_TOKEN or (name == "logits" and expected.dim() >= 2 and expected.shape[1] == mask.shape[-1]):
            expected, actual = expected.reshape(*keep.shape, -1)[keep], actual.reshape(*keep.shape, -1)[keep]
        errors[name] = rel_err(actual, expected)
    return errors


@pytest.mark.parametrize(("family", "head"), CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_optimize_matches_transformers(family, head):
    reference = tiny_model(family, head)
    optimized = fastbert.optimize(copy.deepcopy(reference))
    assert type(optimized) is type(reference)
    inputs = optimize_inputs(family, head, reference)
    with torch.inference_mode(), record_backends() as seen:
        expected = reference(**inputs)
        actual = optimized(**inputs)
    assert backends_used(seen) == expected_backends(reference), "not every op ran on its backend"
    assert type(actual) is type(expected)
    errors = _compare(expected, actual, inputs["attention_mask"])
    assert errors, "nothing compared"
    if "labels" in inputs or "start_positions" in inputs:
        assert "loss" in errors
    assert max(errors.values()) <= 1e-5, errors


def test_optimize_keeps_state_dict_and_shares_weights():
    model = tiny_model("bert", "ForSequenceClassification")
    keys = list(model.state_dict())
    fastbert.optimize(model)
    assert list(model.state_dict()) == keys
    layer = model.bert.encoder.layer[0].attention.self
    packed = model.bert._fastbert.build.fast.layers[0].qkv_weight
    # fastbert's packed Q/K/V is a copy of its own: no parameter of the model shares storage with another
    assert layer.query.weight.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    ids, mask = padded_batch()
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():  # an in-place update of the original parameter must reach fastbert's packed weight
        layer.key.weight.mul_(0.5)
        model.bert.encoder.layer[1].output.dense.weight.mul_(2.0)
    reference = copy.deepcopy(model)
    del reference.bert.forward  # back to transformers' own forward
    with torch.inference_mode():
        after = model(input_ids=ids, attention_mask=mask).logits
        expected = reference(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(before, after)
    assert rel_err(after, expected) <= 1e-5


def test_optimize_survives_dtype_and_device_moves():
    model = fastbert.optimize(tiny_model("roberta"))
    reference = tiny_model("roberta").double()
    model.double()
    ids, mask = padded_batch(pad_id=1)
    with torch.inference_mode():
        actual = model(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    assert actual.dtype == torch.float64
    keep = mask.bool()
    assert rel_err(actual[keep], expected[keep]) <= 1e-10


@pytest.fixture
def bert_pair():
    """(untouched transformers BertModel, an optimized copy, ids, mask) on a padded batch."""
    reference = tiny_model("bert")
    return reference, fastbert.optimize(copy.deepcopy(reference)), *padded_batch()


def test_optimize_hidden_states_and_tuple_outputs(bert_pair):
    reference, model, ids, mask = bert_pair
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        actual = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        as_tuple = model(input_ids=ids, attention_mask=mask, return_dict=False)
    assert len(actual.hidden_states) == len(expected.hidden_states) == 3
    keep = mask.bool()
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        assert rel_err(got[keep], want[keep]) <= 1e-5
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], actual.last_hidden_state)


def test_optimize_runs_original_code_where_fastbert_cannot(bert_pair):
    reference, model, ids, mask = bert_pair
    with torch.inference_mode(), record_backends() as seen:
        out = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        expected = reference(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert not seen  # transformers' own code ran: no fastbert op
    assert len(out.attentions) == 2
    for got, want in zip(out.attentions, expected.attentions, strict=True):
        assert torch.equal(got, want)
    with record_backends() as seen:  # grad enabled: fastbert's path, differentiable (tests/test_optimize_training)
        out = model(input_ids=ids, attention_mask=mask)
    assert seen and out.last_hidden_state.requires_grad
    model.train()  # dropout, on fastbert's path too: two calls differ
    with torch.no_grad(), record_backends() as seen:
        first, second = (model(input_ids=ids, attention_mask=mask).last_hidden_state for _ in range(2))
    assert seen and not torch.equal(first, second)
    model.eval()


@pytest.mark.parametrize("option", ["is_decoder", "relative_key"])
def test_optimize_rejects_unsupported_configurations(option):
    kwargs = {"is_decoder": True} if option == "is_decoder" else {"position_embedding_type": "relative_key"}
    model = tiny_model("bert", **kwargs)
    with pytest.raises(ValueError, match=option.split("_")[0]):
        fastbert.optimize(model)


def test_optimize_rejects_an_unknown_backend_before_changing_the_model():
    model = tiny_model("bert")
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):
        fastbert.optimize(model, backend="bogus")
    assert not fastbert.is_optimized(model)


def test_optimize_rejects_models_without_supported_encoder():
    for not_a_module in (None, "sentence-transformers/all-MiniLM-L6-v2"):
        with pytest.raises(TypeError, match=r"^fastbert.optimize takes a torch.nn.Module .* got (NoneType|str)$"):
            fastbert.optimize(not_a_module)
    with pytest.raises(ValueError, match="no transformers model"):
        fastbert.optimize(torch.nn.Linear(2, 2))
    gpt = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not supported"):
        fastbert.optimize(gpt)
