"""Harder things users do to a live model after `fastbert.optimize` (found in review): functional_call and
torch.func, autocast, module attributes and config edits, a pooler added later, left padding, gradient checkpointing,
accelerate hooks. Each case gives the optimized model the same numbers as an untouched one treated the same way,
or fastbert's path where nothing should stop it.

Every test builds two identical seeded tiny models (`tests.hf_tiny.tiny_model`), optimizes one, applies the same
operation to both and compares the results of the same call under inference mode (or asserts that fastbert's ops
ran where nothing should stop them). "fastbert ran" = `record_backends()` saw every fused op.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fastbert
from fastbert.bench.recording import record_backends
from fastbert.numerics import assert_accurate
from tests.helpers import ARCHITECTURE_OPS, padded_batch, rel_err, tiny_config, tiny_model

FAST = set(ARCHITECTURE_OPS["post"])  # the ops of BERT's layers: the tests below run BERT


def pair(family: str = "bert", head: str = "Model", **overrides):
    """(untouched model, optimized model): two identical seeded tiny models."""
    return tiny_model(family, head, **overrides), fastbert.optimize(tiny_model(family, head, **overrides))


def batch_for(model) -> dict:
    ids, mask = padded_batch(pad_id=model.config.pad_token_id or 0)
    return {"input_ids": ids, "attention_mask": mask}


def run(model, **inputs):
    """The output under inference mode and the fused ops that ran ({} = transformers' code ran)."""
    with torch.inference_mode(), record_backends() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(**inputs)
    return out, dict(seen)


def real_tokens_err(actual, expected, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return rel_err(actual.last_hidden_state[keep].float(), expected.last_hidden_state[keep].float())


# ------------------------------------------------------------------------------------- torch.func
def test_functional_call_with_plain_tensors_uses_them():
    """torch.func.functional_call swaps plain tensors into ``module._parameters`` for one call: the optimized model
runs transformers' code on them (fastbert takes parameters only) and gives the untouched model's result."""
    reference, model = pair()
    inputs = batch_for(reference)
    run(model, **inputs)  # built over the model's own parameters first
    gen = torch.Generator().manual_seed(3)
    params = {k: v.detach() + 0.3 * torch.randn(v.shape, generator=gen) for k, v in reference.named_parameters()}
    with torch.inference_mode():
        expected = torch.func.functional_call(reference, params, (), inputs)
        actual = torch.func.functional_call(model, params, (), inputs)
    assert real_tokens_err(actual, expected, inputs["attention_mask"]) <= 1e-5


def test_torch_func_grad_through_functional_call():
    """torch.func.grad over functional_call (per-sample gradients, meta-learning): grad is enabled, so the call is
transformers' code, decided before any build, and the gradients equal the untouched model's."""
    reference, model = pair()
    inputs = batch_for(reference)
    params = {k: v.detach() for k, v in reference.named_parameters()}

    def loss_of(module):
        return lambda p: torch.func.functional_call(module, p, (), inputs).last_hidden_state.sum()

    expected = torch.func.grad(loss_of(reference))(params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        actual = torch.func.grad(loss_of(model))(params)
    name = "encoder.layer.0.attention.self.query.weight"
    assert rel_err(actual[name], expected[name]) <= 1e-5


# ------------------------------------------------------------------------------------------ autocast
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cpu_autocast_around_a_call(dtype):
    """torch.autocast(cpu) around a call of a float32 model: fastbert's path in the autocast dtype, the output in
float32 as transformers' (its LayerNorm runs in fp32 under autocast), as accurate as transformers' own autocast
call by the 2x rule against the fp32 result."""
    reference, model = pair()
    inputs = batch_for(reference)
    keep = inputs["attention_mask"].bool()
    exact, _ = run(reference, **inputs)
    with torch.autocast("cpu", dtype=dtype):
        expected, _ = run(reference, **inputs)
        actual, seen = run(model, **inputs)
    assert seen, "fastbert's encoder did not run"
    assert actual.last_hidden_state.dtype == expected.last_hidden_state.dtype == torch.float32
    assert_accurate(actual.last_hidden_state[keep].to(dtype), expected.last_hidden_state[keep].to(dtype),
                    exact.last_hidden_state[keep], "autocast last_hidden_state")


# ---------------------------------------------------- state transformers captured at construction, or reads live
def _layer_norm_eps_attribute(model):
    model.encoder.layer[0].output.LayerNorm.eps = 0.1


def _activation_module_replaced(model):
    model.encoder.layer[0].intermediate.intermediate_act_fn = nn.ReLU()


def _embedding_max_norm(model):
    model.embeddings.word_embeddings.max_norm = 0.5


def _config_hidden_act_then_to(model):
    model.config.hidden_act = "relu"  # the modules keep the activation they were built with
    model.double().float()  # any rebuild (.to(), load_state_dict(assign=True), ...) reads the config again


def _config_layer_norm_eps_then_to(model):
    model.config.layer_norm_eps = 0.1
    model.double().float()


def _config_num_attention_heads_then_to(model):
    model.config.num_attention_heads = 2
    model.double().float()


def _roberta_config_pad_token_id_then_to(model):
    model.config.pad_token_id = 4  # RobertaEmbeddings keeps padding_idx from construction
    model.double().float()


def _albert_config_num_hidden_layers(model):
    model.config.num_hidden_layers = 2  # AlbertTransformer reads it on every forward: fewer repetitions


def _appended_encoder_layer(model):
    import copy

    model.encoder.layer.append(copy.deepcopy(model.encoder.layer[0]))  # BertEncoder runs every layer it holds


# (family, change, whether the untouched model's output changes: a config edit it captured at construction leaves
# it as it was, and fastbert must leave it too)
MODULE_STATE = [
    ("bert", _layer_norm_eps_attribute, True),
    ("bert", _activation_module_replaced, True),
    ("bert", _embedding_max_norm, True),
    ("bert", _config_hidden_act_then_to, False),
    ("bert", _config_layer_norm_eps_then_to, False),
    ("bert", _config_num_attention_heads_then_to, False),
    ("roberta", _roberta_config_pad_token_id_then_to, False),
    ("albert", _albert_config_num_hidden_layers, True),
    ("bert", _appended_encoder_layer, True),
]


@pytest.mark.parametrize(("family", "change", "changes_output"), MODULE_STATE,
                         ids=[f"{family}-{change.__name__.strip('_')}" for family, change, _ in MODULE_STATE])
def test_state_the_modules_hold_is_followed(family, change, changes_output):
    """What transformers' modules hold (LayerNorm eps, activation module, Embedding max_norm, heads, padding index,
layer count, ALBERT's live config) is what fastbert computes with, not a config edited later: after these changes
the optimized model still equals the untouched one."""
    reference, model = pair(family)
    inputs = batch_for(reference)
    run(model, **inputs)  # built before the change
    before, _ = run(reference, **inputs)
    change(reference)
    change(model)
    expected, _ = run(reference, **inputs)
    actual, _ = run(model, **inputs)
    assert real_tokens_err(actual, expected, inputs["attention_mask"]) <= 1e-5
    assert (real_tokens_err(before, expected, inputs["attention_mask"]) > 1e-3) == changes_output


def test_pooler_added_after_the_first_call():
    """A BertModel built without a pooler that is given one later: the empty ``pooler`` slot is watched, so the
optimized model rebuilds and returns the same pooler_output as the untouched one."""
    from transformers import BertModel
    from transformers.models.bert.modeling_bert import BertPooler

    def build():
        torch.manual_seed(0)
        config = tiny_config("bert")
        config._attn_implementation = "eager"
        return BertModel(config, add_pooling_layer=False).eval()

    reference, model = build(), fastbert.optimize(build())
    inputs = batch_for(reference)
    run(model, **inputs)
    for module in (reference, model):
        torch.manual_seed(4)
        module.pooler = BertPooler(module.config)
    expected, _ = run(reference, **inputs)
    actual, _ = run(model, **inputs)
    assert actual.pooler_output is not None
    assert rel_err(actual.pooler_output, expected.pooler_output) <= 1e-5


# ------------------------------------------------------------------------------------------- left padding
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "electra"])
def test_left_padded_batch_classification_logits(family):
    """padding_side="left": the heads read token 0 (BERT's pooler, RoBERTa/ELECTRA's first-token classifier), a
padded position the padding-free encoder does not compute, so such a batch runs transformers' code and the logits
equal the untouched model's."""
    reference, model = pair(family, "ForSequenceClassification")
    inputs = batch_for(reference)
    inputs = {k: v.flip(1) for k, v in inputs.items()}  # the same sequences, padded on the left
    expected, _ = run(reference, **inputs)
    actual, _ = run(model, **inputs)
    assert rel_err(actual.logits, expected.logits) <= 1e-5


# -------------------------------------------------------------------------------------- lost fast paths
def test_gradient_checkpointing_enabled_model_evaluates_on_the_fast_path():
    """gradient_checkpointing_enable() (Trainer(gradient_checkpointing=True) does it) installs transformers'
``make_inputs_require_grads`` forward hook on the word embeddings; it is inert without autograd, so later
eval/predict calls stay on fastbert's path."""
    reference, model = pair("bert", "ForSequenceClassification")
    for module in (reference, model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module.gradient_checkpointing_enable()
        module.eval()
    inputs = batch_for(reference)
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert rel_err(actual.logits, expected.logits) <= 1e-5
    assert set(seen) == FAST, "fastbert did not run"


def test_fast_path_returns_after_accelerate_hooks_are_removed():
    """accelerate's remove_hook_from_module leaves each submodule's own bound ``forward`` as an instance attribute:
that is not a replaced forward, so the model returns to fastbert's path."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    reference, model = pair()
    inputs = batch_for(reference)
    cpu_offload(model, execution_device="cpu")
    run(model, **inputs)  # transformers' code while offloaded (warned)
    remove_hook_from_module(model, recurse=True)
    assert fastbert.is_optimized(model)
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert real_tokens_err(actual, expected, inputs["attention_mask"]) <= 1e-5
    assert set(seen) == FAST, "fastbert did not run after the hooks were removed"
