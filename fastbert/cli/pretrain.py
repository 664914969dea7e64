"""``fastbert pretrain``: pretrain a small BERT / RoBERTa / ALBERT from scratch on CPython's documentation or text
files (`fastbert.training.pretrain`): checkpoints, metrics.jsonl, loss_curve.png."""

from __future__ import annotations

import argparse
import dataclasses

from fastbert.cli import shared
from fastbert.common.resolve import UserError
from fastbert.training import pretrain as pretraining
from fastbert.training.loop import TrainingError


def settings_of(args: argparse.Namespace) -> pretraining.PretrainSettings:
    """The run's settings from the parsed options (each option is the settings field of the same name)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(pretraining.PretrainSettings)
             if hasattr(args, f.name)}
    return pretraining.PretrainSettings(**{**given, "files": tuple(args.files), "optimize": not args.no_optimize})


def run(args: argparse.Namespace) -> int:
    """Pretrain (see `fastbert.training.pretrain`); a run that cannot start or continue is a UserError."""
    shared.need_transformers("pretrain")
    try:
        pretraining.pretrain(settings_of(args))
    except TrainingError as err:
        raise UserError(str(err)) from err
    return 0
