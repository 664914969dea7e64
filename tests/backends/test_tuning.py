"""`auto` by measurement (fastbert.backends.tuning): a deliberately slow implementation loses whichever backend it
is, a forced backend is never measured, the on-disk cache (re-read without measuring, keyed by versions and
kernels, a corrupt file ignored, concurrent writers), the RNG and the inputs untouched by measuring, no measuring
under compile.

tests/conftest.py turns measuring off for the session; the `measuring` fixture turns it on with a cache directory
of the test's own."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from fastbert import backends, ops
from fastbert.backends import tuning
from tests.helpers import attention_args, padded_batch, tiny_model

OP = "linear_activation"
DELAY_S = 0.02  # far above the op's own time at these sizes, even on a loaded machine


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Measuring on, the tuning cache in tmp_path; the process's table forgotten before and after. One thread: two
    OpenMP threads on two busy cores stall a tiny backward for tens of ms, near DELAY_S."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    tuning.forget()
    backends.set_measuring(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)
    backends.set_measuring(False)
    tuning.forget()


def _args(rows: int = 7, grad: bool = False) -> tuple:
    x, w, b = torch.randn(rows, 16), torch.randn(24, 16, requires_grad=grad), torch.randn(24)
    return x, w, b, "gelu"


def _install(monkeypatch, slow: str | dict) -> dict[str, int]:
    """Make `OP`'s cpp and eager backends both the eager function, the one named ``slow`` busy for DELAY_S first
    (``slow`` may map backends to a predicate of x: sleep when it holds); returns the count of calls per backend."""
    slow_when = slow if isinstance(slow, dict) else {slow: lambda x: True}
    eager = backends.implementations(OP)["eager"].fn
    calls = {"cpp": 0, "eager": 0}

    def implementation(name):
        def run(x, *rest, **kwargs):
            calls[name] += 1
            if name in slow_when and slow_when[name](x):
                end = time.thread_time() + DELAY_S  # busy: at least DELAY_S of CPU time, and so of wall time
                while time.thread_time() < end:
                    pass
            return eager(x, *rest, **kwargs)
        return backends.OpImpl(run, lambda *a, **k: None, has_backward=True)

    backends.available()
    monkeypatch.setattr(backends, "_LOADED", backends._LOADED | {"cpp"})
    for name in calls:
        monkeypatch.setitem(backends._REGISTRY[OP], name, implementation(name))
    return calls


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("slow", ["cpp", "eager"])
def test_the_fast_implementation_is_chosen_whichever_is_slow(measuring, monkeypatch, slow, grad):
    _install(monkeypatch, slow)
    args = _args(grad=grad)
    decision = backends.decide(OP, "auto", args, {})
    fast = "eager" if slow == "cpp" else "cpp"
    assert (decision.backend, decision.how) == (fast, "measured")
    assert decision.times_ms[slow] >= DELAY_S * 1e3 and decision.times_ms[slow] > decision.times_ms[fast]
    assert "measured slower" in decision.skipped[slow]
    assert decision.shape_class.startswith(f"{OP} float32 {'grad' if grad else 'no-grad'}")
    explained = backends.explain(OP, *args)
    assert explained.startswith(f"{OP}: {fast} (measured earlier: {fast} ") and f"{slow} " in explained
    assert args[1].grad is None  # measuring under autograd leaves no gradient on the caller's tensors


def test_a_forced_backend_wins_and_is_not_measured(measuring, monkeypatch):
    calls = _install(monkeypatch, "cpp")
    assert backends.decide(OP, "cpp", _args(), {}).how == "forced"
    assert calls == {"cpp": 0, "eager": 0}
    assert backends.explain(OP, *_args(), backend="cpp") == f"{OP}: cpp"
    assert not list(measuring.rglob("*.json"))


def test_measuring_off_is_the_static_order(measuring, monkeypatch):
    calls = _install(monkeypatch, "cpp")
    backends.set_measuring(False)
    decision = backends.decide(OP, "auto", _args(), {})
    assert (decision.backend, decision.how) == ("cpp", "static order: measuring off")
    assert calls == {"cpp": 0, "eager": 0}
    monkeypatch.setenv("FASTBERT_TUNE", "1")
    backends.read_environment()
    assert backends.decide(OP, "auto", _args(), {}).backend == "eager"
    monkeypatch.setenv("FASTBERT_TUNE", "0")
    backends.read_environment()
    assert not tuning.enabled()


def test_the_cache_is_reread_without_measuring(measuring, monkeypatch):
    calls = _install(monkeypatch, "cpp")
    first = backends.decide(OP, "auto", _args(), {})
    files = list((measuring / "tuning").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["key"]["torch"] == torch.__version__ and stored["key"]["device"] == "cpu"
    assert stored["entries"][first.shape_class]["choice"] == "eager"
    tuning.forget()  # a fresh process's table
    before = dict(calls)
    again = backends.decide(OP, "auto", _args(5), {})  # 5 rows: the same class as 7 (rounded up to 8)
    assert (again.backend, again.how, again.times_ms) == ("eager", "cache", first.times_ms)
    assert calls == before
    assert backends.decide(OP, "auto", _args(130), {}).how == "measured"  # another row class
    assert len(json.loads(files[0].read_text())["entries"]) == 2


def test_a_changed_version_is_a_new_file(measuring, monkeypatch):
    calls = _install(monkeypatch, "cpp")
    backends.decide(OP, "auto", _args(), {})
    real = torch.__version__
    monkeypatch.setattr(torch, "__version__", "0.0.1+another")
    tuning.forget()
    before = dict(calls)
    assert backends.decide(OP, "auto", _args(), {}).how == "measured"
    assert calls["eager"] > before["eager"]
    keys = sorted(json.loads(p.read_text())["key"]["torch"] for p in (measuring / "tuning").glob("*.json"))
    assert keys == sorted(["0.0.1+another", real])


def test_a_changed_kernel_is_a_new_key(tmp_path, monkeypatch):
    """The key's kernel digest covers the extension's binary and each Triton kernel's source: an editable checkout
    whose kernels changed measures again although its version did not move."""
    extension = tmp_path / "_C.so"
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    extension.write_bytes(b"\x7fELF one build")
    (kernels / "attention.py").write_text("BLOCK = 64\n")
    specs = {"fastbert._C": SimpleNamespace(origin=str(extension)),
             "fastbert.kernels": SimpleNamespace(submodule_search_locations=[str(kernels)])}
    monkeypatch.setattr(tuning.importlib.util, "find_spec", specs.get)

    def digest() -> str:
        tuning.kernels_digest.cache_clear()
        return tuning.environment_key(torch.device("cpu"))["kernels"]

    try:
        first = digest()
        assert digest() == first
        extension.write_bytes(b"\x7fELF another build")
        rebuilt = digest()
        (kernels / "attention.py").write_text("BLOCK = 128\n")
        edited = digest()
        del specs["fastbert._C"]  # no extension (FASTBERT_SKIP_EXT=1)
        without_extension = digest()
    finally:
        monkeypatch.undo()
        tuning.kernels_digest.cache_clear()
    assert len({first, rebuilt, edited, without_extension}) == 4


def test_a_corrupt_file_is_ignored_with_one_warning(measuring, monkeypatch):
    _install(monkeypatch, "cpp")
    path, _ = tuning.key_file(torch.device("cpu"))
    path.parent.mkdir(parents=True)
    path.write_text('{"entries": {"half a')
    monkeypatch.setattr(tuning, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert backends.decide(OP, "auto", _args(), {}).how == "measured"
        assert backends.decide(OP, "auto", _args(130), {}).how == "measured"
    assert [str(w.message) for w in caught if "tuning cache" in str(w.message)] == [
        f"fastbert: tuning cache {path} ignored (JSONDecodeError: Unterminated string starting at: line 1 column "
        "14 (char 13)); measuring again"]
    assert len(json.loads(path.read_text())["entries"]) == 2  # rewritten whole


def test_measuring_leaves_the_rng_and_the_inputs_as_they_were(measuring):
    q, k, v, *rest = attention_args("packed", [5, 3, 1], window=None)
    for t in (q, k, v):
        t.requires_grad_(True)
    copies = [t.detach().clone() for t in (q, k, v)]
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    decision = backends.decide("attention", "auto", (q, k, v, *rest, 0.1, 7), {})
    if backends.available()["cpp"] is None:
        assert decision.how == "measured" and set(decision.times_ms) == {"cpp", "eager"}
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(t, c) and t.grad is None for t, c in zip((q, k, v), copies, strict=True))


def test_no_measuring_under_compile(measuring, monkeypatch):
    calls = _install(monkeypatch, "cpp")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    decision = backends.decide(OP, "auto", _args(), {})
    assert decision.how == "static order: not measured under torch.compile"
    assert calls == {"cpp": 0, "eager": 0}


def test_no_measuring_while_torch_compile_traces(measuring):
    """A real trace (dynamo, no code generation): the op runs, nothing is measured or written."""
    x, w, b, activation = _args()
    compiled = torch.compile(lambda x: ops.linear_activation(x, w, b, activation), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), ops.linear_activation_reference(x, w, b, activation))
    assert not list(measuring.rglob("*.json"))


def test_a_table_resolves_each_shape_class_once(measuring, monkeypatch):
    """cpp slow on many rows, eager slow on few: a measured table takes each where it is fast, per row class."""
    calls = _install(monkeypatch, {"cpp": lambda x: x.shape[0] > 64, "eager": lambda x: x.shape[0] <= 64})
    table = backends.OpTable("auto")
    small, large = _args(7), _args(130)
    table.linear_activation(*small)
    table.linear_activation(*large)
    assert {c: d.backend for c, d in table.decisions[OP].items()} == {
        f"{OP} float32 no-grad t{torch.get_num_threads()} 16x16,24x16,24,gelu": "cpp",
        f"{OP} float32 no-grad t{torch.get_num_threads()} 256x16,24x16,24,gelu": "eager"}
    before = sum(calls.values())
    for args in (small, large, _args(200)):  # 200 rows: the class of 130, resolved from the cache in memory
        table.linear_activation(*args)
    assert sum(calls.values()) - before == 3  # one call each: nothing measured again


def test_a_model_measures_each_op_once_and_explains_the_times(measuring, tmp_path):
    import fastbert

    tiny_model("bert", num_hidden_layers=3).save_pretrained(tmp_path / "model")
    model = fastbert.from_pretrained(tmp_path / "model")
    measured = []
    original = tuning.measure

    def counting(candidates, args, kwargs, **options):
        measured.append(bool(args))  # (a whole forward is timed with no arguments: `backends.decide_model`)
        return original(candidates, args, kwargs, **options)

    ids, mask = padded_batch(3, 9)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "measure", counting)
        model(ids, mask)
        first = sum(measured)
        model(ids, mask)
        assert sum(measured) == first
    explained = backends.explain(model)
    sites = sum(len(classes) for key, table in model._op_tables.items() if key[4] == "auto"
                for classes in table.decisions.values())
    # (loading a backend to time the whole model on it re-resolves the table: from the cache, "measured earlier")
    op_lines = [line for line in explained.splitlines() if "(measured" in line and "whole model" not in line]
    assert first == len(op_lines) == sites
    assert 4 <= sites <= 6  # embedding, qkv, attention, two linear_residual_layernorm widths, activation: not x3
    assert "static order" not in explained


def test_concurrent_writers_keep_every_entry(measuring):
    """Two processes record 30 classes each into the same file at the same moment: it stays valid JSON with all
    60 (each write merges what the other wrote, under the lock)."""
    script = ("import os, sys, time, torch\nfrom fastbert.backends import tuning\n"
              "open(sys.argv[2] + '.ready', 'w').close()\n"
              "while not os.path.exists(sys.argv[3]): time.sleep(0.01)\n"
              "for i in range(30):\n"
              "    entry = tuning.Entry('eager', {'eager': 1.0}, 1)\n"
              "    tuning.record(torch.device('cpu'), f'w{sys.argv[1]} c{i}', entry)\n")
    go = measuring / "go"
    workers = [subprocess.Popen([sys.executable, "-c", script, str(n), str(measuring / f"w{n}"), str(go)])
               for n in range(2)]
    deadline = time.monotonic() + 120
    while not all((measuring / f"w{n}.ready").exists() for n in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    assert [w.wait(timeout=120) for w in workers] == [0, 0]
    files = list((measuring / "tuning").glob("*.json"))
    assert len(files) == 1
    assert len(json.loads(files[0].read_text())["entries"]) == 60


def test_clear_removes_the_files(measuring, monkeypatch):
    _install(monkeypatch, "cpp")
    backends.decide(OP, "auto", _args(), {})
    removed = tuning.clear()
    assert [p.suffix for p in removed] == [".json"] and not removed[0].exists()
    assert backends.decide(OP, "auto", _args(), {}).how == "measured"


def test_shape_class_rounds_rows_and_keeps_widths():
    x, w, b, act = _args(130)
    cls = tuning.shape_class((x, w, b, act), {}, None)
    assert cls.endswith(" 256x16,24x16,24,gelu") and cls.startswith("float32 no-grad")
    assert tuning.shape_class((x[:129], w, b, act), {}, None) == cls
    assert tuning.shape_class((x[:65], w, b, act), {}, None) == cls
    assert tuning.shape_class((x[:64], w, b, act), {}, None) != cls
    assert [tuning.bucket(n) for n in (0, 1, 2, 4, 5, 7, 16, 17, 130, 768, 1024, 1025)] == \
        [0, 1, 4, 4, 16, 16, 16, 64, 256, 1024, 1024, 4096]
    with_seed = tuning.shape_class((x, 0.1, 12345), {}, 1)
    assert with_seed == tuning.shape_class((x, 0.2, 999), {}, 1) != tuning.shape_class((x, 0.0, 999), {}, 1)


def test_the_static_orders_choice_stays_unless_another_is_clearly_faster():
    margin = tuning.MARGIN
    assert tuning.pick({"cpp": 1.0, "eager": 1.0 / (1 + margin / 2)}, preferred="cpp") == "cpp"
    assert tuning.pick({"cpp": 1.0, "eager": 1.0 / (1 + 2 * margin)}, preferred="cpp") == "eager"
    assert tuning.pick({"cpp": 1.0, "eager": 1.0 / (1 + margin / 2)}) == "eager"  # no preference: the fastest
    assert tuning.pick({"cpp": 1.0, "eager": 1.0 / (1 + margin / 2)}, preferred="vendor") == "eager"


def test_dispatch_measures_a_call_once_and_remembers_it(measuring, monkeypatch):
    """The functional entries decide at every call: the first measures, the rest find the decision (also for
    dropout calls whose seed changes every step)."""
    calls = _install(monkeypatch, "cpp")
    args = _args(9)
    for _ in range(4):
        ops.linear_activation(*args)
    assert calls["eager"] > 4 and calls["cpp"] >= 1
    before = dict(calls)
    for _ in range(5):
        ops.linear_activation(*args)
    assert calls == {"cpp": before["cpp"], "eager": before["eager"] + 5}
    assert backends.decide(OP, "auto", args, {}).how == "cache"
    q, k, v, *rest = attention_args("packed", [5, 3], window=None)
    keys = {backends._call_key("attention", (q, k, v, *rest, 0.1, seed), {}) for seed in range(3)}
    assert len(keys) == 1


def test_one_cpu_thread_is_timed_by_its_cpu_time_and_more_threads_by_the_wall_clock(measuring):
    """With one intra-op thread the thread's CPU time is the clock, so time spent off the CPU (here a sleep, on a
    busy machine other processes' turns) does not count; with more threads, wall time."""
    x = torch.randn(3, 4)

    def sleeping(x):
        time.sleep(DELAY_S)
        return x + 1

    times, _, clock = tuning.measure({"eager": sleeping}, (x,), {})
    assert clock == "thread cpu" and times["eager"] < DELAY_S * 1e3 / 2
    torch.set_num_threads(2)  # the fixture restores the count
    times, _, clock = tuning.measure({"eager": sleeping}, (x,), {})
    assert clock == "wall" and times["eager"] >= DELAY_S * 1e3


