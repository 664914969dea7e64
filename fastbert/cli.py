"""The ``fastbert`` command.

    fastbert                      demo: the embedded all-MiniLM-L6-v2 on real sentences, transformers vs fastbert
    fastbert demo [options]       the same, with options
    fastbert check [options]      fastbert against transformers on a checkpoint: errors, PASS/FAIL (exit 1 on FAIL)
    fastbert embed TEXT...        sentence embeddings (mean pooling, normalised) as JSON lines, or --similarity
    fastbert bench [options]      end-to-end benchmark against HF eager/SDPA, torch.compile, ONNX Runtime

Errors the user can fix (a missing path, an unsupported model family, a device that is not there, a bad dtype)
print one line, ``fastbert: error: ...``, on stderr and exit non-zero. transformers, onnxruntime and matplotlib
are imported inside the commands, so ``fastbert --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from fastbert import __version__, numerics
from fastbert.backends import BACKENDS, BackendUnavailable
from fastbert.bench import e2e, peers, recording, report, timing
from fastbert.bench.workloads import Workload
from fastbert.loading import CheckpointError
from fastbert.resolve import UserError, model_name, resolve_device, resolve_dtype, resolve_model
from fastbert.text import SENTENCES, TextEncoder, mean_pool


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line on stderr."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"fastbert: error: {message}\n")
        sys.exit(2)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --backend: shared by every subcommand."""
    parser.add_argument("--model", metavar="PATH", default=None,
                        help="HF checkpoint directory (config.json + weights); default: the embedded all-MiniLM-L6-v2")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N]; default: cuda if present, else cpu")
    parser.add_argument("--dtype", default=None, help="float32, float16 or bfloat16; default: float32 on CPU, "
                        "float16 on CUDA (check and embed: float32)")
    parser.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                        help="fastbert backend (default auto: cpp then eager on CPU, triton then eager on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand (no heavy imports: `fastbert --help` stays fast)."""
    parser = _Parser(prog="fastbert", description="Fast BERT-family encoders: demo, check, embed, bench. With no "
                     "command, runs the demo on the embedded all-MiniLM-L6-v2.")
    parser.add_argument("--version", action="version", version=f"fastbert {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{demo,check,embed,bench}")

    demo = commands.add_parser("demo", help="transformers vs fastbert on 16 real sentences (the default command)")
    _add_model_options(demo)
    demo.add_argument("--repeats", type=int, default=10, help="timed calls per implementation (median reported)")
    demo.add_argument("--no-optimize", action="store_true", help="leave out fastbert.optimize(HF model)")
    demo.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")

    check = commands.add_parser("check", help="compare fastbert with transformers on a checkpoint; PASS/FAIL")
    _add_model_options(check)

    embed = commands.add_parser("embed", help="sentence embeddings (mean pooling, L2-normalised)")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="sentences; none: one per line from stdin")
    _add_model_options(embed)
    embed.add_argument("--similarity", action="store_true", help="print the cosine similarity matrix instead")

    bench = commands.add_parser("bench", help="end-to-end benchmark against transformers, torch.compile, ONNX "
                                "Runtime")
    _add_model_options(bench)
    bench.add_argument("--batch", type=int, nargs="+", default=None, metavar="N",
                       help="batch sizes (default: 1 8 on CPU, 1 32 128 on CUDA)")
    bench.add_argument("--seq", type=int, nargs="+", default=None, metavar="N",
                       help="sequence lengths (default: 128 on CPU, 128 512 on CUDA)")
    bench.add_argument("--varlen", action=argparse.BooleanOptionalAction, default=True,
                       help="also variable-length batches, lengths uniform in [seq/8, seq] (default: on)")
    bench.add_argument("--peers", nargs="+", default=None, metavar="PEER",
                       help=f"implementations to compare with, from {', '.join(peers.PEERS)} (default: "
                       f"{' '.join(peers.DEFAULT_PEERS)}; --quick: hf-eager hf-sdpa)")
    bench.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 10; quick 2)")
    bench.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 2; quick 1)")
    bench.add_argument("--quick", action="store_true", help="tiny shapes and few repeats: a smoke run")
    bench.add_argument("--peak-tflops", type=float, default=None,
                       help="peak TFLOP/s for the roofline column (default: measured with one large matmul)")
    bench.add_argument("--threads", type=int, default=None,
                       help=f"intra-op threads for torch and ONNX Runtime (default: torch's, here "
                       f"{torch.get_num_threads()})")
    bench.add_argument("--out", default=None, metavar="DIR",
                       help="where to write e2e.json, e2e.md and the PNGs (default: a new folder "
                       "bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS> under the current directory; the "
                       "committed benchmarks/results/ change only when --out names them)")
    bench.add_argument("--note", default=None, help="free text stored in the JSON and shown in the Markdown")
    bench.add_argument("--no-write", action="store_true", help="print the table only")
    return parser


