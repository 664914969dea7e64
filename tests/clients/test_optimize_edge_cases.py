"""Harder things users do to a live model after `fastbert.optimize` (found in review): functional_call and
torch.func, autocast, module attributes and config edits, a pooler added later, left padding, gradient checkpointing,
accelerate hooks. Each case gives the optimized model the same numbers as an untouched one treated the same way,
or fastbert's path where nothing should stop it.

Every test builds two identical seeded tiny models (`tests.helpers.tiny_model`), optimizes one, applies the same
operation to both and compares the results of the same call under inference mode (or asserts that fastbert's ops
ran where nothing should stop them). "fastbert ran" = `record_backends()` saw every fused op.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fastbert
from fastbert.bench.recording import record_backends
from fastbert.numerics import assert_accurate
from tests.helpers import ARCHITECTURE_OPS, fused_ops, padded_batch, rel_err, tiny_config, tiny_model

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
    assert actual.pooler_output.dtype == expected.pooler_output.dtype == dtype  # (transformers' Linear and tanh)
    assert_accurate(actual.last_hidden_state[keep].to(dtype), expected.last_hidden_state[keep].to(dtype),
                    exact.last_hidden_state[keep], "autocast last_hidden_state")
    # The pooler amplifies the dtype's rounding of the residual stream, which transformers under autocast keeps in
    # float32 and fastbert in the autocast dtype: its reference is plain PyTorch in that dtype, the model cast to it.
    plain, _ = run(copy.deepcopy(reference).to(dtype), **inputs)
    assert_accurate(actual.pooler_output, plain.pooler_output, exact.pooler_output, "autocast pooler_output")


# ------------------------------------------------------------------------- code other than transformers' own
def _halved_forward(original):
    def forward(self, hidden_states, input_tensor):
        return original(self, hidden_states * 0.5, input_tensor)
    return forward


def _subclass_instance(model, monkeypatch):
    from transformers.models.bert.modeling_bert import BertOutput

    class HalvedOutput(BertOutput):
        forward = _halved_forward(BertOutput.forward)

    old = model.encoder.layer[1].output
    model.encoder.layer[1].output = HalvedOutput(model.config).eval()
    model.encoder.layer[1].output.load_state_dict(old.state_dict())


def _class_swapped(model, monkeypatch):
    from transformers.models.bert.modeling_bert import BertOutput

    class HalvedOutput(BertOutput):
        forward = _halved_forward(BertOutput.forward)

    model.encoder.layer[1].output.__class__ = HalvedOutput


def _class_forward_patched(model, monkeypatch):
    from transformers.models.bert.modeling_bert import BertOutput

    if not getattr(BertOutput.forward, "halved", False):
        patched = _halved_forward(BertOutput.forward)
        patched.halved = True
        monkeypatch.setattr(BertOutput, "forward", patched)


def _class_forward_wrapped(model, monkeypatch):
    """A patch through functools.wraps: it carries transformers' __module__ and name, not its code."""
    import functools

    from transformers.models.bert.modeling_bert import BertOutput

    if not getattr(BertOutput.forward, "halved", False):
        patched = functools.wraps(BertOutput.forward)(_halved_forward(BertOutput.forward))
        patched.halved = True
        monkeypatch.setattr(BertOutput, "forward", patched)


def _eager_attention_replaced(model, monkeypatch):
    """attn_implementation "eager" runs the modeling file's eager_attention_forward: a replaced one."""
    from transformers.models.bert import modeling_bert

    model.set_attn_implementation("eager")
    original = modeling_bert.eager_attention_forward
    if not getattr(original, "halved", False):
        def tempered(module, query, key, value, attention_mask, scaling=None, **kwargs):
            return original(module, query, key, value, attention_mask, scaling=scaling * 0.5, **kwargs)
        tempered.halved = True
        monkeypatch.setattr(modeling_bert, "eager_attention_forward", tempered)


@pytest.mark.parametrize("change", [_subclass_instance, _class_swapped, _class_forward_patched,
                                    _class_forward_wrapped, _eager_attention_replaced],
                         ids=["subclass-instance", "class-swapped", "class-forward-patched", "class-forward-wrapped",
                              "eager-attention-replaced"])
