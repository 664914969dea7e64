"""scripts/setup.sh: its long steps show that they are alive (a heartbeat with the elapsed time) and how long they
took; sourcing the script defines its functions and installs nothing; the tested versions (constraints.txt) are
written by --freeze and checked before a venv counts as current."""

import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bash(code: str) -> subprocess.CompletedProcess:
    # PYTHON=false: were sourcing ever to run the setup, it would stop at once, creating no .venv
    return subprocess.run(["bash", "-c", f"PYTHON=false source ./scripts/setup.sh; {code}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)


def test_a_long_step_prints_a_heartbeat_with_the_elapsed_time_and_its_duration():
    started = time.monotonic()
    proc = _bash('HEARTBEAT_S=1 with_heartbeat "building the thing" sleep 3.5')
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 30  # sourcing ran no install
    beats = [line for line in proc.stderr.splitlines() if line.startswith("fastbert setup: still building the thing")]
    assert len(beats) >= 2 and "s elapsed" in beats[0], proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("fastbert setup: building the thing took ")


def test_a_failing_step_keeps_its_exit_status_and_stops_its_heartbeat():
    proc = _bash('HEARTBEAT_S=1 with_heartbeat "failing" bash -c "sleep 1.2; exit 3"; echo "status $?"')
    assert proc.stdout.strip() == "status 3"
    assert "still failing" in proc.stderr and proc.stderr.count("still failing") <= 2


def _in_this_venv(code: str, constraints: Path) -> subprocess.CompletedProcess:
    """``code`` with the script's functions, against the venv running these tests and ``constraints``."""
    return _bash(f"VENV={sys.prefix} CONSTRAINTS={constraints}; {code}")


def test_freeze_pins_every_installed_package_but_fastbert(tmp_path):
    pins = tmp_path / "constraints.txt"
    proc = _in_this_venv("freeze_constraints", pins)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in pins.read_text().splitlines() if not line.startswith("#")]
    names = {line.split("==")[0].lower() for line in lines}
    assert all("==" in line for line in lines) and {"torch", "transformers", "kernels", "triton"} <= names
    assert "fastbert" not in names
    assert f"torch=={metadata.version('torch').split('+')[0]}" in lines  # no +cpu label: it pins any build


def test_a_venv_off_the_tested_versions_is_not_current(tmp_path):
    pins = tmp_path / "constraints.txt"
    pins.write_text(f"# tested\ntransformers=={metadata.version('transformers')}\nnot-installed-here==1.0\n")
    assert "is not the tested" not in _in_this_venv("venv_is_current", pins).stdout
    pins.write_text("# tested\ntransformers==4.0.0\n")
    proc = _in_this_venv("venv_is_current", pins)
    assert proc.returncode == 1
    assert proc.stdout.strip() == f"transformers {metadata.version('transformers')} is not the tested ==4.0.0 of {pins}"


def test_an_unknown_option_is_refused_before_anything_is_installed():
    proc = subprocess.run(["./scripts/setup.sh", "--newset"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and "unknown option --newset" in proc.stderr


def test_the_committed_constraints_pin_what_the_project_depends_on():
    pins = {line.split("==")[0].lower(): line.split("==")[1] for line in (ROOT / "constraints.txt").read_text()
            .splitlines() if line and not line.startswith("#")}
    for name in ("torch", "transformers", "tokenizers", "sentence-transformers", "triton", "kernels", "onnxruntime",
                 "openvino", "ray", "fastapi", "uvicorn", "pydantic", "accelerate", "safetensors"):
        assert name in pins, f"constraints.txt pins no {name}"
    assert pins["torch"] == "2.13.0"
