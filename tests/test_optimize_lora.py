"""fastbert.optimize on PEFT LoRA models: the adapters run inside fastbert's ops (training and inference) with PEFT's
results and gradients, PEFT's own behaviours keep working (save / load, merge, disable, switching adapters), and
what fastbert does not run falls back with its reason."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fastbert
from fastbert.bench.recording import record_backends
from tests.helpers import optimize_inputs, tiny_model

peft = pytest.importorskip("peft")

HEAD = "ForSequenceClassification"
# Every linear of each family's layers (and the pooler where the family has one), by PEFT's module names.
TARGETS = {
    "bert": ["query", "key", "value", "dense"],
    "roberta": ["query", "value"],
    "electra": ["query", "key", "value", "dense"],
    "albert": ["query", "key", "value", "dense", "ffn", "ffn_output", "embedding_hidden_mapping_in"],
    "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
    "modernbert": ["Wqkv", "Wo", "Wi"],
}
FALLBACK = "fastbert: this call runs transformers' code"


def lora_pair(family: str, dropout: float = 0.0, rank: int = 4, backend: str = "auto",
              **sizes) -> tuple[nn.Module, nn.Module]:
    """(PEFT model, its optimized deep copy) over a tiny ``family`` classifier (config fields ``sizes``), adapters
    initialised non-zero."""
    torch.manual_seed(0)
    lora = peft.LoraConfig(task_type="SEQ_CLS", r=rank, lora_alpha=2 * rank, lora_dropout=dropout,
                           target_modules=TARGETS[family], init_lora_weights=False)
    reference = peft.get_peft_model(tiny_model(family, HEAD, **sizes), lora)
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=FALLBACK)
        fastbert.optimize(model, backend=backend)
    return reference, model


def fast_call(model: nn.Module, **inputs):
    """model(**inputs), asserting that fastbert's fused ops ran (no fallback)."""
    with warnings.catch_warnings(), record_backends() as seen:
        warnings.filterwarnings("error", message=FALLBACK)
        out = model(**inputs)
    assert seen, "fastbert's ops did not run"
    return out


def grad_errors(reference: nn.Module, model: nn.Module) -> dict[str, float]:
    """max |diff| / max |reference| of each trainable parameter's gradient, by name."""
    errors = {}
    theirs = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        if param.requires_grad:
            got = theirs[name].grad
            assert got is not None, f"{name} got no gradient"
            errors[name] = float((got - param.grad).abs().max() / param.grad.abs().max().clamp_min(1e-12))
        else:
            assert theirs[name].grad is None, f"frozen {name} got a gradient"
    return errors


@pytest.mark.parametrize("family", sorted(TARGETS))
@pytest.mark.parametrize("backend", ["auto", "cpp"])
def test_lora_gradients_and_logits_match_peft(family, backend):
    """auto: the per-token bias form (eager ops under autograd on CPU); cpp: the fused kernels with the update
    around them (heads, rotary, residual, augmented GEMM)."""
    reference, model = lora_pair(family, backend=backend)
    inputs = optimize_inputs(family, HEAD, reference)
    expected = reference(**inputs)
    got = fast_call(model, **inputs)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    expected.loss.backward()
    got.loss.backward()
    errors = grad_errors(reference, model)
    assert sum("lora_" in name for name in errors) >= 4
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda item: -item[1])[:3]
    with torch.no_grad():  # inference: the merged copies
        torch.testing.assert_close(fast_call(model, **inputs).logits, reference(**inputs).logits, rtol=1e-5,
                                   atol=1e-6)


def test_frozen_weights_cost_no_weight_gradient():
    """The LoRA backward does two GEMMs per frozen linear where full fine-tuning does three (recompute, input
    gradient, weight gradient; the QKV projection one and two)."""
    from torch.utils.flop_counter import FlopCounterMode

    sizes = dict(hidden_size=128, intermediate_size=512)
    _, model = lora_pair("bert", rank=2, **sizes)
    full = fastbert.optimize(tiny_model("bert", HEAD, **sizes))
    inputs = optimize_inputs("bert", HEAD, full)
    flops = {}
    for name, target in (("lora", model), ("full", full)):
        loss = target(**inputs).loss
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        flops[name] = counter.get_total_flops()
    assert flops["lora"] < 0.72 * flops["full"], flops


