"""`release_openmp_threads` ends the calling thread's OpenMP workers (libgomp, what torch's wheels load), so that
a model's thread other than the main one runs torch's parallel loops at full speed. Checked in a fresh process by
its thread count: the main thread's parallel region leaves a worker, which the release ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os, threading, torch
from fastbert.common.threads import release_openmp_threads

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
start = threads()
torch.randn(1 << 20).mul(2.0)  # a parallel region in the main thread: its team keeps a worker
with_team = threads()
released = release_openmp_threads()
after = threads()
torch.randn(1 << 20).mul(2.0)  # a later region starts a team again
print(start, with_team, released, after, threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_release_ends_the_calling_threads_openmp_workers():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    start, with_team, released, after, again = out.stdout.split()
    assert released == "True", out.stdout
    assert int(with_team) == int(start) + 1 and int(after) == int(start) and int(again) == int(with_team)
