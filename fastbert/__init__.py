"""fastbert: a fast, correct BERT-family encoder for PyTorch.

- `fastbert.from_pretrained(dir, task=None, ...)`: fastbert's own model from an HF checkpoint directory, offline;
  a task (`fastbert.TASKS`) adds that head (`fastbert.heads`) with transformers' losses.
- `fastbert.optimize(model)`: speed up a live transformers (or sentence-transformers) model in place.
- `fastbert.ops`: the fused ops, each with backends eager | triton | cpp (`fastbert.backends`).
"""

from importlib import metadata as _metadata

from fastbert import backends, ops
from fastbert.backends import BackendUnavailable
from fastbert.config import FastBertConfig
from fastbert.heads import TASKS, build_task_model, supported_tasks
from fastbert.loading import CheckpointError, from_pretrained
from fastbert.model import EncoderOutput, FastBertModel
from fastbert.optimize import explain, is_optimized, optimize

try:  # the one version is pyproject.toml's, as installed
    __version__ = _metadata.version("fastbert")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BackendUnavailable",
    "CheckpointError",
    "EncoderOutput",
    "FastBertConfig",
    "FastBertModel",
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
