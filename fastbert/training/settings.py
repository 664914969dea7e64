"""What the settings of `fastbert pretrain` and `fastbert distill` share: the options of a run that are not about its
data, model or loss (checkpoints, evaluation, logging, seed, resume, threads, device, backend, progress)."""

from __future__ import annotations

from dataclasses import dataclass

from fastbert.common.resolve import UserError


@dataclass(kw_only=True)
class RunSettings:
    """The run options common to `fastbert.training.pretrain.PretrainSettings` and
    `fastbert.training.distill.DistillSettings`; keyword-only, so that a subclass's own fields (its required
    ``output_dir`` first) come first in ``__init__``."""

    save_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 200
    log_every: int = 10
    seed: int = 0
    resume: bool = False
    threads: int | None = None
    device: str = "cpu"
    backend: str = "auto"
    optimize: bool = True
    progress: bool | None = None

    def check(self) -> None:
        """UserError naming the first run option that cannot run (by its command-line option)."""
        if self.threads is not None and self.threads < 1:
            raise UserError("--threads must be >= 1")
