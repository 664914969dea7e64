"""``fastbert bench``: the end-to-end benchmark against transformers (eager, SDPA), torch.compile and ONNX Runtime
(`fastbert.bench.e2e`); prints the table and writes JSON, Markdown and PNGs (`fastbert.bench.report`)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from fastbert.bench import e2e, peers, report
from fastbert.common.resolve import UserError, check_dir_creatable, resolve_device, resolve_dtype, resolve_model


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print its summary and table, and write the result files unless --no-write."""
    settings = bench_settings(args)
    out = None if args.no_write else Path(args.out) if args.out else report.default_out_dir(settings.device)
    if args.out and not args.no_write:  # checked before the run, whose results would be lost after it
        check_dir_creatable(out, "--out")
    results = e2e.run_e2e(settings, progress=True)
    for line in report.summary_lines(results):
        print(line)
    print()
    print(report.format_table(report.TABLE_HEADERS, report.result_rows(results)))
    print("\nfastbert speed-up = that implementation's p50 / fastbert's p50 in this run (> 1: fastbert faster); "
          "% roofline = useful FLOP/s / peak FLOP/s")
    if out is not None:
        paths = report.write_results(results, out)
        print(f"results written to {out}/: " + ", ".join(p.name for p in paths))
    failures = [entry for workload in results["workloads"] for name, entry in workload["results"].items()
                if name == "fastbert" and entry.get("status") != "ok"]
    if failures and len(failures) == len(results["workloads"]):  # nothing of fastbert's was measured
        raise UserError(f"fastbert failed on every workload ({failures[0]['status']}: {failures[0]['reason']})")
    return 0


def bench_settings(args: argparse.Namespace) -> e2e.BenchSettings:
    """The benchmark's settings: the options given, else the defaults of the device (or of --quick)."""
    model_dir, _ = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    cuda = device.type == "cuda"
    if args.quick:
        batches, seqs, repeats, warmup, peer_names = [2], [16], 2, 1, ["hf-eager", "hf-sdpa"]
    else:
        batches = [1, 32, 128] if cuda else [1, 8]
        seqs, repeats, warmup, peer_names = ([128, 512] if cuda else [128]), 10, 2, list(peers.DEFAULT_PEERS)
    for name, values in (("--batch", args.batch), ("--seq", args.seq)):
        if values is not None and any(v < 1 for v in values):
            raise UserError(f"{name} values must be positive")
    if (args.repeats is not None and args.repeats < 1) or (args.warmup is not None and args.warmup < 0):
        raise UserError("--repeats must be >= 1 and --warmup >= 0")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise UserError(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    return e2e.BenchSettings(
        model_dir=model_dir, device=device, dtype=dtype, batches=args.batch or batches, seqs=args.seq or seqs,
        varlen=args.varlen, peers=args.peers if args.peers is not None else peer_names,
        repeats=args.repeats or repeats, warmup=warmup if args.warmup is None else args.warmup, quick=args.quick,
        backend=args.backend, peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        threads=args.threads, note=args.note)
