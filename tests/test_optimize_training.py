"""fastbert.optimize in training: every family and head trains through fastbert's ops (no fallback), with the
loss and every parameter's gradient equal to the untouched model's (dropout off, fp32); dropout sits where
transformers puts it (each site checked alone at p = 1, where both sides are deterministic); dropout follows
train()/eval(), is reproducible under torch.manual_seed; optimizer steps reach both paths; mixed precision
(autocast) trains through fastbert as accurately as transformers' own autocast; what cannot train through fastbert
(gradient checkpointing) falls back with its reason."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fastbert
from fastbert.bench.recording import record_backends
from fastbert.numerics import assert_accurate
from tests.helpers import HEADS, fused_ops, optimize_inputs, padded_batch, rel_err, tiny_config, tiny_model

CASES = [(family, head) for family, heads in HEADS.items() for head in heads]
# Gradients: fp32 sums in another order. Their error relative to the model's largest gradient must stay within
# GRAD_TOL; each parameter's, relative to its own largest element, within PARAM_GRAD_TOL, with a floor of 1e-2 of the
# model's largest gradient: some gradients are zero up to rounding (the key bias's; a multiple-choice classifier's
# bias: softmax minus one-hot summed over the choices), and their rounding noise has no relative size.
GRAD_TOL = 1e-5
PARAM_GRAD_TOL = 1e-4


def no_dropout(family: str) -> dict:
    """Config overrides that switch off every dropout of the family's config (encoder and heads)."""
    return {name: 0.0 for name, value in tiny_config(family).to_dict().items()
            if "dropout" in name and isinstance(value, float)}


def _loss(output, mask: torch.Tensor) -> torch.Tensor:
    """The loss, or for a base model a fixed projection of last_hidden_state at real positions (transformers
    computes rows at padded positions too, fastbert zeros)."""
    if getattr(output, "loss", None) is not None:
        return output.loss
    hidden = output.last_hidden_state * mask[..., None]
    weights = torch.linspace(0.5, 1.5, hidden.numel()).view(hidden.shape)
    return (hidden * weights).square().sum()  # (squares: no cancellation to magnify rounding in the sum)


def _step(model, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model(**inputs), inputs["attention_mask"])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys(), set(actual) ^ set(expected)
    scale = max(float(g.abs().max()) for g in expected.values())
    overall = max(float((actual[n] - g).abs().max()) for n, g in expected.items()) / scale
    assert overall <= GRAD_TOL, f"gradient error {overall:.3g} of the largest gradient"
    errors = {n: rel_err(actual[n], g, floor=1e-2 * scale) for n, g in expected.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= PARAM_GRAD_TOL, f"{worst}: {errors[worst]:.3g}"


def _fastbert_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "fastbert" in str(w.message)]


@pytest.mark.parametrize(("family", "head"), CASES, ids=[f"{f}-{h}" for f, h in CASES])
def test_training_step_matches_transformers(family, head):
    reference = tiny_model(family, head, **no_dropout(family)).train()
    optimized = fastbert.optimize(copy.deepcopy(reference)).train()
    inputs = optimize_inputs(family, head, reference)
    expected_loss, expected = _step(reference, inputs)
    with warnings.catch_warnings(record=True) as record, record_backends() as seen:
        warnings.simplefilter("always")
        actual_loss, actual = _step(optimized, inputs)
    assert not _fastbert_warnings(record), _fastbert_warnings(record)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run (a fallback)"
    assert rel_err(actual_loss, expected_loss) <= 1e-5
    assert_same_gradients(actual, expected)


def _sites(family: str) -> list[str]:
    """The family's config fields that set a dropout probability inside the encoder."""
    return {"distilbert": ["dropout", "attention_dropout"],
            "modernbert": ["embedding_dropout", "attention_dropout", "mlp_dropout"]}.get(
        family, ["hidden_dropout_prob", "attention_probs_dropout_prob"])


SITE_CASES = [(family, site) for family in HEADS for site in _sites(family)]


@pytest.mark.parametrize(("family", "site"), SITE_CASES, ids=[f"{f}-{s}" for f, s in SITE_CASES])
def test_each_dropout_site_is_where_transformers_has_it(family, site):
    """One site at p = 1 (everything it touches dropped: deterministic on both sides), the others off: the
    training-mode outputs agree only if fastbert drops the same tensors."""
    overrides = {**no_dropout(family), site: 1.0}
    reference = tiny_model(family, "Model", **overrides).train()
    optimized = fastbert.optimize(copy.deepcopy(reference)).train()
    ids, mask = padded_batch(pad_id=reference.config.pad_token_id or 0)
    with torch.no_grad(), record_backends() as seen:
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = optimized(input_ids=ids, attention_mask=mask).last_hidden_state
    assert seen, "fastbert's encoder did not run"
    keep = mask.bool()
    assert rel_err(actual[keep], expected[keep]) <= 1e-5
    with torch.no_grad():  # and it did drop something: the eval-mode output differs
        plain = optimized.eval()(input_ids=ids, attention_mask=mask).last_hidden_state
    assert rel_err(plain[keep], expected[keep]) > 1e-3