# ------------------------------------------------------------------------------------------------- helpers
def _model_line(model_dir: str, config, device: torch.device, dtype: torch.dtype) -> str:
    return (f"{model_name(model_dir)} ({config.family}, {config.num_hidden_layers} layers, "
            f"H={config.hidden_size}) on {device}, {str(dtype).replace('torch.', '')}")


def _backend_lines(seen) -> list[str]:
    used = recording.backends_used(seen)
    lines = ["fastbert ops ran on: " + ", ".join(f"{op}={backend}" for op, backend in used.items())]
    lines.append("backends: " + "; ".join(f"{k}: {v}" for k, v in recording.backend_availability().items()))
    return lines


def _need_transformers(command: str) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise UserError(f"'fastbert {command}' compares with transformers, which is not installed "
                        "(pip install 'fastbert[hf]')") from err


def _load_fastbert(model_dir: str, dtype: torch.dtype, device: torch.device, backend: str):
    try:
        return peers.load_fastbert(model_dir, dtype, device, backend)
    except CheckpointError as err:
        raise UserError(str(err)) from err


def _forward(model, batch: dict, seen=None):
    with torch.inference_mode():
        if seen is None:
            return model(**batch)
        with recording.record_backends() as recorded:
            out = model(**batch)
        for op, counts in recorded.items():
            seen.setdefault(op, type(counts)()).update(counts)
        return out


# ---------------------------------------------------------------------------------------------------- demo
def cmd_demo(args: argparse.Namespace) -> int:
    """transformers (eager) vs fastbert.from_pretrained (vs fastbert.optimize) on SENTENCES: agreement and speed."""
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    _need_transformers("demo")
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    batch = TextEncoder(model_dir, config)(SENTENCES, device)
    mask = batch["attention_mask"].bool()
    print(f"fastbert demo: {_model_line(model_dir, config, device, dtype)}")
    print(f"{len(SENTENCES)} English sentences, padded to {batch['input_ids'].shape[1]} tokens "
          f"({int(mask.sum())} real); median of {args.repeats} interleaved calls after 2 warm-up calls; "
          f"{torch.get_num_threads()} torch threads\n")

    hf = peers.load_hf_model(model_dir, "eager", dtype, device)
    implementations = [("transformers AutoModel (eager)", hf)]
    seen: dict = {}
    fast = _load_fastbert(model_dir, dtype, device, args.backend)
    implementations.append((f"fastbert.from_pretrained (backend={args.backend})", fast))
    if not args.no_optimize:
        import fastbert

        optimized = fastbert.optimize(peers.load_hf_model(model_dir, "eager", dtype, device), backend=args.backend)
        implementations.append(("fastbert.optimize(transformers model)", optimized))

    hidden_states, times = [], [[] for _ in implementations]
    for _, model in implementations:
        out = _forward(model, batch, seen if model is not hf else None)
        hidden_states.append(out.last_hidden_state.float())
        with torch.inference_mode():
            timing.time_ms(lambda m=model: m(**batch), repeats=0, warmup=2, device=device)
    with torch.inference_mode():
        for _ in range(args.repeats):  # interleaved, so a change of load on the machine hits all alike
            for index, (_, model) in enumerate(implementations):
                times[index] += timing.time_ms(lambda m=model: m(**batch), repeats=1, warmup=0, device=device)
    medians = [timing.percentile(t, 50) for t in times]
    reference = hidden_states[0]
    reference_embeddings = mean_pool(reference, batch["attention_mask"])
    rows = [[implementations[0][0], f"{medians[0]:.2f}", "1.00x", "(reference)", "(reference)"]]
    for (name, _), hidden, median in zip(implementations[1:], hidden_states[1:], medians[1:], strict=True):
        error = float((hidden - reference)[mask].abs().max())
        cosine = float((mean_pool(hidden, batch["attention_mask"]) * reference_embeddings).sum(dim=1).min())
        rows.append([name, f"{median:.2f}", f"{medians[0] / median:.2f}x", f"{error:.2e}", f"{cosine:.6f}"])
    print(report.format_table(("implementation", "median ms", "speed-up", "max abs err (real tokens)",
                               "min cosine of sentence embeddings"), rows))
    print()
    for line in _backend_lines(seen):
        print(line)
    print("\nspeed-up = transformers' median / this median, same run; errors against transformers in the same "
          "dtype; sentence embeddings: mean pooling + L2 normalisation (sentence-transformers').")
    return 0


