"""scripts/setup.sh: its long steps show that they are alive (a heartbeat with the elapsed time) and how long they
took; sourcing the script defines its functions and installs nothing."""

import subprocess
import time
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
