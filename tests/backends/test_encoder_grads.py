"""A whole encoder trained through each fused backend: loss.backward() through a FastBertModel gives eager's parameter
gradients (each within fastbert.numerics' rule, every op on the backend), and in train mode with dropout the triton
backend runs every op, fuses the dropout (one torch seed repeats, another changes the output) and sends finite
gradients to every parameter. On CPU the triton kernels run in the Triton interpreter (`interpreter`)."""

from __future__ import annotations

import importlib

import pytest
import torch

import fastbert
from fastbert import backends
from fastbert.bench.recording import record_backends
from fastbert.numerics import assert_accurate
from tests.helpers import DEVICE, padded_batch, tiny_model

CASES = [pytest.param("cpp", family, padding_free, id=f"cpp-{family}-{'packed' if padding_free else 'padded'}")
         for family in ("bert", "modernbert") for padding_free in (True, False)]
CASES += [pytest.param("triton", family, None, id=f"triton-{family}", marks=pytest.mark.interpreter)
          for family in ("bert", "modernbert")]


@pytest.mark.parametrize("backend, family, padding_free", CASES)
def test_encoder_parameter_grads_equal_eager(backend, family, padding_free, tmp_path):
    """Eval mode, packed or padded (cpp; triton: the model's default): the backend's parameter gradients are
    eager's, and every op ran on the backend."""
    reason = backends.available()[backend]
    if reason is not None:
        pytest.fail(reason)
    device = DEVICE if backend == "triton" else torch.device("cpu")
    tiny_model(family).save_pretrained(tmp_path)
    ids, mask = (t.to(device) for t in padded_batch(*((3, 9) if backend == "triton" else (4, 11))))
    grads = {}
    for name in ("eager", backend):
        model = fastbert.from_pretrained(tmp_path, backend=name, device=device).eval()
        if padding_free is not None:
            model.padding_free = padding_free
        with record_backends() as seen:
            hidden = model(ids, mask).last_hidden_state
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(4)).to(device)
        (hidden * weights).sum().backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert {b for counts in seen.values() for b in counts} == {name}, seen
    assert grads[backend].keys() == grads["eager"].keys() and len(grads[backend]) > 10
    for name, reference in grads["eager"].items():
        assert_accurate(grads[backend][name], reference, reference, what=f"{family} {name}")


@pytest.mark.interpreter
def test_triton_bert_training_step_with_dropout(tmp_path):
    """A tiny BERT in train mode (dropout 0.1 at every site): every op on triton, dropout fused (two seeds give two
    outputs, one seed the same), finite gradients for every parameter."""
    tiny_model("bert").save_pretrained(tmp_path)
    ids, mask = (t.to(DEVICE) for t in padded_batch(3, 9))
    model = fastbert.from_pretrained(tmp_path, backend="triton", device=DEVICE).train()
    assert model.config.embedding_dropout > 0 and model.config.ffn_dropout > 0
    torch.manual_seed(5)
    with record_backends() as seen:
        hidden = model(ids, mask).last_hidden_state
    assert {b for counts in seen.values() for b in counts} == {"triton"}, seen
    hidden.square().mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if "pooler" not in name}  # the pooler: unused
    missing = [name for name, g in grads.items() if g is None or not torch.isfinite(g).all()]
    assert len(grads) > 10 and not missing, missing
    with torch.no_grad():
        torch.manual_seed(5)
        again = model(ids, mask).last_hidden_state
        torch.manual_seed(6)
        other = model(ids, mask).last_hidden_state
    assert torch.equal(hidden.detach(), again) and not torch.equal(again, other)


@pytest.mark.interpreter
def test_triton_encoder_trains_with_attention_dropout(monkeypatch, tmp_path):
    """A BERT encoder in training mode (the config's dropout 0.1) on the triton backend: every op on triton, the
    attention kernel launched with dropout, finite gradients, the same torch seed repeating output and gradients,
    another seed changing them."""
    thresholds = []
    attention_kernels = importlib.import_module("fastbert.kernels.attention")
    original = attention_kernels._threshold
    monkeypatch.setattr(attention_kernels, "_threshold", lambda p: thresholds.append(p) or original(p))
    tiny_model("bert").save_pretrained(tmp_path)
    ids, mask = (t.to(DEVICE) for t in padded_batch(3, 9))
    model = fastbert.from_pretrained(tmp_path, backend="triton", device=DEVICE).train()
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        with record_backends() as seen:
            hidden = model(ids, mask).last_hidden_state
        (hidden * mask[:, :, None]).sum().backward()
        runs.append((hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        model.zero_grad()
        assert {b for counts in seen.values() for b in counts} == {"triton"}, seen
    assert model.config.attention_dropout > 0 and thresholds
    assert all(p == pytest.approx(model.config.attention_dropout) for p in thresholds)
    (first, first_grads), (again, again_grads), (other, _) = runs
    assert torch.equal(first, again) and (first - other).abs().max() > 0.1
    assert len(first_grads) > 10
    for a, b in zip(first_grads, again_grads, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