def test_tables_resolved_inside_measuring_false_keep_the_static_order(measuring, monkeypatch):
    """What the benchmarks' static runners rely on: a table made inside `measuring(False)` stays static after the
    block, while tables made outside measure."""
    calls = _install(monkeypatch, "cpp")
    generation = backends.generation()
    with backends.measuring(False):
        static = backends.OpTable("auto")
    measured = backends.OpTable("auto")
    assert backends.generation() == generation  # the block drops no model's tables
    for _ in range(2):
        static.linear_activation(*_args())
        measured.linear_activation(*_args())
    assert static.chosen[OP] == "cpp" and measured.chosen[OP] == "eager"
    assert [d.how for d in static.decisions[OP].values()] == ["static order: measuring off"]
    assert calls["cpp"] > 2  # cpp ran in the static table, and was measured once


def test_calls_for_a_cuda_graph_are_a_class_of_their_own(measuring, monkeypatch):
    """Inside `for_replay` (a graph's warm-ups and capture) a call has its own shape class, so a table resolves it
    apart from the same shape outside: here cpp is slow only for graph calls, and each side takes its fast one."""
    calls = _install(monkeypatch, {"cpp": lambda x: tuning.replaying(), "eager": lambda x: not tuning.replaying()})
    table = backends.OpTable("auto")
    args = _args(7)
    table.linear_activation(*args)
    with tuning.for_replay():
        assert tuning.replaying()
        table.linear_activation(*args)
        with tuning.for_replay():  # nests
            assert tuning.replaying()
        assert tuning.replaying()
    assert not tuning.replaying()
    plain = f"{OP} float32 no-grad t{torch.get_num_threads()} 16x16,24x16,24,gelu"
    replayed = f"{OP} float32 no-grad t{torch.get_num_threads()} replayed 16x16,24x16,24,gelu"
    assert {c: d.backend for c, d in table.decisions[OP].items()} == {plain: "cpp", replayed: "eager"}
    before = dict(calls)
    with tuning.for_replay():
        table.linear_activation(*args)
    table.linear_activation(*args)
    assert calls == {"cpp": before["cpp"] + 1, "eager": before["eager"] + 1}  # each resolved once, kept apart