def test_inference_follows_training_steps():
    """The merged copies inference reads are refreshed after an optimizer step changes the adapters."""
    reference, model = lora_pair("bert")
    inputs = optimize_inputs("bert", HEAD, reference)
    for target in (reference, model):
        optimizer = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad], lr=0.05)
        target(**inputs).loss.backward()
        optimizer.step()
    with torch.no_grad():
        torch.testing.assert_close(fast_call(model, **inputs).logits, reference(**inputs).logits, rtol=1e-5,
                                   atol=1e-5)


def test_lora_dropout_acts_in_training_and_follows_the_modules():
    reference, model = lora_pair("bert", dropout=0.5)
    inputs = optimize_inputs("bert", HEAD, reference)
    model.train()
    with torch.no_grad():  # dropout acts without autograd too
        first, second = fast_call(model, **inputs).logits, fast_call(model, **inputs).logits
    assert not torch.allclose(first, second)
    for module in model.modules():  # PEFT's dropout modules, edited at call time: no dropout left
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    reference.train()
    for module in reference.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    torch.testing.assert_close(fast_call(model, **inputs).logits, reference(**inputs).logits, rtol=1e-5, atol=1e-6)


def test_disable_merge_and_unload_keep_peft_results():
    reference, model = lora_pair("bert")
    inputs = optimize_inputs("bert", HEAD, reference)
    inputs.pop("labels")

    def same():
        with torch.no_grad():
            torch.testing.assert_close(fast_call(model, **inputs).logits, reference(**inputs).logits, rtol=1e-5,
                                       atol=1e-6)

    with reference.disable_adapter(), model.disable_adapter():
        same()
    same()
    for target in (reference, model):
        target.base_model.merge_adapter()
    same()
    for target in (reference, model):
        target.base_model.unmerge_adapter()
    same()
    reference, model = reference.merge_and_unload(), model.merge_and_unload()
    same()


def test_switching_adapters_runs_the_active_one():
    reference, model = lora_pair("bert")
    inputs = optimize_inputs("bert", HEAD, reference)
    inputs.pop("labels")
    other = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=3, target_modules=["query", "value"],
                            init_lora_weights=False)
    for target in (reference, model):
        torch.manual_seed(5)
        target.add_adapter("other", other)
    for name in ("other", "default", "other"):
        for target in (reference, model):
            target.set_adapter(name)
        with torch.no_grad():
            torch.testing.assert_close(fast_call(model, **inputs).logits, reference(**inputs).logits, rtol=1e-5,
                                       atol=1e-6)


@pytest.mark.parametrize(("case", "reason"), [("two active", "active LoRA adapters"), ("dora", "LoRA variant"),
                                            ("lora_bias", "has a bias")])
def test_what_fastbert_does_not_run_falls_back_with_its_reason(case, reason):
    config = {"dora": {"use_dora": True}, "lora_bias": {"lora_bias": True}}.get(case, {})
    torch.manual_seed(0)
    reference = peft.get_peft_model(tiny_model("bert", HEAD), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False, **config))
    if case == "two active":
        reference.add_adapter("other", peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query"],
                                                       init_lora_weights=False))
        for module in reference.modules():  # (PEFT's model-level set_adapter refuses two for the classifier)
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.set_adapter(["default", "other"])
    model = copy.deepcopy(reference)
    with pytest.warns(UserWarning, match=reason):
        fastbert.optimize(model)
    inputs = optimize_inputs("bert", HEAD, reference)
    assert reason in fastbert.explain(model, input_ids=inputs["input_ids"])
    with record_backends() as seen:
        got = model(**inputs).logits
    assert not seen
    torch.testing.assert_close(got, reference(**inputs).logits, rtol=1e-6, atol=1e-7)


