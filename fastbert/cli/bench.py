"""``fastbert bench``: the end-to-end benchmark against transformers (eager, SDPA), torch.compile and ONNX Runtime
(`fastbert.bench.e2e`); prints the table and writes JSON, Markdown and PNGs (`fastbert.bench.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from fastbert.bench import e2e, peers, report
from fastbert.cli import shared
from fastbert.common.resolve import UserError, check_dir_creatable, resolve_device, resolve_dtype, resolve_model


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser("bench", help="end-to-end benchmark against transformers, torch.compile, ONNX "
                                   "Runtime")
    shared.add_model_options(parser)
    shared.add_workload_options(parser)
    parser.add_argument("--peers", nargs="+", default=None, metavar="PEER",
                        help=f"implementations to compare with, from {', '.join(peers.PEERS)} (default: "
                        f"{' '.join(peers.DEFAULT_PEERS)}; --quick: hf-eager hf-sdpa)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; quick 1)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: a smoke run")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak TFLOP/s for the roofline column (default: measured with one large matmul)")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"intra-op threads for torch and ONNX Runtime (default: torch's, here "
                        f"{torch.get_num_threads()})")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where to write e2e.json, e2e.md and the PNGs (default: a new folder "
                        "bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS> under the current directory; the "
                        "committed benchmarks/results/ change only when --out names them)")
    parser.add_argument("--note", default=None, help="free text stored in the JSON and shown in the Markdown")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    return parser


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
    return e2e.BenchSettings(
        model_dir=model_dir, device=device, dtype=dtype, batches=args.batch or batches, seqs=args.seq or seqs,
        varlen=args.varlen, peers=args.peers if args.peers is not None else peer_names,
        repeats=args.repeats or repeats, warmup=warmup if args.warmup is None else args.warmup, quick=args.quick,
        backend=args.backend, peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        threads=args.threads, note=args.note)