# --------------------------------------------------------------------------------------------------- check
def check_rule(dtype: torch.dtype, fast_err: float, hf_err: float | None, ref_scale: float) -> tuple[bool, str]:
    """PASS/FAIL of one output by `fastbert.numerics`' rule, the one the kernel tests apply, with transformers as
    plain PyTorch and its float32 output as the reference. float32: max|fastbert - HF| / max|HF| <= 1e-4 (a whole
    model); float16/bfloat16: err(fastbert) <= 2 x err(HF in the same dtype) + HALF_ATOL_REL[dtype] x max|HF|."""
    return numerics.judge(dtype, fast_err, hf_err, ref_scale, fp32_rel=numerics.FP32_MODEL_REL, plain_name="HF")


def cmd_check(args: argparse.Namespace) -> int:
    """fastbert vs transformers on one checkpoint and a batch of real sentences; exit 1 on FAIL."""
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or "float32", device)
    _need_transformers("check")
    try:
        batch = TextEncoder(model_dir, config)(SENTENCES, device)
        source = f"{len(SENTENCES)} English sentences"
    except UserError:  # a checkpoint without a tokenizer is still checked, on random token ids
        seqlen = min(32, config.max_position_embeddings - (config.position_offset or 0))
        lengths = torch.linspace(1, seqlen, len(SENTENCES)).round().long().tolist()
        batch = Workload("check", len(lengths), seqlen, lengths, True).inputs(config, device)
        source = f"{len(lengths)} random token sequences (no tokenizer in the checkpoint)"
    mask = batch["attention_mask"].bool()
    print(f"fastbert check: {_model_line(model_dir, config, device, dtype)}")
    print(f"{source} padded to {batch['input_ids'].shape[1]} tokens ({int(mask.sum())} real); reference: "
          "transformers AutoModel (eager) in float32; hidden states compared at real tokens only\n")

    def outputs(model, record: bool = False) -> dict[str, torch.Tensor]:
        out = _forward(model, batch, seen if record else None)
        found = {"last_hidden_state": out.last_hidden_state.float()}
        pooled = getattr(out, "pooler_output", None)
        if pooled is not None:
            found["pooler_output"] = pooled.float()
        return found

    seen: dict = {}
    reference = outputs(peers.load_hf_model(model_dir, "eager", torch.float32, device))
    hf_same = outputs(peers.load_hf_model(model_dir, "eager", dtype, device)) if dtype != torch.float32 else None
    ours = outputs(_load_fastbert(model_dir, dtype, device, args.backend), record=True)

    rows, passed = [], True
    for name, ref in reference.items():
        if name not in ours:
            rows.append([name, "-", "-", "-", "-", "FAIL: fastbert gives no " + name])
            passed = False
            continue
        select = (lambda t: t[mask]) if name == "last_hidden_state" else (lambda t: t)
        diff = (select(ours[name]) - select(ref)).abs()
        hf_err = float((select(hf_same[name]) - select(ref)).abs().max()) if hf_same is not None else None
        ok, why = check_rule(dtype, float(diff.max()), hf_err, float(select(ref).abs().max()))
        passed &= ok
        rows.append([name, f"{float(diff.max()):.2e}", f"{float(diff.mean()):.2e}",
                     "-" if hf_err is None else f"{hf_err:.2e}", why, "PASS" if ok else "FAIL"])
    headers = ("output", "max abs err", "mean abs err", f"HF {str(dtype)[6:]} err", "rule", "result")
    print(report.format_table(headers, rows))
    ref_emb = mean_pool(reference["last_hidden_state"], batch["attention_mask"])
    our_emb = mean_pool(ours["last_hidden_state"], batch["attention_mask"])
    print(f"\nsentence embeddings (mean pooling, normalised): min cosine {float((ref_emb * our_emb).sum(1).min()):.6f}")
    if "pooler_output" in reference and "pooler_output" in ours:
        cosine = torch.nn.functional.cosine_similarity(reference["pooler_output"], ours["pooler_output"], dim=1)
        print(f"pooler_output: min cosine {float(cosine.min()):.6f}")
    for line in _backend_lines(seen):
        print(line)
    print("\nPASS" if passed else "\nFAIL")
    return 0 if passed else 1


