"""``fastbert tune``: fill the tuning cache ahead of time. Runs representative forwards (and training steps with
--training) of a model at the given shapes with measuring on, so that ``auto`` has timed every op and shape class
those shapes reach (`fastbert.backends.tuning`), and on CPU whole inference forwards (the per-op table against each
backend alone: `fastbert.backends.decide_model`); prints each choice with its times and where the cache lives.
``--clear`` empties the cache instead."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fastbert import backends
from fastbert.backends import tuning
from fastbert.bench import report
from fastbert.bench.workloads import make_workloads
from fastbert.cli import shared
from fastbert.common.resolve import UserError, resolve_device, resolve_dtype, resolve_model
from fastbert.files import TMP_PREFIX

# What timing whole forwards may take per shape class here (a first use outside tune: `backends.FIRST_USE_BUDGET_S`)
MODEL_BUDGET_S = 20.0


def run(args: argparse.Namespace) -> int:
    """Measure (or --clear), then print the choices, their times and the cache file."""
    if args.clear:
        removed = tuning.clear()
        print(f"removed {len(removed)} tuning file(s) from {tuning.tuning_dir()}")
        return 0
    if backends.requested_backend("auto") != "auto":
        raise UserError(f"FASTBERT_BACKEND={backends.requested_backend('auto')} forces a backend: nothing to measure")
    check_cache_writable(tuning.tuning_dir())
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    shared.set_threads(args.threads)
    backends.set_measuring(True)  # the command's purpose, even where FASTBERT_TUNE=0 turns it off for programs
    dtype = resolve_dtype(args.dtype, device)  # (after both: "auto" may time a GEMM, at these threads)
    cuda = device.type == "cuda"
    batches, seqs = args.batch or ([1, 32, 128] if cuda else [1, 8]), args.seq or ([128, 512] if cuda else [128])
    if any(v < 1 for v in batches + seqs):
        raise UserError("--batch and --seq values must be positive")
    longest = config.token_positions
    if max(seqs) > longest:
        raise UserError(f"--seq {max(seqs)} exceeds the model's {longest} positions")
    model = shared.load_fastbert(model_dir, dtype, device, "auto")
    print(f"fastbert tune: {shared.model_line(model_dir, config, device, dtype)}, {torch.get_num_threads()} "
          f"thread(s)")
    path, _ = tuning.key_file(device)
    cached = set(tuning.entries(device))
    for index, workload in enumerate(make_workloads(batches, seqs, args.varlen)):
        batch = workload.inputs(config, device, index)
        with torch.inference_mode(), backends.model_budget(MODEL_BUDGET_S):
            model.eval()(**batch)
        if args.training:
            model.train()(**batch).last_hidden_state.float().square().mean().backward()
            model.zero_grad(set_to_none=True)
        print(f"  {workload.name}: done", flush=True)
    rows = choice_rows(backends.model_decisions(model), cached)
    print()
    print(report.format_table(("op", "shape class", "backend", "times (fastest round)", "source"), rows))
    whole = whole_model_rows(backends.whole_model_decisions(model), cached)
    if whole:
        print()
        print(report.format_table(("whole model", "runs", "times (fastest round)", "source"), whole))
    print(f"\ncache: {path} ({len(tuning.entries(device))} shape classes; FASTBERT_CACHE_DIR moves it, "
          "`fastbert tune --clear` empties it)")
    return 0


def check_cache_writable(directory: Path) -> None:
    """UserError unless a file can be written in the tuning cache (created if absent): filling it is the command's
    purpose, and the library only warns when it cannot."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=TMP_PREFIX):
            pass
    except OSError as err:
        raise UserError(f"the tuning cache {directory} cannot be written ({err.strerror}); FASTBERT_CACHE_DIR "
                        "moves it") from None


def whole_model_rows(decisions: list, cached: set[str]) -> list[list[str]]:
    """One row per whole-model class (CPU inference): what runs it (the per-op table or one backend alone), the
    times behind it, and whether this run measured it."""
    rows = []
    for decision in decisions:
        times = ", ".join(f"{b} {ms:.3g} ms" for b, ms in sorted((decision.times_ms or {}).items(),
                                                                 key=lambda i: i[1])) or decision.how
        source = ("cache" if decision.shape_class in cached else "measured now") if decision.times_ms else "-"
        rows.append([decision.shape_class.removeprefix("model "), decision.backend, times, source])
    return rows


def choice_rows(decisions: list, cached: set[str]) -> list[list[str]]:
    """One row per op and shape class: the choice, the times behind it, and whether this run measured it."""
    rows, seen = [], set()
    for op, decision in decisions:
        key = (op, decision.shape_class)
        if key in seen:
            continue
        seen.add(key)
        if decision.times_ms:
            times = ", ".join(f"{b} {ms:.3g} ms" for b, ms in sorted(decision.times_ms.items(), key=lambda i: i[1]))
            source = "cache" if decision.shape_class in cached else "measured now"
            shape = decision.shape_class.removeprefix(op.split()[0] + " ")
        else:
            times, source, shape = "-", decision.how, "-"
        rows.append([op, shape, decision.backend, times, source])
    return rows
