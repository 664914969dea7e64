"""Machine facts for a results file: a short tag ('cpu-2core', 'nvidia-h200'), CPU and GPU names, cores, load,
library versions, the date, the CPU's features (`fastbert.cpu`, the one reader of /proc/cpuinfo) and the git
commit."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

import torch

from fastbert.cpu import cpu_flags, cpu_info


def _cpu_name() -> str:
    return cpu_info()[0]


def git_commit(root: str | Path, short: bool = True) -> str | None:
    """The commit checked out at ``root``, abbreviated unless ``short`` is false; None outside a git checkout or
    without git."""
    command = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        found = subprocess.run(command, cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return found.stdout.strip() or None


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_tag(device: torch.device | str) -> str:
    """'cpu-2core' on CPU, the GPU name as a slug on CUDA (e.g. 'nvidia-h200')."""
    device = torch.device(device)
    if device.type == "cuda":
        return _slug(torch.cuda.get_device_name(device))
    return f"cpu-{os.cpu_count()}core"


def package_version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is simply reported as None
        return None


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'4.56.0.dev0' -> (4, 56, 0); None or unparsable -> ()."""
    parts = []
    for piece in (text or "").split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


# A machine counts as busy when the 1-minute load average is over this fraction of its cores: other work then
# takes cores the timed threads wait for (seen: 3-30x slower numbers, and a ranking inverted, on 2 shared cores).
BUSY_LOAD_FRACTION = 0.5


def load_average() -> float | None:
    """The 1-minute load average (None where the OS keeps none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def busy_warning(threads: int, cores: int | None = None, load: float | None = None) -> str | None:
    """A one-line warning when other work competes with a benchmark of ``threads`` threads: the load is over
    `BUSY_LOAD_FRACTION` of the cores, or the threads exceed the idle cores by more than half a core; else None.
    ``load``: the 1-minute load average (default: `load_average`)."""
    cores = cores or os.cpu_count() or 1
    load = load_average() if load is None else load
    if load is None:
        return None
    idle = max(cores - load, 0.0)
    if load <= BUSY_LOAD_FRACTION * cores and threads <= idle + 0.5:
        return None
    return (f"fastbert: warning: the machine is busy (1-minute load average {load:.1f} on {cores} cores, about "
            f"{idle:.1f} idle, for {threads} threads): timings can come out several times slower and rankings "
            "inverted; rerun when it is idle, or with --threads at most the idle cores")


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """Machine tag, CPU/GPU, core count, load, library versions and the date, for a results file."""
    device = torch.device(device)
    info = {
        "tag": machine_tag(device),
        "device": device.type,
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {name: package_version(name) for name in ("torch", "transformers", "triton", "onnxruntime", "onnx",
                                                       "openvino", "tokenizers", "fastbert")},
    }
    # the features each precision's speed depends on (VNNI, AMX, AVX-512 BF16), and a GPU's host time
    info["cpu_flags"] = list(cpu_flags())
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info