def test_code_other_than_transformers_runs_transformers_code(change, monkeypatch):
    """A submodule whose class is not transformers' (a user's subclass put in, or swapped into an instance after a
    first call), or a transformers class whose forward was patched: fastbert would compute transformers' layer, so
    the call runs transformers' code with a warning, and equals the changed model's."""
    reference, model = pair()
    inputs = batch_for(reference)
    run(model, **inputs)  # built before the change
    change(reference, monkeypatch)
    change(model, monkeypatch)
    expected, _ = run(reference, **inputs)
    with pytest.warns(UserWarning, match="fastbert would not run"), torch.inference_mode():
        actual = model(**inputs)
    assert rel_err(actual.last_hidden_state, expected.last_hidden_state) <= 1e-6


def test_backward_hooks_on_a_submodule_run_transformers_code():
    """A full backward hook (Captum, gradient capture) on an encoder layer would never fire on fastbert's path."""
    reference, model = pair()
    inputs = batch_for(reference)
    fired = []
    model.encoder.layer[0].register_full_backward_hook(lambda module, grad_in, grad_out: fired.append(1))
    with pytest.warns(UserWarning, match="backward hooks"):
        model(**inputs).last_hidden_state.sum().backward()
    assert fired


def test_a_subclass_that_overrides_the_models_forward_keeps_it():
    """class MyBert(BertModel) with its own forward: fastbert runs transformers' BertModel.forward only, so such a
    model runs its own forward (and transformers' code) with a warning."""
    from transformers import BertModel

    class DoubledBert(BertModel):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.last_hidden_state = out.last_hidden_state * 2
            return out

    torch.manual_seed(0)
    reference = DoubledBert(tiny_config("bert")).eval()
    inputs = batch_for(reference)
    expected, _ = run(reference, **inputs)
    with pytest.warns(UserWarning, match="DoubledBert.forward"), torch.inference_mode():
        model = fastbert.optimize(copy.deepcopy(reference))
        actual = model(**inputs)
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_attention_function_registered_with_transformers_runs_transformers_code(compiled):
    """attn_implementation naming a function registered with transformers' AttentionInterface (here: attention at
    half the temperature): fastbert computes standard attention, so the call runs transformers' code; switching back
    to sdpa takes fastbert's path again. Compiled, the check runs outside the graph (dynamo warned that it traced
    through the check's cache)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def tempered(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * 0.5
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("fastbert-test-tempered", tempered)
    reference, model = pair()
    inputs = batch_for(reference)
    keep = inputs["attention_mask"]
    for each in (reference, model):
        each.set_attn_implementation("fastbert-test-tempered")
    expected, _ = run(reference, **inputs)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        actual = model(**inputs)
        (model._orig_mod if compiled else model).set_attn_implementation("sdpa")
        with record_backends() as seen:
            model(**inputs)
    assert real_tokens_err(actual, expected, keep) <= 1e-5
    assert set(seen) == FAST
    messages = [str(w.message) for w in caught]
    assert any("fastbert-test-tempered" in m for m in messages)
    assert not [m for m in messages if "lru_cache" in m]


@pytest.mark.parametrize("values", [(2, 0), (0.5, 0.0), (-3.0, 0.0)], ids=["long-2", "float-half", "float-neg"])
def test_any_nonzero_mask_value_is_a_token_as_in_transformers(values):
    """transformers reads any nonzero value of a [B, S] attention_mask as a token: so does the drop-in."""
    reference, model = pair()
    inputs = batch_for(reference)
    keep = inputs["attention_mask"]
    inputs["attention_mask"] = torch.where(keep.bool(), torch.tensor(values[0]), torch.tensor(values[1]))
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert set(seen) == FAST
    assert real_tokens_err(actual, expected, keep) <= 1e-5


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
padded position that transformers computes: such a batch runs fastbert's padded form, which computes it too, and the
logits equal the untouched model's."""
    reference, model = pair(family, "ForSequenceClassification")
    inputs = batch_for(reference)
    inputs = {k: v.flip(1) for k, v in inputs.items()}  # the same sequences, padded on the left
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert set(seen) == set(fused_ops(reference))
    assert rel_err(actual.logits, expected.logits) <= 1e-5


