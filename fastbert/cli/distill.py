"""``fastbert distill``: train a smaller student from a teacher (`fastbert.training.distill`): DistilBERT's triple loss
from a masked-LM teacher (``--objective mlm``), or a shallower sentence-embedding model from a sentence-transformers
teacher (``--objective embedding``); checkpoints (resumable), metrics.jsonl, loss_curve.png, the student in DIR/model.
Its options: `fastbert.cli.parsers.distill`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastbert.training.distill import DistillSettings


def teacher_layers(text: str | None) -> tuple[int, ...] | None:
    """--teacher-layers '0,2,5' as (0, 2, 5); UserError for anything else."""
    from fastbert.common.resolve import UserError

    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise UserError(f"--teacher-layers must be comma-separated layer numbers, got {text!r}") from err


def settings_of(args: argparse.Namespace) -> DistillSettings:
    """The run's `fastbert.training.distill.DistillSettings` from the parsed options (each option is the field of
    the same name; --no-optimize is ``optimize``, --teacher-layers a tuple)."""
    from fastbert.training import distill as distillation

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(distillation.DistillSettings)
             if hasattr(args, f.name)}
    return distillation.DistillSettings(**{**given, "files": tuple(args.files), "optimize": not args.no_optimize,
                                           "teacher_layers": teacher_layers(args.teacher_layers)})


def run(args: argparse.Namespace) -> int:
    """Distil (see `fastbert.training.distill`); a run that cannot start or continue is a UserError."""
    from fastbert.cli import shared
    from fastbert.common.resolve import UserError

    shared.need_transformers("distill")
    from fastbert.training import distill as distillation
    from fastbert.training.loop import TrainingError

    settings = settings_of(args)
    try:
        distillation.distill(settings)
    except TrainingError as err:
        raise UserError(str(err)) from err
    return 0
