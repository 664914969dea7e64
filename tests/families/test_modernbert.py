"""ModernBERT against transformers: fastbert's own model (from_pretrained) and optimize, over what is particular
to it (sliding-window layers on sequences longer than the window, layer type schedules, RoPE thetas, biases on and
off, classifier pooling), transformers' eager and sdpa attention, and bad input.

The generic checks (every head class by from_pretrained and by optimize, the clients) cover ModernBERT through
`tests.helpers` (FAMILIES, HEADS) and tests/test_heads.py (FAMILY_TASKS)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastbert
from fastbert.config import FastBertConfig
from fastbert.loading import CheckpointError
from tests.helpers import VOCAB, rel_err, tiny_model

LONG = 48  # longer than every window below, within max_position_embeddings
MAX_POSITIONS = 64
# ModernBERT-base's layout at a tiny width: no biases, every third layer global
BASE_LIKE = dict(norm_bias=False, attention_bias=False, mlp_bias=False, classifier_bias=False)
LAYOUTS = {
    "every-3rd-global-window-8": dict(num_hidden_layers=4, local_attention=8),
    "every-2nd-global-window-5": dict(num_hidden_layers=4, local_attention=5, global_attn_every_n_layers=2),
    "all-sliding-window-2": dict(num_hidden_layers=3, local_attention=2,
                                 layer_types=["sliding_attention"] * 3),
    "all-global": dict(num_hidden_layers=2, layer_types=["full_attention"] * 2),
    "no-biases": dict(num_hidden_layers=3, local_attention=6, **BASE_LIKE),
    "own-thetas": dict(num_hidden_layers=3, local_attention=6, global_rope_theta=5000.0, local_rope_theta=77.0),
}


def hf_model(head: str = "Model", attn: str = "eager", **overrides):
    model = tiny_model("modernbert", head, max_position_embeddings=MAX_POSITIONS, **overrides)
    model.config._attn_implementation = attn
    return model


def mixed_batch(lengths=(LONG, 1, 17, 33), seqlen: int = LONG, left: bool = False, seed: int = 3):
    """ids and mask [len(lengths), seqlen], padded on the right (or the left)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    positions = torch.arange(seqlen)
    mask = (positions >= seqlen - lengths[:, None]) if left else (positions < lengths[:, None])
    ids = torch.randint(3, VOCAB, mask.shape, generator=gen).masked_fill(~mask, 0)
    return ids, mask.long()


def load(model, directory, **kwargs):
    model.save_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete checkpoint loads without a warning
        return fastbert.from_pretrained(directory, **kwargs)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_encoder_matches_transformers(layout, attn, tmp_path):
    reference = hf_model(attn=attn, **LAYOUTS[layout])
    model = load(reference, tmp_path)
    ids, mask = mixed_batch()
    keep = mask.bool()
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        packed = model(ids, mask, output_hidden_states=True)
        model.padding_free = False
        padded = model(ids, mask, output_hidden_states=True)
    for name, ours in (("packed", packed), ("padded", padded)):
        assert rel_err(ours.last_hidden_state[keep], expected.last_hidden_state[keep]) <= 1e-5, name
        assert torch.all(ours.last_hidden_state[~keep] == 0)
        assert len(ours.hidden_states) == len(expected.hidden_states)
        for depth, (got, want) in enumerate(zip(ours.hidden_states, expected.hidden_states, strict=True)):
            assert rel_err(got[keep], want[keep]) <= 1e-5, f"{name} hidden_states[{depth}]"
    assert packed.pooler_output is None


def test_window_changes_the_result(tmp_path):
    """The test batches are long enough for the window to matter: the same weights with global attention in
    every layer give other numbers."""
    same_theta = dict(num_hidden_layers=2, local_attention=4, global_rope_theta=100.0, local_rope_theta=100.0)
    windowed = hf_model(layer_types=["sliding_attention"] * 2, **same_theta)
    model = load(windowed, tmp_path / "windowed")
    everywhere = hf_model(layer_types=["full_attention"] * 2, **same_theta)
    everywhere.load_state_dict(windowed.state_dict())
    ids, mask = mixed_batch()
    keep = mask.bool()
    with torch.inference_mode():
        ours = model(ids, mask).last_hidden_state[keep]
        local = windowed(input_ids=ids, attention_mask=mask).last_hidden_state[keep]
        full = everywhere(input_ids=ids, attention_mask=mask).last_hidden_state[keep]
    assert rel_err(ours, local) <= 1e-5
    assert rel_err(full, local) > 1e-3


