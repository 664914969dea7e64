"""What the settings of `fastbert pretrain` and `fastbert distill` share: the options of a run that are not about its
data, model or loss (checkpoints, evaluation, logging, seed, resume, threads, device, backend, progress), and what
both do with them before anything loads (`RunSettings.start`); and what every training command's checkpoint options
(``--model``, ``--teacher``, ``--tokenizer``) say when given a run's output directory instead (`run_model_hint`)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fastbert.common.resolve import UserError, check_dir_creatable, resolve_device, resolve_model
from fastbert.config import FastBertConfig
from fastbert.training.loop import latest_checkpoint


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
        for option, value, minimum in (("--save-every", self.save_every, 0), ("--eval-every", self.eval_every, 0),
                                       ("--log-every", self.log_every, 1),
                                       ("--keep-checkpoints", self.keep_checkpoints, 1)):
            if value < minimum:
                raise UserError(f"{option} must be >= {minimum}, got {value}")

    def start(self, output_dir: str) -> torch.device:
        """Before anything loads or is written: check these options and ``output_dir`` (a resume needs it, a new run
        one without a run in it), apply --threads, silence transformers' download bars and notices (they would cut
        into the run's own output); returns the device. UserError for what cannot run."""
        self.check()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        device = resolve_device(self.device)
        check_output_dir(Path(output_dir), self.resume)
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        return device


def check_number(option: str, value: float | None, minimum: float = 0.0, *, strict: bool = False,
                 error: type[Exception] = UserError) -> None:
    """``error`` naming ``option`` unless ``value`` (None: not given) is a finite number >= ``minimum`` (> with
    ``strict``). A comparison alone lets nan through (``nan <= 0`` is False), and nan or inf trains to nan."""
    if value is None:
        return
    if not (math.isfinite(value) and (value > minimum if strict else value >= minimum)):
        raise error(f"{option} must be a number {'>' if strict else '>='} {minimum:g}, got {value}")


def check_output_dir(output_dir: str | os.PathLike, resume: bool) -> None:
    """UserError unless ``output_dir`` exists for a resume, or holds no run for a new one (or can be created)."""
    output_dir = Path(output_dir)
    if resume and not output_dir.is_dir():
        raise UserError(f"--resume: {output_dir} does not exist")
    if not resume and latest_checkpoint(output_dir) is not None:
        raise UserError(f"{output_dir} already holds a run; continue it with --resume or choose another -o")
    check_dir_creatable(output_dir, "-o")


def run_model(directory: str | os.PathLike, marker: str = "config.json") -> Path | None:
    """The checkpoint a training run's output directory holds: ``DIR/model`` (the model a finished `fastbert
    finetune` or `fastbert distill` keeps), else its latest checkpoint (`fastbert pretrain`'s, or a run stopped
    before its end); the first of them with a ``marker`` file, None when neither has one (no run)."""
    directory = Path(directory)
    for found in (directory / "model", latest_checkpoint(directory)):
        if found is not None and (found / marker).is_file():
            return found
    return None


def run_model_hint(directory: str | os.PathLike, marker: str = "config.json") -> str:
    """What an option that wants a checkpoint directory adds to its error when given a run's output directory
    instead: '; did you mean DIR/model?' (`run_model`'s choice), or '' when ``directory`` is no run."""
    found = run_model(directory, marker) if os.path.isdir(directory) else None
    return f"; did you mean {found}?" if found is not None else ""


def resolve_model_option(option: str, path: str | None) -> tuple[str, FastBertConfig]:
    """`fastbert.common.resolve.resolve_model` of a command-line option (None: the default model); its UserError
    names ``option`` and points at the model of a run's output directory (`run_model_hint`)."""
    try:
        return resolve_model(path)
    except UserError as err:
        if path is None:  # the default model's own error (a package to install)
            raise
        raise UserError(f"{option}: {err}{run_model_hint(path)}") from err
