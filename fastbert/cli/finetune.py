"""``fastbert finetune``: fine-tune a classifier on a small real labelled set built offline from CPython's own text
(`fastbert.training.finetune`): held-out accuracy against the majority-class baseline, the model saved."""

from __future__ import annotations

import argparse

from fastbert.cli import shared
from fastbert.common.resolve import UserError
from fastbert.training import finetune as finetuning
from fastbert.training.loop import TrainingError


def settings_of(args: argparse.Namespace) -> finetuning.FinetuneSettings:
    """The run's settings from the parsed options."""
    return finetuning.FinetuneSettings(
        task=args.task, output_dir=args.output_dir, model_dir=args.model, epochs=args.epochs,
        max_steps=args.max_steps, batch_size=args.batch_size, learning_rate=args.learning_rate,
        warmup_ratio=args.warmup_ratio, max_length=args.max_length, train_limit=args.train_limit,
        eval_limit=args.eval_limit, seed=args.seed, device=args.device, backend=args.backend,
        optimize=not args.no_optimize, resume=args.resume, save_every=args.save_every, log_every=args.log_every,
        teacher=args.teacher, alpha_soft=args.alpha_soft, temperature=args.temperature,
        alpha_hidden=args.alpha_hidden, resample_pairs=args.resample_pairs)


def run(args: argparse.Namespace) -> int:
    """Fine-tune (see `fastbert.training.finetune`); settings or a run that cannot start are a UserError."""
    shared.need_transformers("finetune")
    shared.set_threads(args.threads)
    try:
        finetuning.finetune(settings_of(args))
    except (ValueError, TrainingError) as err:
        raise UserError(str(err)) from err
    return 0