def test_for_replay_is_per_thread():
    import threading

    seen = []
    with tuning.for_replay():
        worker = threading.Thread(target=lambda: seen.append(tuning.replaying()))
        worker.start()
        worker.join()
    assert seen == [False]


def test_measuring_for_replay_on_cpu_keeps_the_cpu_clock(measuring):
    """The GPU clock is for CUDA tensors only: on CPU a graph never replays, and the CPU clocks stay."""
    with tuning.for_replay():
        _, _, clock = tuning.measure({"eager": lambda x: x + 1}, (torch.randn(3, 4),), {})
    assert clock == "thread cpu"


def test_a_round_starts_only_if_it_is_expected_to_end_within_the_budget(monkeypatch):
    """Rounds of 1/16 s under a 0.4 s budget, on a fake clock (the one `measure` reads the budget with) that only
    the rounds move: after the third (MIN_ROUNDS), a round starts only while the elapsed time plus the last round's
    fits, so the timing stops after six rounds at 0.375 s, not one round past the budget."""
    now = [0.0]  # tuning's `time` alone is replaced: nothing else in the process sees the fake clock
    monkeypatch.setattr(tuning, "time", SimpleNamespace(perf_counter=lambda: now[0], thread_time=lambda: now[0]))

    def round_of_a_sixteenth() -> None:
        now[0] += 1 / 16  # exact in binary: no rounding at the edge

    _, rounds, _ = tuning.measure({"sleeper": round_of_a_sixteenth}, (), {}, budget_s=0.4, warm_up=False)
    assert tuning.MIN_ROUNDS < rounds == 6
    assert now[0] == 0.375 <= 0.4
