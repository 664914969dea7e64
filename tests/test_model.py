"""fastbert's own encoder (from_pretrained) against transformers, padded vs packed execution, and bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import fastbert
from tests.helpers import FAMILIES, MAX_POSITIONS, VOCAB, OpsSeen, padded_batch, rel_err, save_sharded, tiny_model


def _save(model, directory, safe: bool = True):
    """The checkpoint as save_pretrained writes it, or with pytorch_model.bin (transformers 5 writes safetensors
    whatever it is asked)."""
    if safe:
        model.save_pretrained(directory, safe_serialization=True)
    else:
        model.config.save_pretrained(directory)
        torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize("family", list(FAMILIES))
def test_from_pretrained_matches_transformers(family, tmp_path):
    reference = tiny_model(family)
    model = fastbert.from_pretrained(_save(reference, tmp_path))
    ids, mask = padded_batch(5, 11, pad_id=reference.config.pad_token_id or 0)
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask)
        actual = model(ids, mask)
    keep = mask.bool()
    assert rel_err(actual.last_hidden_state[keep], expected.last_hidden_state[keep]) <= 1e-5
    assert torch.all(actual.last_hidden_state[~keep] == 0)
    if getattr(expected, "pooler_output", None) is not None:
        assert rel_err(actual.pooler_output, expected.pooler_output) <= 1e-5
    else:
        assert actual.pooler_output is None


def test_from_pretrained_reads_pytorch_bin_and_casts(tmp_path):
    reference = tiny_model("bert")
    model = fastbert.from_pretrained(_save(reference, tmp_path, safe=False), dtype="float64")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "pytorch_model.bin"]
    assert next(model.parameters()).dtype == torch.float64
    ids, mask = padded_batch()
    with torch.inference_mode():
        expected = reference.double()(input_ids=ids, attention_mask=mask).last_hidden_state
        actual = model(ids, mask).last_hidden_state
    assert rel_err(actual[mask.bool()], expected[mask.bool()]) <= 1e-12


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_from_pretrained_reads_a_sharded_checkpoint(safe, tmp_path):
    reference = tiny_model("bert")
    save_sharded(reference, tmp_path, safe)
    assert {p.suffix for p in tmp_path.glob("*-of-*")} == {".safetensors" if safe else ".bin"}
    model = fastbert.from_pretrained(tmp_path)
    assert model.loading_info["unexpected_keys"] == []
    ids, mask = padded_batch()
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask)
        actual = model(ids, mask)
    assert rel_err(actual.last_hidden_state[mask.bool()], expected.last_hidden_state[mask.bool()]) <= 1e-5
    assert rel_err(actual.pooler_output, expected.pooler_output) <= 1e-5


def test_a_broken_shard_index_is_a_checkpoint_error(bert_dir, tmp_path):
    shutil.copy(bert_dir / "config.json", tmp_path / "config.json")
    index = tmp_path / "model.safetensors.index.json"
    for text, match in [("{not json", "is not a readable shard index"),
                        ('{"metadata": {}}', "is not a readable shard index"),
                        ('{"weight_map": {"a.weight": "../model.safetensors"}}',
                         "must name .safetensors shard files in the same directory, not '../model.safetensors'"),
                        ('{"weight_map": {"a.weight": ""}}', "shard files in the same directory, not ''"),
                        ('{"weight_map": {"a.weight": "model.safetensors.index.json"}}',
                         "not 'model.safetensors.index.json'"),
                        ('{"weight_map": {}}', "its weight_map names no shard file"),
                        ('{"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}',
                         r"names 1 shard\(s\) that are not there: model-00001-of-00002.safetensors")]:
        index.write_text(text)
        with pytest.raises(fastbert.CheckpointError, match=match):
            fastbert.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_padded_and_packed_execution_agree(family, tmp_path):
    reference = tiny_model(family)
    model = fastbert.from_pretrained(_save(reference, tmp_path), dtype=torch.float64)
    ids, mask = padded_batch(6, 13, pad_id=reference.config.pad_token_id or 0)
    with torch.inference_mode():
        packed = model(ids, mask).last_hidden_state
        model.padding_free = False
        padded = model(ids, mask).last_hidden_state
    assert torch.allclose(packed, padded, rtol=0, atol=1e-12)


def test_each_sequence_alone_equals_the_batch(tmp_path):
    model = fastbert.from_pretrained(_save(tiny_model("bert"), tmp_path), dtype=torch.float64)
    ids, mask = padded_batch(4, 10)
    with torch.inference_mode():
        batched = model(ids, mask).last_hidden_state
        for row in range(4):
            length = int(mask[row].sum())
            alone = model(ids[row: row + 1, :length]).last_hidden_state[0]
            assert torch.allclose(alone, batched[row, :length], atol=1e-12)


def test_hidden_states_and_inputs_embeds(tmp_path):
    reference = tiny_model("electra")
    model = fastbert.from_pretrained(_save(reference, tmp_path))
    ids, mask = padded_batch()
    embeds = reference.embeddings.word_embeddings(ids).detach()
    with torch.inference_mode():
        expected = reference(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
        actual = model(inputs_embeds=embeds, attention_mask=mask, output_hidden_states=True)
    keep = mask.bool()
    assert rel_err(actual.last_hidden_state[keep], expected.last_hidden_state[keep]) <= 1e-5
    assert len(actual.hidden_states) == 3


def test_all_padded_row_gives_zeros_not_nan(tmp_path):
    model = fastbert.from_pretrained(_save(tiny_model("bert"), tmp_path))
    ids, mask = padded_batch(3, 6)
    mask[1] = 0
    with torch.inference_mode():
        out = model(ids, mask)
    assert torch.isfinite(out.last_hidden_state).all() and torch.all(out.last_hidden_state[1] == 0)


@pytest.mark.parametrize("padding_free", [True, False], ids=["padding_free", "padded"])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_and_inf_in_padded_inputs_embeds_never_reach_real_positions(backend, padding_free, tmp_path):
    """Whatever sits at padded positions of inputs_embeds (NaN, +Inf, -Inf here) changes no real position's output,
    and padded positions of every returned state are exactly zero."""
    reference = tiny_model("bert")
    model = fastbert.from_pretrained(_save(reference, tmp_path), backend=backend)
    model.padding_free = padding_free
    ids, mask = padded_batch(4, 9)
    mask[2, 3] = 0  # a hole inside a sequence, besides the right padding
    keep = mask.bool()
    embeds = reference.embeddings.word_embeddings(ids).detach()
    clean = torch.where(keep[..., None], embeds, 0.0)
    cycle = torch.arange(embeds.numel()).view(embeds.shape) % 3
    poison = torch.tensor([float("nan"), float("inf"), float("-inf")])[cycle]
    dirty = torch.where(keep[..., None], embeds, poison)
    with torch.inference_mode():
        expected = model(inputs_embeds=clean, attention_mask=mask, output_hidden_states=True)
        actual = model(inputs_embeds=dirty, attention_mask=mask, output_hidden_states=True)
    assert torch.isfinite(actual.last_hidden_state).all()
    assert torch.equal(actual.last_hidden_state[keep], expected.last_hidden_state[keep])
    assert torch.all(actual.last_hidden_state[~keep] == 0)
    assert torch.equal(actual.pooler_output, expected.pooler_output)
    for state in actual.hidden_states:
        assert torch.isfinite(state).all() and torch.all(state[~keep] == 0)


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return _save(tiny_model("bert"), tmp_path_factory.mktemp("bert"))


def test_token_id_outside_vocabulary(bert_dir):
    model = fastbert.from_pretrained(bert_dir)
    with pytest.raises(IndexError, match="vocabulary"):
        model(torch.tensor([[1, VOCAB]]))
    with pytest.raises(IndexError, match="vocabulary"):
        model(torch.tensor([[-1, 2]]))


def test_sequence_longer_than_positions(bert_dir):
    model = fastbert.from_pretrained(bert_dir)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, MAX_POSITIONS + 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(2, 4), ValueError, r"shape \[batch, seq\]"),
        (torch.ones(2, 1, 1, 5), ValueError, r"shape \[batch, seq\]"),
        (torch.full((2, 5), -10000.0), ValueError, "only 0 and 1 .*additive float masks"),
        (torch.full((2, 5), 2), ValueError, r"only 0 and 1 \(1 = attend, 0 = padding\)$"),
        (torch.ones(2, 5, dtype=torch.complex64), TypeError, "bool, integer or float"),
        ([[1, 1, 1, 1, 1]] * 2, TypeError, "torch.Tensor"),
    ],
    ids=["wrong-length", "4d", "additive-float", "integer-2", "complex", "list"],
)
def test_bad_attention_mask(bert_dir, mask, error, match):
    model = fastbert.from_pretrained(bert_dir)
    with pytest.raises(error, match=match):
        model(torch.ones(2, 5, dtype=torch.long), mask)


def test_bad_input_ids(bert_dir):
    model = fastbert.from_pretrained(bert_dir)
    with pytest.raises(ValueError, match="empty input"):
        model(torch.ones(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.ones(2, 5))
    with pytest.raises(ValueError, match="exactly one"):
        model()


def test_checkpoint_missing_files(bert_dir, tmp_path):
    with pytest.raises(fastbert.CheckpointError, match="not a directory"):
        fastbert.from_pretrained(tmp_path / "absent")
    shutil.copy(bert_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(fastbert.CheckpointError, match="holds no weights"):
        fastbert.from_pretrained(tmp_path)
    (tmp_path / "config.json").unlink()
    shutil.copy(bert_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(fastbert.CheckpointError, match="no config.json"):
        fastbert.from_pretrained(tmp_path)


def test_checkpoint_unreadable_weights_and_an_unknown_backend(bert_dir, tmp_path):
    shutil.copy(bert_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(bytes(100))
    with pytest.raises(fastbert.CheckpointError, match="model.safetensors is not a readable safetensors file"):
        fastbert.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(fastbert.CheckpointError, match="pytorch_model.bin is not a torch checkpoint holding only"):
        fastbert.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(fastbert.CheckpointError, match="pytorch_model.bin is not a readable torch checkpoint"):
        fastbert.from_pretrained(tmp_path)
    torch.save([torch.ones(2)], tmp_path / "pytorch_model.bin")
    with pytest.raises(fastbert.CheckpointError, match="pytorch_model.bin holds a list, not a dict of tensors"):
        fastbert.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unknown backend 'bogus'"):  # before the checkpoint is read
        fastbert.from_pretrained(tmp_path / "absent", backend="bogus")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        fastbert.FastBertModel(fastbert.from_pretrained(bert_dir).config, backend="tpu")


@pytest.mark.parametrize("dtype", [torch.int64, "int64", "float8", torch.bool, 3])
def test_a_dtype_that_is_not_floating_is_a_value_error_before_the_checkpoint_is_read(dtype, tmp_path):
    with pytest.raises(ValueError, match=r"is not a floating dtype; use one of auto, float32, .* int8"):
        fastbert.from_pretrained(tmp_path / "absent", dtype=dtype)


def test_torch_int8_quantizes_as_the_name_does(bert_dir):
    model = fastbert.from_pretrained(bert_dir, dtype=torch.int8)
    assert any("Int8" in type(layer).__name__ for layer in model.layers)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_a_gpu_torch_does_not_see_is_a_value_error_before_the_checkpoint_is_read(tmp_path):
    for device in ("cuda", torch.device("cuda:0")):  # torch raised an AssertionError about how it was compiled
        with pytest.raises(ValueError, match=r"^device 'cuda(:0)?' is not present \(torch .* sees no CUDA GPU\)$"):
            fastbert.from_pretrained(tmp_path / "absent", device=device)


def test_checkpoint_wrong_shapes_and_missing_keys(bert_dir, tmp_path):
    shutil.copy(bert_dir / "config.json", tmp_path / "config.json")
    state = load_file(bert_dir / "model.safetensors")
    broken = dict(state)
    broken["encoder.layer.1.intermediate.dense.weight"] = torch.zeros(5, 5)
    del broken["encoder.layer.0.attention.self.key.bias"]
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(fastbert.CheckpointError) as info:
        fastbert.from_pretrained(tmp_path)
    assert "encoder.layer.0.attention.self.key.bias" in str(info.value)
    assert "encoder.layer.1.intermediate.dense.weight: (5, 5)" in str(info.value)


def test_checkpoint_unexpected_keys_are_reported(bert_dir, tmp_path):
    shutil.copy(bert_dir / "config.json", tmp_path / "config.json")
    state = dict(load_file(bert_dir / "model.safetensors"))
    state["encoder.layer.0.extra.weight"] = torch.zeros(3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.warns(UserWarning, match="unused by fastbert"):
        model = fastbert.from_pretrained(tmp_path)
    assert model.loading_info["unexpected_keys"] == ["encoder.layer.0.extra.weight"]


def test_unsupported_model_type(bert_dir, tmp_path):
    config = json.loads((bert_dir / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(bert_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="not supported"):
        fastbert.from_pretrained(tmp_path)


@pytest.mark.parametrize("backend", ["eager", "auto"])
def test_torch_compile_fullgraph_on_a_padded_batch(tmp_path, backend):
    """Compiled, the model reads no tensor values (no graph break) and runs the padded form: same numbers. Under
    ``auto`` (the default) the whole-model decision's key read the thread count: a graph break, so fullgraph=True
    failed under no_grad / inference_mode."""
    from fastbert.backends import tuning

    torch._dynamo.reset()
    model = fastbert.from_pretrained(_save(tiny_model("bert"), tmp_path), backend=backend)
    ids, mask = padded_batch()
    tuning.set_enabled(True)  # (tests take the static order: measuring on, as users have it)
    try:
        with torch.inference_mode():
            expected = model(ids, mask).last_hidden_state
            actual = torch.compile(model, fullgraph=True)(ids, mask).last_hidden_state
    finally:
        tuning.set_enabled(False)
    keep = mask.bool()
    assert rel_err(actual[keep], expected[keep]) <= 1e-5
    assert torch.all(actual[~keep] == 0)


@pytest.mark.parametrize("form", ["padding_free", "padded", "compiled"])
def test_the_pooler_of_a_left_padded_row_reads_position_0_as_transformers_computes_it(form, tmp_path):
    """The pooler reads position 0, which left padding makes a padded position: transformers computes a state there,
    so fastbert does too for such a batch (last_hidden_state keeps zeros at padding)."""
    reference = tiny_model("bert")
    model = fastbert.from_pretrained(_save(reference, tmp_path), backend="eager")
    model.padding_free = form == "padding_free"
    ids, mask = padded_batch(4, 9)
    ids, mask = ids.flip(-1), mask.flip(-1)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if form == "compiled" else model
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask)
        actual = run(ids, mask)
    assert rel_err(actual.pooler_output, expected.pooler_output) <= 1e-5
    keep = mask.bool()
    assert rel_err(actual.last_hidden_state[keep], expected.last_hidden_state[keep]) <= 1e-5
    assert torch.all(actual.last_hidden_state[~keep] == 0)


def test_from_pretrained_does_not_import_transformers(minilm_dir):
    import subprocess
    import sys

    code = ("import sys, fastbert; fastbert.from_pretrained(sys.argv[1]); "
            "print('transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, minilm_dir], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("backend", ["cpp", "eager"])
def test_bf16_forward_on_cpu_stays_bf16_between_ops(backend, bert_dir):
    """The bf16 forward converts and copies no activation between ops: every op returns bf16 (LayerNorm statistics
    and softmax widen inside the kernels) and none is a dtype conversion or a copy."""
    model = fastbert.from_pretrained(bert_dir, dtype=torch.bfloat16, backend=backend)
    input_ids, attention_mask = padded_batch()
    with torch.inference_mode(), OpsSeen() as seen:
        model(input_ids, attention_mask=attention_mask)
    assert seen.float_results, "the mode saw no op"
    assert [r for r in seen.float_results if r[1] != torch.bfloat16] == []
    assert [r for r in seen.float_results if r[0] in ("aten::_to_copy", "aten::copy_", "aten::clone")] == []
