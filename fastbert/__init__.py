"""fastbert: a fast, correct BERT-family encoder for PyTorch.

- `fastbert.from_pretrained(dir, task=None, ...)`: fastbert's own model from an HF checkpoint directory, offline;
  a task (`fastbert.TASKS`) adds that head (`fastbert.heads`) with transformers' losses.
- `fastbert.optimize(model)`: speed up a live transformers (or sentence-transformers) model in place.
- `fastbert.ops`: the fused ops, each with backends eager | triton | cpp | vendor | onednn
  (`fastbert.backends`).

The public names load on first use (a module ``__getattr__``): ``import fastbert`` and ``fastbert.__version__`` do
not import torch, so the ``fastbert`` command answers ``--help`` and ``--version`` at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from fastbert import backends, ops
    from fastbert.backends import BackendUnavailable
    from fastbert.config import FastBertConfig
    from fastbert.heads import TASKS, build_task_model, supported_tasks
    from fastbert.loading import CheckpointError, from_pretrained
    from fastbert.model import EncoderOutput, FastBertModel, PackedEncoderOutput
    from fastbert.optimize import explain, is_optimized, optimize
    from fastbert.packing import PackedBatch

try:  # the one version is pyproject.toml's, as installed
    __version__ = metadata.version("fastbert")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# public name -> the module that defines it (the submodules `backends` and `ops` are themselves public)
_EXPORTS = {
    "BackendUnavailable": "fastbert.backends",
    "CheckpointError": "fastbert.loading",
    "EncoderOutput": "fastbert.model",
    "FastBertConfig": "fastbert.config",
    "FastBertModel": "fastbert.model",
    "TASKS": "fastbert.heads",
    "backends": None,
    "build_task_model": "fastbert.heads",
    "explain": "fastbert.optimize",
    "from_pretrained": "fastbert.loading",
    "is_optimized": "fastbert.optimize",
    "ops": None,
    "optimize": "fastbert.optimize",
    "PackedBatch": "fastbert.packing",
    "PackedEncoderOutput": "fastbert.model",
    "supported_tasks": "fastbert.heads",
}

__all__ = [  # `_EXPORTS`' names (a literal list: linters and type checkers read it)
    "BackendUnavailable",
    "CheckpointError",
    "EncoderOutput",
    "FastBertConfig",
    "FastBertModel",
    "PackedBatch",
    "PackedEncoderOutput",
    "TASKS",
    "backends",
    "build_task_model",
    "explain",
    "from_pretrained",
    "is_optimized",
    "ops",
    "optimize",
    "supported_tasks",
]


def __getattr__(name: str) -> object:
    """Load a public name on first use (then it is an ordinary attribute)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastbert' has no attribute {name!r}")
    source = _EXPORTS[name]
    value = importlib.import_module(f"fastbert.{name}") if source is None else \
        getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package's module type: importing the submodule ``fastbert.optimize`` makes the import system set the
    package's attribute ``optimize`` to that module, which would hide the function `fastbert.optimize.optimize`
    (the eager package imported the function after the module); the function stays."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "optimize" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