def test_a_row_without_tokens_runs_transformers_code():
    """A row whose mask is all 0: transformers averages the padding there, fastbert's attention gives zeros, so
    the call runs transformers' code (and says so) and the outputs equal the untouched model's."""
    reference, model = pair("bert", "ForSequenceClassification")
    inputs = batch_for(reference)
    inputs["attention_mask"][1] = 0
    expected, _ = run(reference, **inputs)
    with pytest.warns(UserWarning, match="a row without tokens"), torch.inference_mode():
        actual = model(**inputs)
    assert rel_err(actual.logits, expected.logits) <= 1e-5


# ---------------------------------------------------------------------------------- holes in the mask
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_a_hole_inside_a_row_of_the_mask_keeps_the_positions(family):
    """A 0 between two tokens of a row: ModernBERT's sliding windows count positions, which packing the row would
    move closer (global layers and BERT do not care); the real tokens equal the untouched model's either way."""
    overrides = {"num_hidden_layers": 3, "local_attention": 4, "global_attn_every_n_layers": 3} \
        if family == "modernbert" else {}
    reference, model = pair(family, **overrides)
    inputs = batch_for(reference)
    mask = inputs["attention_mask"].clone()
    mask[0, 2] = mask[2, 1] = 0  # rows 0 and 2 get a hole; row 2 keeps its right padding too
    inputs["attention_mask"] = mask
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert set(seen) == set(fused_ops(reference))
    assert real_tokens_err(actual, expected, mask) <= 1e-5


@pytest.mark.parametrize("family", ["bert", "distilbert", "roberta"])
def test_one_dimensional_ids_are_broadcast_over_the_batch(family):
    """position_ids (and token_type_ids) of shape [S]: transformers broadcasts them over the batch."""
    reference, model = pair(family)
    inputs = batch_for(reference)
    seqlen = inputs["input_ids"].shape[1]
    offset = reference.config.pad_token_id + 1 if family == "roberta" else 0
    inputs["position_ids"] = torch.arange(offset, offset + seqlen)
    if family == "bert":
        inputs["token_type_ids"] = (torch.arange(seqlen) >= 3).long()
    elif family == "roberta":  # (transformers' RoBERTa reads 1-D positions only beside given token types)
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert set(seen) == set(fused_ops(reference))
    assert real_tokens_err(actual, expected, inputs["attention_mask"]) <= 1e-5


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


def _bf16_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # (a process holds one accelerate state: each test asks for its own)
    return Accelerator(mixed_precision="bf16", cpu=True)


def test_optimized_then_prepared_with_mixed_precision_runs_fastbert_under_autocast():
    """accelerate's prepare with mixed precision wraps the model's forward (autocast, outputs to float32) over
fastbert's: fastbert runs in bf16 and is reported as optimized; unwrap_model(keep_fp32_wrapper=False) hands back
fastbert's forward."""
    reference, model = pair()
    inputs = batch_for(reference)
    keep = inputs["attention_mask"].bool()
    exact, _ = run(reference, **inputs)
    accelerator = _bf16_accelerator()
    expected, _ = run(accelerator.prepare(reference), **inputs)
    prepared = accelerator.prepare(model)
    actual, seen = run(prepared, **inputs)
    assert set(seen) == FAST, "fastbert did not run under accelerate's mixed precision"
    assert fastbert.is_optimized(prepared)
    assert "fastbert's path" in fastbert.explain(prepared, **inputs)
    plain, _ = run(tiny_model("bert", "Model").to(torch.bfloat16), **inputs)
    assert_accurate(actual.last_hidden_state[keep].bfloat16(), plain.last_hidden_state[keep],
                    exact.last_hidden_state[keep], "prepared last_hidden_state")
    for result in (expected, actual):  # both ran in bf16
        assert real_tokens_err(result, exact, inputs["attention_mask"]) > 1e-4
    unwrapped = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    actual, seen = run(unwrapped, **inputs)
    assert set(seen) == FAST and real_tokens_err(actual, exact, inputs["attention_mask"]) <= 1e-5