def test_dropout_follows_the_mode_and_the_seed():
    model = fastbert.optimize(tiny_model("bert", "Model", hidden_dropout_prob=0.2,
                                         attention_probs_dropout_prob=0.2))
    ids, mask = padded_batch()
    keep = mask.bool()

    def run():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state[keep]

    model.eval()
    state = torch.random.get_rng_state()
    first, second = run(), run()
    assert torch.equal(first, second)
    assert torch.equal(state, torch.random.get_rng_state()), "an eval forward consumed random numbers"
    model.train()
    torch.manual_seed(3)
    dropped = run()
    torch.manual_seed(3)
    again = run()
    assert torch.equal(dropped, again), "the same torch seed must give the same dropout"
    assert not torch.equal(dropped, run())
    assert not torch.equal(dropped, first)
    assert torch.isfinite(dropped).all()


def test_optimizer_steps_reach_the_optimized_model():
    """SGD with momentum on the model's own parameters (the packed Q/K/V's originals included): after some steps
    the optimized model equals the untouched one trained alike, and its eval-mode (no-grad) path sees the update.
    (Not Adam: it scales the rounding noise of gradients that are zero in theory up to full-size steps.)"""
    reference = tiny_model("bert", "ForSequenceClassification", **no_dropout("bert")).train()
    optimized = fastbert.optimize(copy.deepcopy(reference)).train()
    inputs = optimize_inputs("bert", "ForSequenceClassification", reference)
    for model in (reference, optimized):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(3):
            optimizer.zero_grad()
            model(**inputs).loss.backward()
            optimizer.step()
    for (name, a), (_, b) in zip(optimized.named_parameters(), reference.named_parameters(), strict=True):
        assert rel_err(a, b) <= 1e-5, name
    with torch.inference_mode(), record_backends() as seen:
        expected = reference.eval()(**inputs).logits
        actual = optimized.eval()(**inputs).logits
    assert seen
    assert rel_err(actual, expected) <= 1e-5


def test_what_cannot_train_through_fastbert_falls_back_with_its_reason():
    model = fastbert.optimize(tiny_model("bert", "ForSequenceClassification")).train()
    inputs = optimize_inputs("bert", "ForSequenceClassification", model)
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match="gradient checkpointing"), record_backends() as seen:
        model(**inputs).loss.backward()
    assert not seen
    assert "gradient checkpointing" in fastbert.explain(model, **inputs)
    model.gradient_checkpointing_disable()
    with record_backends() as seen:
        model(**inputs).loss.backward()
    assert seen


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_autocast_training_step_is_as_accurate_as_transformers(family):
    """A bf16 autocast training step (the Trainer's --bf16) on fastbert's path: loss and gradients (fp32, on the
    fp32 master weights) within the 2x rule of plain PyTorch in bf16 (transformers' model converted to bf16), both
    against the fp32 step. (fastbert's encoder computes in bf16 throughout, LayerNorm statistics and softmax in
    fp32; transformers' autocast keeps its residual stream in fp32, so it is not the comparison for a bf16 path.)"""
    head = "ForSequenceClassification"
    reference = tiny_model(family, head, **no_dropout(family)).train()
    optimized = fastbert.optimize(copy.deepcopy(reference)).train()
    inputs = optimize_inputs(family, head, reference)
    exact_loss, exact = _step(reference, inputs)
    plain_loss, plain = _step(copy.deepcopy(reference).to(torch.bfloat16), inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16), record_backends() as seen:
        fast_loss, fast = _step(optimized, inputs)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run (a fallback)"
    assert fast_loss.dtype == torch.float32 and all(g.dtype == torch.float32 for g in fast.values())
    half = torch.bfloat16  # judged by the bf16 rule (the gradients are fp32 tensors of a bf16 computation)
    assert_accurate(fast_loss.to(half), plain_loss.to(half), exact_loss.double(), "loss")
    assert fast.keys() == exact.keys()
    # All gradients as one vector: some are zero up to rounding (the key bias's), with no error scale of their own.
    names = sorted(exact)
    flat = {key: torch.cat([grads[n].double().flatten() for n in names]) for key, grads in
            (("fast", fast), ("plain", plain), ("exact", exact))}
    assert_accurate(flat["fast"].to(half), flat["plain"].to(half), flat["exact"], "gradients")


@pytest.mark.parametrize("backend", ["auto", "cpp"])
def test_a_second_derivative_is_refused_and_create_graph_keeps_the_first(backend):
    """The backends' backward kernels have no derivative of their own: a gradient penalty through an optimized
    model must raise, not come out without their part; a backward with create_graph=True that is not
    differentiated again gives the usual gradients."""
    reference = tiny_model("bert", "ForSequenceClassification", **no_dropout("bert")).train()
    model = fastbert.optimize(copy.deepcopy(reference), backend=backend)
    inputs = optimize_inputs("bert", "ForSequenceClassification", reference)
    _, expected = _step(reference, inputs)
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward(create_graph=True)
    assert_same_gradients({n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}, expected)

    model.zero_grad(set_to_none=True)
    embeds = model.bert.embeddings.word_embeddings(inputs["input_ids"]).detach().requires_grad_(True)
    arguments = {k: v for k, v in inputs.items() if k != "input_ids"}
    grad, = torch.autograd.grad(model(inputs_embeds=embeds, **arguments).logits.sum(), embeds, create_graph=True)
    with pytest.raises(RuntimeError, match="has no second derivative"):
        grad.square().sum().backward()
