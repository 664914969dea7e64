"""The ``fastbert`` command.

    fastbert                      demo: the embedded all-MiniLM-L6-v2 on real sentences, transformers vs fastbert
    fastbert demo [options]       the same, with options
    fastbert check [options]      fastbert against transformers on a checkpoint: errors, PASS/FAIL (exit 1 on FAIL)
    fastbert embed [TEXT...]      embeddings of texts or a corpus (streaming, resumable, --ray), or --similarity
    fastbert bench [options]      end-to-end benchmark against HF eager/SDPA, torch.compile, ONNX Runtime
    fastbert finetune --task T -o DIR   fine-tune a classifier on a real labelled set built offline (held-out accuracy)
    fastbert pretrain -o DIR [FILE...]  pretrain a small BERT/RoBERTa/ALBERT from scratch (CPython's docs by default)

Errors the user can fix (a missing path, an unsupported model family, a device that is not there, a bad dtype)
print one line, ``fastbert: error: ...``, on stderr and exit non-zero. transformers, onnxruntime and matplotlib
are imported inside the commands, so ``fastbert --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fastbert import __version__, numerics
from fastbert.backends import BACKENDS, BackendUnavailable
from fastbert.bench import e2e, peers, recording, report, timing
from fastbert.bench.workloads import Workload
from fastbert.common.resolve import UserError, model_name, resolve_device, resolve_dtype, resolve_model
from fastbert.common.text import SENTENCES, TextEncoder, mean_pool
from fastbert.embedding import embedder as embedding
from fastbert.embedding.embedder import FORMATS, POOLINGS
from fastbert.loading import CheckpointError


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
    commands = parser.add_subparsers(dest="command", metavar="{demo,check,embed,bench,finetune,pretrain}")

    demo = commands.add_parser("demo", help="transformers vs fastbert on 16 real sentences (the default command)")
    _add_model_options(demo)
    demo.add_argument("--repeats", type=int, default=10, help="timed calls per implementation (median reported)")
    demo.add_argument("--no-optimize", action="store_true", help="leave out fastbert.optimize(HF model)")
    demo.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")

    check = commands.add_parser("check", help="compare fastbert with transformers on a checkpoint; PASS/FAIL")
    _add_model_options(check)

    embed = commands.add_parser(
        "embed", help="embed texts or a whole corpus: streaming, one output row per input row, resumable",
        description="Embeddings of TEXT arguments, or of every row of --input (a text file with one text per line, "
        "JSONL, or stdin), written as they are computed, in input order: a blank text gives a null row, never a "
        "skipped one. Texts are sorted by length within a window of rows and batched by a token budget on the "
        "padding-free encoder. A progress line and a summary go to stderr.")
    embed.add_argument("texts", nargs="*", metavar="TEXT", help="texts to embed (none: read --input, default stdin)")
    _add_model_options(embed)
    embed.add_argument("-i", "--input", metavar="FILE", default=None,
                       help="one text per line, or JSONL with --field; '-' = stdin (the default without TEXT)")
    embed.add_argument("--input-format", choices=("auto", "text", "jsonl"), default="auto",
                       help="auto (default): jsonl for *.jsonl / *.ndjson, else text")
    embed.add_argument("--field", default="text", help="JSONL: the field holding the text (default: text)")
    embed.add_argument("--id-field", default=None,
                       help="JSONL: the field written as each row's id (default: the line number)")
    embed.add_argument("-o", "--output", metavar="FILE", default=None,
                       help="one output file, written as rows are done; format from the extension (.jsonl, .npy, "
                       ".parquet) or --format (default: JSONL on stdout)")
    embed.add_argument("--output-dir", metavar="DIR", default=None,
                       help="write shards (one per window) and manifest.json, each atomically: resumable with "
                       "--resume")
    embed.add_argument("--format", choices=FORMATS, default=None,
                       help="output format (default: from --output's extension; jsonl otherwise)")
    embed.add_argument("--output-dtype", choices=("float32", "float16"), default="float32",
                       help="npy/parquet value type (default float32)")
    embed.add_argument("--resume", action="store_true",
                       help="continue the interrupted run in --output-dir (same input and settings) after its last "
                       "complete shard")
    embed.add_argument("--pooling", choices=POOLINGS, default=None,
                       help="mean over real tokens or cls (default: what the checkpoint's sentence-transformers "
                       "1_Pooling declares, else mean)")
    embed.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="L2-normalise each embedding (default: as the checkpoint's sentence-transformers "
                       "modules declare, else on)")
    embed.add_argument("--max-length", type=int, default=None,
                       help="tokens per text, longer texts truncated and counted (default: the checkpoint's "
                       "sentence-transformers max_seq_length, else the model's limit)")
    embed.add_argument("--max-batch-tokens", type=int, default=None,
                       help="token budget per batch: texts x longest text of the batch (default 4096 on CPU, 16384 on "
                       "CUDA, at least --max-length)")
    embed.add_argument("--batch-size", type=int, default=None, help="at most this many texts per batch")
    embed.add_argument("--window-rows", type=int, default=None,
                       help="rows read, sorted and written together; one shard each with --output-dir (default "
                       "2048; with --ray 16384)")
    embed.add_argument("--on-blank", choices=("null", "error"), default="null",
                       help="a blank text: a null row (default) or stop with its line number")
    embed.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress on stderr (default: on when stderr is a terminal)")
    embed.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    embed.add_argument("--ray", action="store_true",
                       help="embed on a Ray cluster (fastbert.embedding.ray.RayEmbedder actors; pip install "
                            "'fastbert[ray]')")
    embed.add_argument("--ray-address", default=None,
                       help="the cluster to join, e.g. ray://head:10001 or auto (default: RAY_ADDRESS, else a new "
                       "local cluster)")
    embed.add_argument("--ray-actors", type=int, default=1, help="model replicas on Ray (default 1)")
    embed.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs per Ray actor (default 1)")
    embed.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs per Ray actor (default 0)")
    embed.add_argument("--similarity", action="store_true",
                       help="print the cosine similarity matrix of the TEXTs instead")

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

    finetune = commands.add_parser(
        "finetune", help="fine-tune a sequence/token classifier on a small real labelled set built offline",
        description="Fine-tunes a checkpoint (default all-MiniLM-L6-v2) on a labelled set built from CPython's own "
        "text (fastbert.training.finetune), through fastbert.optimize and fastbert.training.loop; reports held-out "
        "accuracy "
        "against the majority-class baseline and saves the model in HF format.")
    from fastbert.training import finetune as finetuning

    finetuning.add_arguments(finetune)

    from fastbert.training import pretrain as pretraining

    pretraining.add_parser(commands)
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
def _embed_output_format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return args.format
    if args.output is not None:
        suffix = Path(args.output).suffix.lower().lstrip(".")
        if suffix in FORMATS:
            return suffix
        if suffix in ("json", "ndjson"):
            return "jsonl"
        raise UserError(f"cannot tell the format of --output {args.output}: give --format or use .jsonl, .npy or "
                        ".parquet")
    return "jsonl"


def _embed_rows(args: argparse.Namespace):
    """The input rows (and a byte counter and size for progress)."""
    if args.texts:
        if args.input is not None:
            raise UserError("give TEXT arguments or --input, not both")
        rows = (embedding.Row(i, i, t if t.strip() else None) for i, t in enumerate(args.texts, start=1))
        return rows, None, None, None
    path = args.input or "-"
    input_format = args.input_format
    if input_format == "auto":
        input_format = "jsonl" if path.lower().endswith((".jsonl", ".ndjson")) else "text"
    if args.id_field is not None and input_format != "jsonl":
        raise UserError("--id-field needs JSONL input")
    counter, size, name = embedding.open_input(path)
    rows = embedding.read_rows(counter, input_format, args.field, args.id_field, name)
    return rows, counter, size, counter.stream


def _similarity(args: argparse.Namespace, embedder) -> int:
    texts = list(args.texts)
    if not texts:
        raise UserError("--similarity needs TEXT arguments")
    if any(not t.strip() for t in texts):
        raise UserError("--similarity: a TEXT is blank")
    vectors, _ = embedder.embed([t if t.strip() else None for t in texts])
    matrix = torch.from_numpy(vectors) @ torch.from_numpy(vectors).T
    labels = [f"[{i}] " + (t if len(t) <= 48 else t[:45] + "...") for i, t in enumerate(texts)]
    rows = [[label] + [f"{float(v):.3f}" for v in row] for label, row in zip(labels, matrix, strict=True)]
    print(report.format_table(["text"] + [f"[{i}]" for i in range(len(texts))], rows))
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """Embed TEXT arguments or a corpus (fastbert.embedding.embedder): one output row per input row, in input order."""
    started = time.perf_counter()
    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.output is not None and args.output_dir is not None:
        raise UserError("give --output or --output-dir, not both")
    if args.resume and args.output_dir is None:
        raise UserError("--resume continues an --output-dir run; give --output-dir")
    output_format = _embed_output_format(args)
    options = dict(model_dir=args.model, device=args.device, dtype=args.dtype, backend=args.backend,
                   pooling=args.pooling, normalize=args.normalize, max_length=args.max_length,
                   max_batch_tokens=args.max_batch_tokens, max_batch_size=args.batch_size)
    if args.ray:
        from fastbert.embedding.ray import RayClusterEmbedder

        embedder = RayClusterEmbedder(options, actors=args.ray_actors, address=args.ray_address,
                                      cpus_per_actor=args.ray_cpus, gpus_per_actor=args.ray_gpus)
        window_rows = args.window_rows or 16384
    else:
        embedder = embedding.Embedder(**options)
        window_rows = args.window_rows or 2048
    if args.similarity:
        return _similarity(args, embedder)
    rows, counter, size, stream = _embed_rows(args)
    settings = {**embedder.settings(), "window_rows": window_rows, "input": args.input or "-",
                "input_format": args.input_format, "field": args.field, "id_field": args.id_field}
    string_ids = args.id_field is not None
    dtype = np.float16 if args.output_dtype == "float16" else np.float32
    initial = None
    if args.output_dir is not None:
        output = embedding.ShardedOutput(args.output_dir, output_format, embedder.dimension, dtype, settings,
                                         resume=args.resume, string_ids=string_ids)
        if args.resume:
            if output.manifest["complete"]:
                sys.stderr.write(f"fastbert embed: {args.output_dir} is complete ({output.rows_done:,} rows); "
                                 "nothing to resume\n")
                return 0
            embedding.skip_rows(rows, output.rows_done)
            initial = output.stats()
            sys.stderr.write(f"fastbert embed: resuming after row {output.rows_done:,} "
                             f"({len(output.manifest['shards'])} shards done)\n")
    else:
        output = embedding.FileOutput(args.output, output_format, embedder.dimension, dtype, string_ids)
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = embedding.Progress(size, show, initial=initial)
    error, stats = None, None
    try:
        stats = embedding.run(embedder, rows, output, window_rows, progress,
                              bytes_read=(lambda: counter.bytes_read) if counter is not None else (lambda: 0),
                              blank=args.on_blank, initial=initial)
    except embedding.InputError as err:
        error = err
    finally:
        if stream is not None and stream is not sys.stdin.buffer:
            stream.close()
        output.close(stats)  # stats None: the run stopped early (a sharded run stays resumable)
    if error is not None:
        raise UserError(f"{error} ({output.rows_done:,} rows before it were written to {output.describe()} and are "
                        "valid)")
    elapsed = time.perf_counter() - started
    if stats.truncated:
        lines = ", ".join(str(n) for n in stats.truncated_lines) + (", ..." if stats.truncated > 10 else "")
        limit = embedder.settings()["max_length"]
        sys.stderr.write(f"fastbert: warning: {stats.truncated:,} texts were longer than {limit} tokens and were "
                         f"truncated (lines {lines}); --max-length sets the limit\n")
    before = initial or embedding.EmbedStats()
    this_run = f" ({stats.rows - before.rows:,} this run)" if initial is not None else ""
    sys.stderr.write(f"fastbert embed: {stats.rows:,} rows{this_run} -> {output.describe()}: {stats.embedded:,} "
                     f"embedded, {stats.null_rows:,} null (blank), {stats.truncated:,} truncated; {stats.tokens:,} "
                     f"tokens; this run {elapsed:.1f} s ({(stats.embedded - before.embedded) / elapsed:,.0f} "
                     f"texts/s, {(stats.tokens - before.tokens) / elapsed:,.0f} tokens/s, model load included)\n")
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


def cmd_finetune(args: argparse.Namespace) -> int:
    """Fine-tune a classifier (fastbert.training.finetune): held-out accuracy vs the majority baseline, the model
    saved."""
    from fastbert.training import finetune as finetuning

    _need_transformers("finetune")
    return finetuning.run_cli(args)


def cmd_pretrain(args: argparse.Namespace) -> int:
    """Pretrain a small model from scratch (fastbert.training.pretrain): checkpoints, metrics.jsonl, loss_curve.png."""
    from fastbert.training import pretrain as pretraining

    _need_transformers("pretrain")
    return pretraining.run_pretraining(args)


COMMANDS = {"demo": cmd_demo, "check": cmd_check, "embed": cmd_embed, "bench": cmd_bench, "finetune": cmd_finetune,
            "pretrain": cmd_pretrain}


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
    except BrokenPipeError:  # the reader of stdout went away (`fastbert embed ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141