def test_a_copy_of_an_optimized_then_prepared_model_runs_its_own_weights():
    """accelerate bound its mixed-precision wrapper as a closure over the original's forward (fastbert's forward had
no ``__func__``): a deepcopy, changed, kept running the original's weights."""
    reference, model = pair()
    inputs = batch_for(reference)
    accelerator = _bf16_accelerator()
    copies = [copy.deepcopy(accelerator.prepare(module)) for module in (reference, model)]
    for module in copies:
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(-1.5)
    (expected, _), (actual, seen) = (run(module, **inputs) for module in copies)
    assert set(seen) == FAST and fastbert.is_optimized(copies[1])
    assert real_tokens_err(actual, expected, inputs["attention_mask"]) <= 0.05  # (both bf16 under autocast)
    assert real_tokens_err(run(model, **inputs)[0], expected, inputs["attention_mask"]) > 0.5


def test_prepared_then_optimized_keeps_accelerates_forward_and_says_so():
    """optimize after accelerate's prepare with mixed precision replaced its forward: the call ran in float32
without autocast, and unwrap_model(keep_fp32_wrapper=False) then bound fastbert's forward a second time (TypeError
at the next call). The wrapper is kept, with a warning that says to optimize first."""
    reference, model = tiny_model("bert", "Model"), tiny_model("bert", "Model")
    inputs = batch_for(reference)
    accelerator = _bf16_accelerator()
    reference, model = accelerator.prepare(reference), accelerator.prepare(model)
    with pytest.warns(UserWarning, match="before accelerator.prepare"):
        fastbert.optimize(model)
    assert not fastbert.is_optimized(model)
    assert "before accelerator.prepare" in fastbert.explain(model, **inputs)
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert not seen
    assert torch.equal(actual.last_hidden_state, expected.last_hidden_state)
    for module in (reference, model):
        accelerator.unwrap_model(module, keep_fp32_wrapper=False)
    assert torch.equal(run(model, **inputs)[0].last_hidden_state, run(reference, **inputs)[0].last_hidden_state)
    fastbert.optimize(model)  # (what unwrap_model leaves is the model's own forward, under transformers' decorators)
    actual, seen = run(model, **inputs)
    assert set(seen) == FAST and real_tokens_err(actual, run(reference, **inputs)[0], inputs["attention_mask"]) <= 1e-5


def test_hooks_added_before_optimize_are_kept():
    """accelerate's cpu_offload before optimize: the base model's own hook (it moves inputs and weights) stays;
optimizing once the hooks are removed takes fastbert's path."""
    from accelerate import cpu_offload
    from accelerate.hooks import remove_hook_from_module

    reference, model = tiny_model("bert", "Model"), tiny_model("bert", "Model")
    inputs = batch_for(reference)
    cpu_offload(model, execution_device="cpu")
    with pytest.warns(UserWarning, match="forward was replaced"):
        fastbert.optimize(model)
    assert hasattr(model, "_hf_hook") and not fastbert.is_optimized(model)
    expected, _ = run(reference, **inputs)
    assert real_tokens_err(run(model, **inputs)[0], expected, inputs["attention_mask"]) <= 1e-5
    remove_hook_from_module(model, recurse=True)
    fastbert.optimize(model)
    actual, seen = run(model, **inputs)
    assert set(seen) == FAST and real_tokens_err(actual, expected, inputs["attention_mask"]) <= 1e-5


# ------------------------------------------------------------------------------ dropout as the modules hold it
# Where each family's transformers modules apply dropout in the encoder: "path" names an nn.Dropout module (under
# the base model, "*" for every layer index); "path:attribute" a module attribute that holds p (attention
# probabilities: transformers passes it to the attention function, gated by the attention module's mode).
_BERT_SITES = ["embeddings.dropout", "encoder.layer.*.attention.self:dropout.p",
               "encoder.layer.*.attention.output.dropout", "encoder.layer.*.output.dropout"]
