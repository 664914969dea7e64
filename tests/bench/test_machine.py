"""fastbert.bench.machine: the warning that other work on the machine skews the timings."""

from fastbert.bench import machine


def test_busy_warning_when_the_load_is_high_or_the_threads_exceed_the_idle_cores(monkeypatch):
    assert machine.busy_warning(threads=2, cores=2, load=0.2) is None
    assert machine.busy_warning(threads=1, cores=2, load=0.9) is None
    high = machine.busy_warning(threads=1, cores=2, load=1.5)
    assert high.startswith("fastbert: warning: ") and "load average 1.5 on 2 cores" in high and "\n" not in high
    assert machine.busy_warning(threads=8, cores=16, load=9.0) is not None  # over half the cores busy
    assert machine.busy_warning(threads=4, cores=4, load=1.2) is not None  # 4 threads, under 3 cores idle
    monkeypatch.setattr(machine, "load_average", lambda: 3.0)
    assert "load average 3.0" in machine.busy_warning(threads=2, cores=2)
    monkeypatch.setattr(machine, "load_average", lambda: None)  # an OS without one: no warning
    assert machine.busy_warning(threads=2, cores=2) is None


def test_cpu_results_name_the_cpu_flags():
    from fastbert.cpu import cpu_flags

    info = machine.machine_info("cpu")
    assert info["cpu_flags"] == list(cpu_flags()) and info["torch_cpu_capability"]
    assert "openvino" in info["versions"]


def test_git_commit_short_and_full_and_none_outside_a_checkout(tmp_path):
    from pathlib import Path

    import pytest

    root = Path(__file__).resolve().parents[2]
    short, full = machine.git_commit(root), machine.git_commit(root, short=False)
    if full is None:
        pytest.skip("the tests run from a copy without .git")
    assert len(full) == 40 and full.startswith(short) and len(short) < 40
    assert machine.git_commit(tmp_path) is None