def test_save_pretrained_round_trip_after_training(tmp_path):
    reference, model = lora_pair("bert")
    inputs = optimize_inputs("bert", HEAD, reference)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    fast_call(model.train(), **inputs).loss.backward()
    optimizer.step()
    model.eval().save_pretrained(tmp_path)
    reloaded = fastbert.optimize(peft.PeftModel.from_pretrained(tiny_model("bert", HEAD), tmp_path).eval())
    assert {k: v for k, v in reloaded.state_dict().items()}.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    inputs.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(fast_call(reloaded, **inputs).logits, fast_call(model, **inputs).logits)


def test_optimize_before_get_peft_model():
    torch.manual_seed(0)
    base = tiny_model("bert", HEAD)
    reference = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False))
    torch.manual_seed(0)
    model = peft.get_peft_model(fastbert.optimize(copy.deepcopy(base)), peft.LoraConfig(
        task_type="SEQ_CLS", r=4, target_modules=["query", "value"], init_lora_weights=False))
    model.load_state_dict(reference.state_dict())
    inputs = optimize_inputs("bert", HEAD, base)
    expected, got = reference(**inputs), fast_call(model, **inputs)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-6)
    expected.loss.backward()
    got.loss.backward()
    assert max(grad_errors(reference, model).values()) <= 1e-5


def test_explain_a_peft_model_without_task_type_leaves_the_heads_arguments_out():
    """A PeftModel without task_type forwards ``**kwargs``: explain read its signature for the head's keywords, gave
`labels` to the encoder and said transformers' code runs, while the call took fastbert's path."""
    model = peft.get_peft_model(tiny_model("bert", HEAD), peft.LoraConfig(
        r=4, target_modules=["query", "value"], modules_to_save=["classifier"], init_lora_weights=False))
    fastbert.optimize(model)
    inputs = optimize_inputs("bert", HEAD, model.base_model.model)
    assert "labels" in inputs and "fastbert's path" in fastbert.explain(model, **inputs)
    fast_call(model, **inputs).loss.backward()


def test_trainer_fine_tunes_like_peft(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference, model = lora_pair("bert", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs = optimize_inputs("bert", HEAD, reference)
    rows = [{key: value[i] for key, value in inputs.items()} for i in range(len(inputs["input_ids"]))]
    losses = {}
    for name, target in (("peft", reference), ("fastbert", model)):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=4, report_to=[],
                                              use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=0.02,
                                              per_device_train_batch_size=4, logging_steps=1, seed=0)
        trainer = transformers.Trainer(model=target, args=args, train_dataset=rows)
        if name == "fastbert":
            with warnings.catch_warnings(), record_backends() as seen:
                warnings.filterwarnings("error", message=FALLBACK)
                trainer.train()
            assert seen
        else:
            trainer.train()
        losses[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses["peft"]) == 4
    torch.testing.assert_close(torch.tensor(losses["fastbert"]), torch.tensor(losses["peft"]), rtol=1e-4,
                               atol=1e-5)


def test_lora_dropout_has_peft_s_law():
    """The update's mean and variance over many draws equal PEFT's (masks differ, not their law)."""
    from fastbert.ops.low_rank import AdapterGroup, LowRankAdapter

    torch.manual_seed(0)
    model = peft.get_peft_model(nn.Sequential(nn.Linear(16, 12)), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["0"], init_lora_weights=False))
    layer = model.base_model.model[0].train()
    group = AdapterGroup([LowRankAdapter(layer.lora_A["default"].weight, layer.lora_B["default"].weight,
                                         layer.scaling["default"], layer.lora_dropout["default"])], (12,))
    x = torch.randn(3, 16)
    draws = 6000
    with torch.no_grad():
        theirs = torch.stack([layer(x) - layer.base_layer(x) for _ in range(draws)])
        ours = torch.stack([group.update(x) for _ in range(draws)])
    standard_error = theirs.std(0) / draws ** 0.5
    assert ((ours.mean(0) - theirs.mean(0)).abs() < 5 * standard_error).all()
    ratio = ours.var(0) / theirs.var(0)
    assert ((ratio > 0.9) & (ratio < 1.1)).all(), ratio