# --------------------------------------------------------------------------------------------------- embed
def cmd_embed(args: argparse.Namespace) -> int:
    """Sentence embeddings with fastbert (no transformers needed): JSON lines or a cosine similarity matrix."""
    texts = list(args.texts) or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise UserError("embed needs at least one TEXT (or lines on stdin)")
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or "float32", device)
    model = _load_fastbert(model_dir, dtype, device, args.backend)
    batch = TextEncoder(model_dir, config)(texts, device)
    embeddings = mean_pool(_forward(model, batch).last_hidden_state, batch["attention_mask"]).cpu()
    if args.similarity:
        matrix = embeddings @ embeddings.T
        labels = [f"[{i}] " + (t if len(t) <= 48 else t[:45] + "...") for i, t in enumerate(texts)]
        rows = [[label] + [f"{float(v):.3f}" for v in row] for label, row in zip(labels, matrix, strict=True)]
        print(report.format_table(["text"] + [f"[{i}]" for i in range(len(texts))], rows))
        return 0
    for text, vector in zip(texts, embeddings.tolist(), strict=True):
        print(json.dumps({"text": text, "embedding": [round(v, 7) for v in vector]}))
    return 0


# --------------------------------------------------------------------------------------------------- bench
def cmd_bench(args: argparse.Namespace) -> int:
    """End-to-end benchmark; prints the table and writes JSON/Markdown/PNGs (fastbert.bench.e2e, .report)."""
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
    settings = e2e.BenchSettings(
        model_dir=model_dir, device=device, dtype=dtype, batches=args.batch or batches, seqs=args.seq or seqs,
        varlen=args.varlen, peers=args.peers if args.peers is not None else peer_names,
        repeats=args.repeats or repeats, warmup=warmup if args.warmup is None else args.warmup, quick=args.quick,
        backend=args.backend, peak_flops=None if args.peak_tflops is None else args.peak_tflops * 1e12,
        threads=args.threads, note=args.note)
    results = e2e.run_e2e(settings, progress=True)
    for line in report.summary_lines(results):
        print(line)
    print()
    print(report.format_table(report.TABLE_HEADERS, report.result_rows(results)))
    print("\nfastbert speed-up = that implementation's p50 / fastbert's p50 in this run (> 1: fastbert faster); "
          "% roofline = useful FLOP/s / peak FLOP/s")
    if not args.no_write:
        out = Path(args.out) if args.out else report.default_out_dir(device)
        paths = report.write_results(results, out)
        print(f"results written to {out}/: " + ", ".join(p.name for p in paths))
    return 0


COMMANDS = {"demo": cmd_demo, "check": cmd_check, "embed": cmd_embed, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fastbert`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["demo"])
    try:
        return COMMANDS[args.command](args)
    except (UserError, CheckpointError, BackendUnavailable) as err:
        sys.stderr.write(f"fastbert: error: {err}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("fastbert: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