DROPOUT_SITES = {
    "bert": _BERT_SITES, "roberta": _BERT_SITES, "electra": _BERT_SITES,
    "distilbert": ["embeddings.dropout", "transformer.layer.*.attention:dropout.p", "transformer.layer.*.ffn.dropout"],
    "albert": ["embeddings.dropout", "encoder.albert_layer_groups.*.albert_layers.*.attention:attention_dropout.p",
               "encoder.albert_layer_groups.*.albert_layers.*.attention.output_dropout"],
    "modernbert": ["embeddings.drop", "layers.*.attn:attention_dropout", "layers.*.attn.out_drop", "layers.*.mlp.drop"],
}
# Config values that make every site an nn.Dropout (ModernBERT's out_drop is an nn.Identity at 0) at p = 0.1.
DROPOUT_ON = {"distilbert": dict(dropout=0.1, attention_dropout=0.1),
              "modernbert": dict(embedding_dropout=0.1, attention_dropout=0.1, mlp_dropout=0.1)}
DROPOUT_OFF = {family: {name: 0.0 for name in on} for family, on in DROPOUT_ON.items()}
SITE_CASES = [(family, site) for family, sites in DROPOUT_SITES.items() for site in sites]


def _set_site(model, site: str, p: float) -> None:
    """Set ``p`` at a `DROPOUT_SITES` site of every layer (as TRL's disable_dropout_in_model sets nn.Dropout.p)."""
    import re

    path, _, attribute = site.partition(":")
    pattern = re.compile(re.escape(path).replace(r"\*", r"\d+"))  # "*": one layer index, not any path
    matched = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    assert matched, site
    for module in matched:
        if attribute:
            owner, _, name = attribute.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, name, p)
        else:
            assert isinstance(module, nn.Dropout), (site, type(module))
            module.p = p


