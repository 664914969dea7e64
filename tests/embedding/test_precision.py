"""``--dtype auto`` for embeddings: int8 only where the checkpoint's probe finds it faster and accurate enough,
measured once and kept; every other case keeps the float precision, with the reason in the one announced line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fastbert import quantization
from fastbert.backends import tuning
from fastbert.embedding import Embedder, precision

CPU = torch.device("cpu")
VNNI = ("avx512f", "avx512_vnni")


def probe(cosine: float, int8_ms: float, float_ms: float) -> dict:
    return {"worst_cosine": cosine, "int8_ms": int8_ms, "float_ms": float_ms, "float": "float32", "measured": "now"}


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache, nothing announced yet, a CPU with VNNI and measuring on (no real timing: `measure` is
    replaced by each test)."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    monkeypatch.setattr(precision, "PROCESS_PROBES", {})
    monkeypatch.setattr(precision, "cpu_flags", lambda: VNNI)
    monkeypatch.setattr(tuning, "enabled", lambda: True)


def choose(tiny_dir: str) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        choice = precision.auto_precision(tiny_dir, "float32", "float32: no native bfloat16", CPU)
    return choice, [str(w.message) for w in record]


@pytest.mark.parametrize("cosine, int8_ms, expected", [(0.998, 50.0, "int8"), (0.990, 50.0, "float32"),
                                                       (0.998, 98.0, "float32")])
def test_int8_needs_both_the_cosine_and_the_speed(fresh, monkeypatch, tiny_dir, cosine, int8_ms, expected):
    monkeypatch.setattr(precision, "measure", lambda model_dir, float_precision: probe(cosine, int8_ms, 100.0))
    choice, messages = choose(tiny_dir)
    assert choice == expected
    assert len(messages) == 1 and messages[0].startswith(f"fastbert: dtype auto for embeddings: {expected}: ")
    assert f"worst cosine {cosine:.4f}" in messages[0]


def test_the_probe_is_measured_once_and_kept_on_disk(fresh, monkeypatch, tiny_dir):
    calls = []
    monkeypatch.setattr(precision, "measure", lambda *args: calls.append(args) or probe(0.999, 10.0, 20.0))
    assert choose(tiny_dir)[0] == "int8"
    monkeypatch.setattr(precision, "PROCESS_PROBES", {})  # a new process: only the file remains
    assert choose(tiny_dir)[0] == "int8"
    assert len(calls) == 1 and precision.probes_path().is_file()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count: measured again
    assert choose(tiny_dir)[0] == "int8" and len(calls) == 2


@pytest.mark.parametrize("flags, tune, why", [((), True, "no int8 dot products"),
                                              (VNNI, False, "measuring is off")])
def test_without_vnni_or_with_measuring_off_the_float_precision_runs(fresh, monkeypatch, tiny_dir, flags, tune, why):
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    monkeypatch.setattr(tuning, "enabled", lambda: tune)
    monkeypatch.setattr(precision, "measure", lambda *args: pytest.fail("measured"))
    choice, messages = choose(tiny_dir)
    assert choice == "float32" and len(messages) == 1
    assert "float32: no native bfloat16; not int8: " in messages[0] and why in messages[0]


def test_only_auto_considers_int8_and_a_ray_driver_does_not_measure(fresh, monkeypatch, tiny_dir, tmp_path):
    monkeypatch.setattr(precision, "measure", lambda *args: probe(0.999, 10.0, 20.0))
    monkeypatch.setattr(quantization, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f",))  # float32 for auto
    assert Embedder(tiny_dir, dtype="float32").precision == "float32"
    assert Embedder(tiny_dir, dtype="auto").precision == "int8"
    monkeypatch.setattr(precision, "measure", lambda *args: pytest.fail("measured"))
    monkeypatch.setattr(precision, "PROCESS_PROBES", {})
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path / "empty"))
    assert Embedder(tiny_dir, dtype="auto", load_model=False).precision == "float32"


def test_the_real_probe_measures_the_checkpoint(fresh, tiny_dir):
    """`measure` itself on a small random checkpoint: a cosine in [-1, 1] and positive times (no speed asserted)."""
    found = precision.measure(tiny_dir, "float32")
    assert -1.0 <= found["worst_cosine"] <= 1.0 + 1e-6
    assert found["int8_ms"] > 0 and found["float_ms"] > 0 and found["float"] == "float32"
    assert np.isfinite([found["int8_ms"], found["float_ms"]]).all()


def test_the_probe_runs_on_the_cpu_even_where_a_gpu_is_the_default(fresh, monkeypatch, tiny_dir):
    """`Embedder(device="cpu", dtype="auto")` on a GPU machine: the probe's models are CPU models too."""
    from fastbert.common import resolve

    monkeypatch.setattr(resolve, "best_device", lambda: "cuda")
    found = precision.measure(tiny_dir, "float32")
    assert found["int8_ms"] > 0


@pytest.mark.parametrize("clearing", ["forget", "clear"])
def test_clearing_the_tuning_cache_forgets_the_process_probe(fresh, monkeypatch, tiny_dir, clearing):
    """`tuning.forget` / `tuning.clear` (``fastbert tune --clear``) in the same process: the next auto decision
    reads or measures again instead of the probe the process kept."""
    monkeypatch.setattr(precision, "measure", lambda *args: probe(0.999, 10.0, 20.0))
    assert choose(tiny_dir)[0] == "int8"
    getattr(tuning, clearing)()
    precision.write_probe(precision.probe_key(tiny_dir, "float32"), probe(0.999, 30.0, 20.0))  # what is kept now
    monkeypatch.setattr(precision, "measure", lambda *args: pytest.fail("measured: the file holds a probe"))
    assert choose(tiny_dir)[0] == "float32"
    if clearing == "clear":
        tuning.clear()
        monkeypatch.setattr(precision, "measure", lambda *args: probe(0.999, 10.0, 20.0))
        assert choose(tiny_dir)[0] == "int8"


@pytest.mark.parametrize("cosine, int8_ms, expected", [(0.998, 50.0, "int8"), (0.998, 98.0, "float32")])
def test_the_line_gives_the_float_precision_and_why_beside_int8s_verdict(fresh, monkeypatch, tiny_dir, cosine,
                                                                        int8_ms, expected):
    monkeypatch.setattr(precision, "measure", lambda model_dir, float_precision: probe(cosine, int8_ms, 100.0))
    choice, messages = choose(tiny_dir)
    assert choice == expected and len(messages) == 1
    assert "float32: no native bfloat16" in messages[0]  # the float precision's reason, whichever runs
    assert f"int8 {int8_ms:.1f} ms against float32 100.0 ms" in messages[0] and "worst cosine 0.9980" in messages[0]


def test_on_cuda_auto_states_the_float_choice_alone(fresh, monkeypatch, tiny_dir):
    """int8 never runs on CUDA: ``Embedder(dtype="auto")`` there announces float16 and why, with no word of int8
    (no GPU here: the device the Embedder resolves is replaced, and so is loading the model on it)."""
    monkeypatch.setattr(precision, "int8_probe", lambda *args: pytest.fail("int8 considered on CUDA"))
    monkeypatch.setattr(Embedder, "_device", staticmethod(lambda device, load_model: torch.device("cuda")))
    monkeypatch.setattr(Embedder, "_load_model", lambda self, backend: None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        embedder = Embedder(tiny_dir, dtype="auto")
    messages = [str(w.message) for w in record if "dtype auto" in str(w.message)]
    assert embedder.precision == "float16"
    assert messages == ["fastbert: dtype auto for embeddings: float16 on CUDA; --dtype overrides"]
