"""What several ``fastbert`` commands share when they run: the thread option's check, loading fastbert's model, and a
forward that records which backend ran each op (their options: `fastbert.cli.parsers`)."""

from __future__ import annotations

from typing import Any

import torch

from fastbert.bench import peers, recording
from fastbert.common.resolve import UserError, model_name


def set_threads(threads: int | None) -> None:
    """Apply a --threads option (None: leave torch's default); UserError below 1."""
    if threads is None:
        return
    if threads < 1:
        raise UserError("--threads must be >= 1")
    torch.set_num_threads(threads)


def model_line(model_dir: str, config: Any, device: torch.device, dtype: torch.dtype | str) -> str:
    """'<name> (<family>, <layers> layers, H=<hidden>) on <device>, <dtype>': the first line of demo and check."""
    return (f"{model_name(model_dir)} ({config.family}, {config.num_hidden_layers} layers, "
            f"H={config.hidden_size}) on {device}, {str(dtype).replace('torch.', '')}")


def backend_lines(seen: dict) -> list[str]:
    """Which backend ran each fastbert op (from `forward`'s record), and which backends this machine has."""
    used = recording.backends_used(seen)
    lines = ["fastbert ops ran on: " + ", ".join(f"{op}={backend}" for op, backend in used.items())]
    lines.append("backends: " + "; ".join(f"{k}: {v}" for k, v in recording.backend_availability().items()))
    return lines


def need_transformers(command: str) -> None:
    """UserError naming the extra to install when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise UserError(f"'fastbert {command}' compares with transformers, which is not installed "
                        "(pip install 'fastbert[hf]')") from err


def load_fastbert(model_dir: str, dtype: torch.dtype, device: torch.device, backend: str) -> torch.nn.Module:
    """fastbert's model of a checkpoint, in eval mode; a checkpoint it cannot read (CheckpointError) or a
    FASTBERT_BACKEND that names no backend is a UserError."""
    try:
        return peers.load_fastbert(model_dir, dtype, device, backend)
    except ValueError as err:  # CheckpointError is one
        raise UserError(str(err)) from err


def load_hf_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """transformers' AutoModel (eager attention) of a checkpoint, in eval mode; one it cannot load is a UserError
    (its own message is a table on stderr, which the quiet load hides)."""
    try:
        return peers.load_hf_model(model_dir, "eager", dtype, device)
    except (OSError, RuntimeError, ValueError) as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0][:300]
        raise UserError(f"{model_dir}: transformers cannot load it: {reason}") from err


def forward(model: torch.nn.Module, batch: dict, seen: dict | None = None) -> Any:
    """``model(**batch)`` under inference mode; with ``seen``, the backends each op ran on are added to it."""
    with torch.inference_mode():
        if seen is None:
            return model(**batch)
        with recording.record_backends() as recorded:
            out = model(**batch)
        for op, counts in recorded.items():
            seen.setdefault(op, type(counts)()).update(counts)
        return out