def _dropout_pair(family: str, sites: dict[str, float], config: dict):
    """(untouched, optimized) in train mode, built with every dropout at 0.1, then each site's module set to its
    ``sites`` value (0 where not given) and the config edited to ``config`` afterwards, on both."""
    on = DROPOUT_ON.get(family, dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    models = []
    for _ in range(2):
        model = tiny_model(family, **on)
        for site in DROPOUT_SITES[family]:
            _set_site(model, site, sites.get(site, 0.0))
        for name, value in config.items():
            setattr(model.config, name, value)
        models.append(model.train())
    return models[0], fastbert.optimize(models[1])


def _train_call(model, inputs):
    with torch.no_grad(), record_backends() as seen, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model(**inputs).last_hidden_state, dict(seen)


@pytest.mark.parametrize(("family", "site"), SITE_CASES, ids=[f"{f}-{s}" for f, s in SITE_CASES])
def test_dropout_p_is_read_from_the_modules(family, site):
    """Built with dropout 0.1 everywhere, then one site's module at p = 1 (everything it touches dropped:
deterministic on both sides), the others at 0 and the config edited to 0: the training-mode outputs agree only if
fastbert reads each site's p from transformers' module, not from the config."""
    off = DROPOUT_OFF.get(family, dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    reference, model = _dropout_pair(family, {site: 1.0}, off)
    inputs = batch_for(reference)
    expected, _ = _train_call(reference, inputs)
    actual, seen = _train_call(model, inputs)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run"
    keep = inputs["attention_mask"].bool()
    assert rel_err(actual[keep], expected[keep]) <= 1e-5
    plain, _ = _train_call(model.eval(), inputs)
    assert rel_err(plain[keep], expected[keep]) > 1e-3, "the site dropped nothing"


@pytest.mark.parametrize("family", list(DROPOUT_SITES))
def test_disabled_dropout_modules_give_deterministic_training_outputs(family):
    """TRL's disable_dropout_in_model: every nn.Dropout's p set to 0 on a model configured with dropout 0.1 (for
ModernBERT the attention probabilities' p is a float attribute, and its config 0 here): train-mode calls equal the
untouched model's, and each other."""
    on = {**DROPOUT_ON["modernbert"], "attention_dropout": 0.0} if family == "modernbert" else (
        DROPOUT_ON.get(family, dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)))
    reference, model = tiny_model(family, **on).train(), fastbert.optimize(tiny_model(family, **on)).train()
    for module in (*reference.modules(), *model.modules()):
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    inputs = batch_for(reference)
    expected, _ = _train_call(reference, inputs)
    first, seen = _train_call(model, inputs)
    second, _ = _train_call(model, inputs)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run"
    keep = inputs["attention_mask"].bool()
    assert torch.equal(first, second), "two calls differ: fastbert still drops"
    assert rel_err(first[keep], expected[keep]) <= 1e-5


def test_config_edited_to_no_dropout_still_drops_as_the_modules_do():
    """The config edited to dropout 0 after loading, then optimized: transformers' nn.Dropout modules still drop
at 0.1, and so does fastbert (two train-mode calls differ, and differ from the eval output)."""
    model = tiny_model("bert", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    fastbert.optimize(model).train()
    inputs = batch_for(model)
    keep = inputs["attention_mask"].bool()
    first, seen = _train_call(model, inputs)
    second, _ = _train_call(model, inputs)
    plain, _ = _train_call(model.eval(), inputs)
    assert set(seen) == FAST
    assert rel_err(first[keep], second[keep]) > 1e-3 and rel_err(first[keep], plain[keep]) > 1e-3


def test_dropout_module_in_train_mode_inside_an_eval_model():
    """Monte Carlo dropout: model.eval(), then the dropout modules switched back to train(): transformers drops
there, and so must fastbert (one site at p = 1: deterministic on both sides)."""
    reference, model = _dropout_pair("bert", {"embeddings.dropout": 1.0}, {})
    inputs = batch_for(reference)
    for module in (reference, model):
        module.eval()
        module.embeddings.dropout.train()
    expected, _ = _train_call(reference, inputs)
    actual, seen = _train_call(model, inputs)
    keep = inputs["attention_mask"].bool()
    assert set(seen) == FAST
    assert rel_err(actual[keep], expected[keep]) <= 1e-5


# ------------------------------------------------------------------------------- hidden states by layer index
SELECTIONS = [[0, 2, -1], [0, 1], [-1], 1, (0, 1, 1, 99, -99), []]


@pytest.mark.parametrize("family", ["bert", "albert", "modernbert"])
@pytest.mark.parametrize("selection", SELECTIONS, ids=str)
def test_output_hidden_states_by_index(family, selection):
    """transformers 5 takes ``output_hidden_states`` as layer indices (an int or a list, negative from the end): it
returns the full-length tuple with None where a state was not asked for (out-of-range indices select nothing; an
empty list, none at all). The optimized model returns the same."""
    reference, model = pair(family)
    inputs = batch_for(reference)
    expected, _ = run(reference, **inputs, output_hidden_states=selection)
    actual, seen = run(model, **inputs, output_hidden_states=selection)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run"
    if expected.hidden_states is None:
        assert actual.hidden_states is None
        return
    assert [h is None for h in actual.hidden_states] == [h is None for h in expected.hidden_states]
    keep = inputs["attention_mask"].bool()
    for got, want in zip(actual.hidden_states, expected.hidden_states, strict=True):
        if want is not None:
            assert rel_err(got[keep], want[keep]) <= 1e-5
    as_tuple, _ = run(model, **inputs, output_hidden_states=selection, return_dict=False)
    assert [h is None for h in as_tuple[-1]] == [h is None for h in expected.hidden_states]


# --------------------------------------------------------------------------- rotary positions: no length limit
@pytest.mark.parametrize("head", ["Model", "ForMaskedLM"])
def test_modernbert_runs_past_max_position_embeddings(head):
    """ModernBERT has no position table (rotary positions are computed from the position): transformers runs a
sequence longer than max_position_embeddings, and so does the optimized model, with the same numbers."""
    from tests.helpers import MAX_POSITIONS

    reference, model = pair("modernbert", head)
    ids, mask = padded_batch(batch=2, seqlen=MAX_POSITIONS + 24)
    inputs = {"input_ids": ids, "attention_mask": mask}
    expected, _ = run(reference, **inputs)
    actual, seen = run(model, **inputs)
    assert set(seen) == set(fused_ops(reference)), "fastbert's encoder did not run"
    name = "last_hidden_state" if head == "Model" else "logits"
    keep = mask.bool()
    assert rel_err(getattr(actual, name)[keep], getattr(expected, name)[keep]) <= 1e-5
