"""Devices a model can be put on: a name checked against what torch sees, so that a missing GPU is one clear
`ValueError` (torch's own is an AssertionError about how it was compiled, or an error at the first kernel)."""

from __future__ import annotations

import torch


def checked_device(device: torch.device | str) -> torch.device:
    """``device`` as a `torch.device`, after checking that it is a CPU or a CUDA GPU torch sees; ValueError
    otherwise."""
    name = str(device)
    try:
        device = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"unknown device {name!r}") from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (use cpu or cuda)")
    if device.type == "cpu" and device.index not in (None, 0):
        raise ValueError(f"device {name!r} does not exist: there is one CPU device, 'cpu'")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {name!r} is not present (torch {torch.__version__} sees no CUDA GPU)")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {name!r} is not present (torch sees {count} CUDA GPU(s), cuda:0 to "
                             f"cuda:{count - 1})")
    return device
