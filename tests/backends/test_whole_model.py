"""Whole-model decisions (`fastbert.backends.decide_model`): under `auto`, a CPU inference forward is also timed
whole, the per-op table against each backend alone, and runs the winner; the choice is cached per model class,
bounded by a budget, explained, and never taken for training, grad mode, a forced backend or measuring off.

The times are planted (a stand-in for `tuning.measure` on whole forwards): which backend is really faster is the
benchmarks' business, not a unit test's."""

from __future__ import annotations

import pytest
import torch

import fastbert
from fastbert import backends
from fastbert.backends import onednn, tuning
from fastbert.bench.recording import record_backends
from tests.helpers import padded_batch, tiny_model

TABLE = backends.MODEL_TABLE


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring on, the tuning cache in tmp_path, the process's table forgotten before and after."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path / "cache"))
    tuning.forget()
    backends.set_measuring(True)
    yield tmp_path / "cache"
    backends.set_measuring(False)
    tuning.forget()


@pytest.fixture
def checkpoint(tmp_path):
    tiny_model("bert", num_hidden_layers=2).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _plant(monkeypatch, whole_ms: dict[str, float]) -> list[set[str]]:
    """Whole forwards 'measure' at ``whole_ms`` (each candidate still runs once); ops measure as they do. Returns
    the candidate sets each whole-model measurement was asked for."""
    asked: list[set[str]] = []
    original = tuning.measure

    def measure(candidates, args, kwargs, **options):
        if args or kwargs:
            return original(candidates, args, kwargs, **options)
        asked.append(set(candidates))
        for run in candidates.values():
            run()
        return {name: whole_ms[name] for name in candidates}, 3, "wall"

    monkeypatch.setattr(tuning, "measure", measure)
    return asked


def _forward(model, ids, mask) -> tuple[torch.Tensor, dict]:
    with torch.inference_mode(), record_backends() as seen:
        hidden = model(ids, mask).last_hidden_state
    return hidden, {op: set(counts) for op, counts in seen.items()}