def test_left_padding_and_given_position_ids(tmp_path):
    """Positions are the batch's (arange along S, or the caller's position_ids), as transformers reads them."""
    reference = hf_model(num_hidden_layers=3, local_attention=6)
    model = load(reference, tmp_path)
    ids, mask = mixed_batch(left=True)
    keep = mask.bool()
    shifted = (torch.arange(LONG) + 5).expand(len(ids), LONG)
    with torch.inference_mode():
        for position_ids in (None, shifted):
            expected = reference(input_ids=ids, attention_mask=mask, position_ids=position_ids).last_hidden_state
            actual = model(ids, mask, position_ids=position_ids).last_hidden_state
            assert rel_err(actual[keep], expected[keep]) <= 1e-5


def test_inputs_embeds(tmp_path):
    reference = hf_model(num_hidden_layers=3, local_attention=6)
    model = load(reference, tmp_path)
    ids, mask = mixed_batch()
    embeds = torch.randn(*ids.shape, 32)
    keep = mask.bool()
    with torch.inference_mode():
        expected = reference(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        actual = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    assert rel_err(actual[keep], expected[keep]) <= 1e-5


HEADS = ["ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
         "ForMultipleChoice"]
TASKS = dict(zip(HEADS, ["masked-lm", "sequence-classification", "token-classification", "question-answering",
                         "multiple-choice"], strict=True))


def head_inputs(head: str, full: bool = False) -> dict:
    """A padded batch (or, for the QA loss, unpadded: transformers' span softmax covers padding) and labels."""
    ids, mask = mixed_batch(lengths=(LONG,) * 4 if full else (LONG, 1, 17, 33))
    gen = torch.Generator().manual_seed(4)
    inputs = {"input_ids": ids, "attention_mask": mask}
    tokens = torch.randint(0, 2, ids.shape, generator=gen).masked_fill(mask == 0, -100)
    if head == "ForMaskedLM":
        inputs["labels"] = torch.randint(0, VOCAB, ids.shape, generator=gen).masked_fill(mask == 0, -100)
    elif head == "ForSequenceClassification":
        inputs["labels"] = torch.tensor([0, 1, 1, 0])
    elif head == "ForTokenClassification":
        inputs["labels"] = tokens
    elif head == "ForQuestionAnswering":
        inputs["start_positions"], inputs["end_positions"] = torch.tensor([0, 5, 9, 40]), torch.tensor([3, 5, 30, 47])
    else:  # [B=2, C=2, S]
        inputs = {k: v.view(2, 2, LONG) for k, v in inputs.items()}
        inputs["labels"] = torch.tensor([1, 0])
    return inputs


def compare_outputs(expected, actual, mask: torch.Tensor, what: str) -> None:
    keep = mask.bool().reshape(-1, mask.shape[-1])
    compared = 0
    for name, want in expected.items():
        if not isinstance(want, torch.Tensor):
            continue
        got = actual[name]
        assert got.shape == want.shape, f"{what} {name}"
        if want.dim() >= 2 and want.shape[1] == mask.shape[-1] and mask.dim() == 2:  # per token: real positions
            got, want = got[keep], want[keep]
        assert rel_err(got, want) <= 1e-5, f"{what} {name}: {rel_err(got, want):.3g}"
        compared += 1
    assert compared >= 2, f"{what}: outputs and loss compared"


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("head", HEADS)
def test_heads_from_pretrained_and_optimize(head, pooling, tmp_path):
    """Both of fastbert's ways against the transformers class, outputs and loss, sdpa attention, no biases
    (ModernBERT-base) except where the pooling test needs none."""
    reference = hf_model(head, attn="sdpa", num_hidden_layers=4, local_attention=8, classifier_pooling=pooling,
                         num_labels=3 if head != "ForQuestionAnswering" else 2, **BASE_LIKE)
    loaded = load(reference, tmp_path, task=TASKS[head])
    optimized = fastbert.optimize(copy.deepcopy(reference))
    inputs = head_inputs(head, full=head == "ForQuestionAnswering")
    with torch.inference_mode():
        expected = reference(**inputs)
        by_optimize = optimized(**inputs)
        ours = loaded(**inputs)
    mask = inputs["attention_mask"]
    compare_outputs(expected, by_optimize, mask, f"optimize {head}")
    compare_outputs({k: v for k, v in expected.items()}, {k: getattr(ours, k) for k in expected.keys()}, mask,
                    f"from_pretrained {head}")


def test_multiple_choice_reads_the_first_real_token(tmp_path):
    """classifier_pooling "cls" in transformers' multiple-choice head reads each choice's first real token
    (argmax of the mask): with left padding that is not position 0."""
    reference = hf_model("ForMultipleChoice", num_hidden_layers=2, local_attention=8)
    model = load(reference, tmp_path, task="multiple-choice")
    ids, mask = mixed_batch(left=True)
    inputs = {"input_ids": ids.view(2, 2, LONG), "attention_mask": mask.view(2, 2, LONG)}
    with torch.inference_mode():
        expected = reference(**inputs).logits
        actual = model(**inputs).logits
    assert rel_err(actual, expected) <= 1e-5


def test_old_config_names(tmp_path):
    """Checkpoints saved before transformers 5 (ModernBERT-base's config.json) name the schedule and the thetas
    global_attn_every_n_layers / global_rope_theta / local_rope_theta, without layer_types or rope_parameters."""
    reference = hf_model(num_hidden_layers=4, local_attention=6, global_attn_every_n_layers=2,
                         global_rope_theta=1234.0, local_rope_theta=55.0)
    reference.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["layer_types"] == ["full_attention", "sliding_attention"] * 2
    for key in ("layer_types", "rope_parameters"):
        raw.pop(key)
    raw.update(global_attn_every_n_layers=2, global_rope_theta=1234.0, local_rope_theta=55.0)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = FastBertConfig.from_json_file(tmp_path / "config.json")
    assert config.layer_types == ("full_attention", "sliding_attention") * 2
    assert config.rope_theta == {"full_attention": 1234.0, "sliding_attention": 55.0}
    model = fastbert.from_pretrained(tmp_path)
    ids, mask = mixed_batch()
    keep = mask.bool()
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = model(ids, mask).last_hidden_state
    assert rel_err(actual[keep], expected[keep]) <= 1e-5


def test_config_refusals():
    raw = hf_model(num_hidden_layers=2).config.to_dict()
    scaled = dict(raw, rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 10.0, "factor": 2.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        FastBertConfig.from_hf_dict(scaled)
    with pytest.raises(ValueError, match="layer_types .*'chunked_attention'"):
        FastBertConfig.from_hf_dict(dict(raw, layer_types=["full_attention", "chunked_attention"]))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        FastBertConfig.from_hf_dict(dict(raw, hidden_activation="quick_gelu"))
    with pytest.raises(ValueError, match="classifier_pooling 'max'"):
        fastbert.heads.build_task_model(FastBertConfig.from_hf_dict(dict(raw, classifier_pooling="max")),
                                        "sequence-classification")


def test_longer_than_max_position_embeddings(tmp_path):
    """Rotary positions have no table: like transformers, fastbert runs past max_position_embeddings (the cos/sin
    tables grow), with transformers' numbers."""
    reference = hf_model(num_hidden_layers=2, local_attention=4)
    model = load(reference, tmp_path)
    ids = torch.randint(3, VOCAB, (2, 2 * MAX_POSITIONS + 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, MAX_POSITIONS:] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = model(ids, mask).last_hidden_state
    keep = mask.bool()
    assert rel_err(actual[keep], expected[keep]) <= 1e-5


def test_bad_inputs(tmp_path):
    reference = hf_model(num_hidden_layers=2, local_attention=4)
    model = load(reference, tmp_path)
    ids, mask = mixed_batch()
    with pytest.raises(IndexError, match=rf"token id {VOCAB}, outside the vocabulary \[0, {VOCAB}\)"):
        model(ids.masked_fill(ids == ids[0, 0], VOCAB), mask)
    with pytest.raises(ValueError, match="position ids must not be negative"):
        model(ids, mask, position_ids=torch.full_like(ids, -1))
    with pytest.raises(ValueError, match="modernbert takes no token_type_ids"):
        model(ids, mask, token_type_ids=torch.zeros_like(ids))


def test_checkpoint_missing_tensors_and_wrong_shapes(tmp_path):
    reference = hf_model(num_hidden_layers=2, local_attention=4, **BASE_LIKE)
    reference.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    missing = {k: v for k, v in state.items() if k not in ("layers.1.attn_norm.weight", "final_norm.weight")}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing keys: layers.1.attn_norm.weight, final_norm.weight"):
        fastbert.from_pretrained(tmp_path)
    wrong = dict(state, **{"layers.0.mlp.Wi.weight": state["layers.0.mlp.Wi.weight"][:37]})
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"wrong shapes: layers.0.mlp.Wi.weight: \(37, 32\), expected \(74, 32\)"):
        fastbert.from_pretrained(tmp_path)


def test_optimize_runs_left_padding_padded_unless_a_window_misses_position_0_and_watches_the_window():
    """Left padding: the heads read position 0, a padded position that transformers computes, and so does fastbert's
    padded form, unless position 0's sliding window holds no token (transformers averages the padding there): such
    a batch runs transformers' code. An edit of local_attention after optimize() rebuilds fastbert's encoder with
    the new window."""
    reference = hf_model(num_hidden_layers=2, local_attention=4)
    model = fastbert.optimize(copy.deepcopy(reference))
    ids, mask = mixed_batch()
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="more than 2 positions from position 0"):
            model(*mixed_batch(left=True))
        near_ids, near_mask = mixed_batch(lengths=(LONG, LONG - 1, LONG - 2), left=True)
        expected = reference(input_ids=near_ids, attention_mask=near_mask).last_hidden_state
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # fastbert's path: no fallback warning
            actual = model(input_ids=near_ids, attention_mask=near_mask).last_hidden_state
        assert rel_err(actual, expected) <= 1e-5  # padded positions too
        for window in (4, 12):
            reference.config.local_attention = model.config.local_attention = window
            expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
            actual = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert rel_err(actual[mask.bool()], expected[mask.bool()]) <= 1e-5, window


def test_benchmark_flops_count_the_glu_and_the_window():
    """fastbert.bench.costs: a GLU FFN is 6*H*I per token, a sliding layer attends only its band."""
    from fastbert.bench.costs import attention_pairs, batch_flops

    for seqlen, window in ((5, 2), (10, 4), (9, 3), (7, 100), (1, 0)):
        band = sum(abs(i - j) <= window // 2 for i in range(seqlen) for j in range(seqlen))
        assert attention_pairs(seqlen, window) == band
    assert attention_pairs(6, None) == 36
    config = FastBertConfig.from_hf_dict(hf_model(num_hidden_layers=3, local_attention=4).config.to_dict())
    hidden, inner = config.hidden_size, config.intermediate_size
    per_token = 8 * hidden * hidden + 6 * hidden * inner
    expected = sum(n * per_token * 3 + 4 * hidden * (n * n + 2 * attention_pairs(n, 4)) for n in (3, 9))
    assert batch_flops(config, [3, 9]) == expected


def test_masked_lm_loss_trains_every_weight(tmp_path):
    """With autograd, fastbert's ModernBERT gives transformers' loss and gradients reach the weights of every op
    (the tied decoder trains the token embeddings)."""
    reference = hf_model("ForMaskedLM", num_hidden_layers=3, local_attention=4)
    model = load(reference, tmp_path, task="masked-lm")
    inputs = head_inputs("ForMaskedLM")
    loss = model(**inputs).loss
    assert rel_err(loss.detach(), reference(**inputs).loss.detach()) <= 1e-5
    loss.backward()
    encoder = model.encoder
    for name in ("embeddings.word_embeddings", "layers.1.qkv_weight", "layers.1.attn_norm_weight",
                 "layers.2.ffn_in_weight", "layers.2.ffn_out_weight", "final_norm_weight"):
        grad = encoder.get_parameter(name).grad
        assert grad is not None and float(grad.abs().sum()) > 0, name