def test_a_backend_alone_that_wins_the_whole_forward_runs_it(measuring, monkeypatch, checkpoint):
    asked = _plant(monkeypatch, {TABLE: 2.0, "cpp": 3.0, "onednn": 1.0, "eager": 4.0})
    model = fastbert.from_pretrained(checkpoint)
    ids, mask = padded_batch(3, 9)
    first, _ = _forward(model, ids, mask)
    again, seen = _forward(model, ids, mask)
    assert asked == [{TABLE, "cpp", "onednn"}]  # once: the second forward is decided already (eager: not alone)
    assert {backend for backends_ in seen.values() for backend in backends_} == {"onednn"}
    backends.set_measuring(False)
    reference, _ = _forward(fastbert.from_pretrained(checkpoint), ids, mask)
    torch.testing.assert_close(again, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(first, reference, rtol=1e-5, atol=1e-5)
    # (record_backends re-resolves the tables: the second forward read the choice back from the cache)
    explained = backends.explain(model)
    assert "whole model: onednn (measured earlier: onednn 1 ms, per-op table 2 ms, cpp 3 ms) for bert-" in explained
    [decision] = backends.whole_model_decisions(model)
    assert decision.how == "cache" and decision.shape_class.startswith("model bert-")


def test_explain_after_a_whole_model_forward_says_what_ran(measuring, monkeypatch, checkpoint):
    """No per-op table exists when the whole model ran one backend: explain says so, not "has not run yet"."""
    _plant(monkeypatch, {TABLE: 2.0, "cpp": 3.0, "onednn": 1.0, "eager": 4.0})
    ids, mask = padded_batch(3, 9)
    first, model = fastbert.from_pretrained(checkpoint), fastbert.from_pretrained(checkpoint)
    with torch.inference_mode():
        first(ids, mask)  # measures, and caches the choice
        model(ids, mask)  # reads the choice back: no per-op table is built
    explained = backends.explain(model)
    assert "has not run yet" not in explained
    assert "one backend for the whole model" in explained and "whole model: onednn" in explained


def test_a_new_process_reads_the_whole_model_choice_from_the_cache(measuring, monkeypatch, checkpoint):
    _plant(monkeypatch, {TABLE: 2.0, "cpp": 1.0, "onednn": 3.0, "eager": 4.0})
    ids, mask = padded_batch(3, 9)
    _forward(fastbert.from_pretrained(checkpoint), ids, mask)
    tuning.forget()  # as a new process: the file is read again
    asked = _plant(monkeypatch, {})
    model = fastbert.from_pretrained(checkpoint)
    _, seen = _forward(model, ids, mask)
    assert asked == [] and {b for bs in seen.values() for b in bs} == {"cpp"}
    assert [d.how for d in backends.whole_model_decisions(model)] == ["cache"]


def test_the_table_stays_unless_a_backend_alone_is_clearly_faster(measuring, monkeypatch, checkpoint):
    _plant(monkeypatch, {TABLE: 1.0, "cpp": 0.99, "onednn": 1.5, "eager": 4.0})  # cpp within MODEL_MARGIN
    model = fastbert.from_pretrained(checkpoint)
    _forward(model, *padded_batch(3, 9))
    assert [d.backend for d in backends.whole_model_decisions(model)] == [TABLE]
    assert tuning.pick({TABLE: 1.0, "cpp": 0.97}, TABLE, backends.MODEL_MARGIN) == "cpp"


def test_over_the_budget_the_table_runs_nothing_is_cached_and_no_copy_stays(measuring, monkeypatch, checkpoint):
    asked = _plant(monkeypatch, {})
    model = fastbert.from_pretrained(checkpoint)
    before = onednn.packed_count()
    with backends.model_budget(0.0):
        _forward(model, *padded_batch(3, 9))
    [decision] = backends.whole_model_decisions(model)
    assert asked == [] and decision.backend == TABLE and "over the 0 s budget" in decision.how
    assert not any(cls.startswith("model ") for cls in tuning.entries(torch.device("cpu")))
    # Only weights the table itself runs on onednn keep a packed copy: those of an op with a shape class that chose
    # onednn (measured under whatever load: either way). A layer's weights per op: QKV 1, FFN in 1, attention out
    # and FFN out 2 (linear_residual_layernorm, one shape class each).
    per_layer = {"qkv_projection": 1, "linear_activation": 1, "linear_residual_layernorm": 2}
    onednn_ops = {cls.split()[0] for cls, entry in tuning.entries(torch.device("cpu")).items()
                  if entry.choice == "onednn"}
    allowed = sum(per_layer.get(op, 0) for op in onednn_ops) * len(model.layers)
    assert onednn.packed_count() - before <= allowed, (onednn_ops, onednn.packed_count() - before)


@pytest.mark.parametrize("case", ["grad mode", "training", "forced backend", "measuring off"])
def test_no_whole_model_decision_outside_auto_cpu_inference(measuring, monkeypatch, checkpoint, case):
    asked = _plant(monkeypatch, {})
    model = fastbert.from_pretrained(checkpoint, backend="cpp" if case == "forced backend" else "auto")
    ids, mask = padded_batch(3, 9)
    if case == "measuring off":
        backends.set_measuring(False)
    if case == "training":
        model.train()
    with torch.set_grad_enabled(case in ("grad mode", "training")):
        model(ids, mask)
    assert asked == [] and backends.whole_model_decisions(model) == []


def test_a_cached_winner_that_cannot_run_this_model_alone_falls_back_once(measuring, monkeypatch, checkpoint):
    """The cache says onednn alone, but this model's weights were made under inference_mode (onednn declines
    them): the forward runs the per-op table, and later forwards go straight to it."""
    _plant(monkeypatch, {TABLE: 2.0, "cpp": 3.0, "onednn": 1.0})
    ids, mask = padded_batch(3, 9)
    _forward(fastbert.from_pretrained(checkpoint), ids, mask)  # caches onednn alone for this class
    with torch.inference_mode():
        model = fastbert.from_pretrained(checkpoint)
    tried = []
    original = model._encode

    def encode(table, *call):
        tried.append(table.backend)
        return original(table, *call)

    monkeypatch.setattr(model, "_encode", encode)
    for _ in range(2):
        with torch.inference_mode():
            model(ids, mask)
    assert tried == ["onednn", "auto", "auto"]


def test_an_int8_model_is_not_decided_whole(measuring, monkeypatch, checkpoint):
    from fastbert.quantization import int8_unavailable, quantize_int8

    if int8_unavailable(torch.device("cpu"), torch.float32):
        pytest.skip(int8_unavailable(torch.device("cpu"), torch.float32))
    asked = _plant(monkeypatch, {})
    model = quantize_int8(fastbert.from_pretrained(checkpoint))
    _forward(model, *padded_batch(3, 9))
    assert asked == [] and backends.whole_model_decisions(model) == []
