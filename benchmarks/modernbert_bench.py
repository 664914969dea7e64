"""CPU benchmark of ModernBERT: fastbert against transformers' ModernBertModel (eager and sdpa attention; in bfloat16,
sdpa), one run, interleaved, at ModernBERT-base's shapes with random weights.

Model: vocabulary 50368, H 768, 12 heads, inner size 1152 (GeGLU: Wi gives 2 x 1152), sliding window 128 with every
third layer global (layer i global when i % 3 == 0), no biases, max_position_embeddings 8192, ``--layers`` layers
(22, ModernBERT-base's, by default; fewer keep the same global/local mix and scale every runner alike). The random
checkpoint is built by transformers (its initialisation, seeded), saved, and loaded by fastbert.from_pretrained and by
transformers' AutoModel with attn_implementation "eager" and "sdpa" (and, with ``--optimize``, a copy optimized by
fastbert.optimize).

Cases: ``8x512`` (batch 8 x 512 tokens, no padding), ``varlen32`` (32 sequences of seeded lengths uniform in
16..1024, the first 1024, padded to 1024: every runner gets the same padded batch and mask; fastbert removes padding
itself) and ``1x8192`` (one sequence of ModernBERT's longest context, where the global layers' attention is most of
the time). Each case's first call of every runner is untimed and checked against transformers eager at real
positions; then ``--rounds`` rounds, each timing every runner once, the order rotating per round (background load
drifts hit all alike). Figures: median and minimum wall time per forward. ``--layer-cost`` also times one of
fastbert's global and one of its sliding-window layers on one 1024-token sequence (packed form, the layer alone).
``--dtype bfloat16`` (on a CPU that computes bf16 natively) times fastbert and transformers' sdpa in bfloat16 and
checks both against transformers' sdpa in float32, called once per case, untimed (eager at 8192 tokens would hold
[12, 8192, 8192] scores per layer).

    .venv/bin/python benchmarks/modernbert_bench.py --threads 2 --rounds 3 --out benchmarks/results/cpu-2core-modernbert

Writes <name>.json and <name>.md (default results.*) into --out. Not a test: targets are ratios measured in the
same run, on a VM whose speed drifts by +-30 % between runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import warnings
from pathlib import Path

import torch

from fastbert import numerics
from fastbert.backends import cpp as cpp_backend
from fastbert.bench import peers
from fastbert.bench.machine import machine_info
from fastbert.bench.report import format_table, interleaved_markdown, interleaved_report, write_interleaved
from fastbert.bench.timing import time_ms
from fastbert.bench.workloads import Workload
from fastbert.config import FastBertConfig
from fastbert.ops.padding import varlen_from_mask

TARGETS = {  # case -> [(runner, peer, minimum speed-up of runner over peer)]
    "8x512": [("fastbert (from_pretrained)", "HF eager", 1.3), ("fastbert (from_pretrained)", "HF sdpa", 1.3)],
    "varlen32": [("fastbert (from_pretrained)", "HF eager", 2.5), ("fastbert (from_pretrained)", "HF sdpa", 2.5)],
}
BF16_TARGETS = {  # issue 23's bar for bf16 against plain PyTorch bf16
    case: [("fastbert bf16", "HF sdpa bf16", 1.2)] for case in ("8x512", "varlen32", "1x8192")}
CPU = torch.device("cpu")
ERROR_KEYS = {True: "max_rel_err_vs_hf_eager", False: "max_rel_err_vs_hf_sdpa_fp32"}  # by: the reference is HF eager
BASE_SHAPES = dict(vocab_size=50368, hidden_size=768, num_attention_heads=12, intermediate_size=1152,
                   local_attention=128, global_attn_every_n_layers=3, max_position_embeddings=8192,
                   pad_token_id=50283)


def make_case(name: str, seed: int) -> Workload:
    if name == "8x512":
        return Workload(name, 8, 512, [512] * 8, False)
    if name == "varlen32":
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(16, 1025, (32,), generator=generator).tolist()
        lengths[0] = 1024
        return Workload(name, 32, 1024, lengths, True)
    if name == "1x8192":
        return Workload(name, 1, 8192, [8192], False)
    raise ValueError(f"unknown case {name!r}")


def save_random_checkpoint(directory: str, layers: int, seed: int) -> None:
    """transformers' ModernBertModel at ModernBERT-base's shapes with its own (seeded) initialisation, saved."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.ModernBertConfig(num_hidden_layers=layers, **BASE_SHAPES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.ModernBertModel(config).save_pretrained(directory)


# ----------------------------------------------------------------------------------------------------- runners
def build_runners(model_dir: str, config: FastBertConfig, with_optimize: bool):
    """Runner name -> callable inputs -> last_hidden_state (float32, torch's threads)."""
    import fastbert

    runners = {}
    for label, attn in (("HF eager", "eager"), ("HF sdpa", "sdpa")):
        model = peers.load_hf_model(model_dir, attn=attn)
        runners[label] = lambda inputs, model=model: model(**inputs).last_hidden_state
    fast = peers.load_fastbert(model_dir)
    runners["fastbert (from_pretrained)"] = lambda inputs: fast(**inputs).last_hidden_state
    if with_optimize:
        optimized = fastbert.optimize(peers.load_hf_model(model_dir, attn="sdpa"))
        runners["fastbert (optimize)"] = lambda inputs: optimized(**inputs).last_hidden_state
    return runners, fast


def build_bf16_runners(model_dir: str):
    """(runner name -> callable inputs -> last_hidden_state widened to float32, the float32 reference's callable,
    fastbert's bf16 model)."""
    peers.require_native_bf16(CPU)
    hf = peers.load_hf_model(model_dir, attn="sdpa", dtype=torch.bfloat16)
    fast = peers.load_fastbert(model_dir, torch.bfloat16)
    reference = peers.load_hf_model(model_dir, attn="sdpa")
    runners = {"HF sdpa bf16": lambda inputs: hf(**inputs).last_hidden_state.float(),
               "fastbert bf16": lambda inputs: fast(**inputs).last_hidden_state.float()}
    return runners, (lambda inputs: reference(**inputs).last_hidden_state), fast


# ----------------------------------------------------------------------------------------------------- timing
def bench_case(runners: dict, inputs: dict, rounds: int, reference_run=None) -> dict:
    """Each runner's error (`ERROR_KEYS`) against ``reference_run`` (else the runner "HF eager") and its times."""
    real = inputs["attention_mask"].bool()
    result = {}
    with torch.inference_mode():
        first = {name: run(inputs)[real] for name, run in runners.items()}  # untimed, checked
        reference = first["HF eager"] if reference_run is None else reference_run(inputs)[real]
        scale = float(reference.abs().max())
        for name, output in first.items():
            result[name] = {ERROR_KEYS[reference_run is None]: numerics.max_error(output, reference) / scale,
                            "times_ms": []}
        del first
        names = list(runners)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                result[name]["times_ms"] += time_ms(lambda run=runners[name]: run(inputs), repeats=1, warmup=0,
                                                    device=CPU)
    for entry in result.values():
        entry["median_ms"] = statistics.median(entry["times_ms"])
        entry["min_ms"] = min(entry["times_ms"])
    return result


def layer_cost(fast, seqlen: int, repeats: int) -> dict:
    """Wall time of one of fastbert's global and one of its sliding-window layers on one packed sequence (the layer
    alone: ``repeats`` calls after a warm-up one)."""
    config = fast.config
    kinds = {}
    for index, kind in enumerate(config.layer_types):
        kinds.setdefault(kind, index)
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(seqlen, hidden, generator=generator).to(fast.final_norm_weight.dtype)
    varlen = varlen_from_mask(None, 1, seqlen, CPU)
    positions = torch.arange(seqlen)
    rotary = fast.rotary_tables(CPU)
    table = fast.op_table(x)
    out = {}
    with torch.inference_mode():
        for kind, index in kinds.items():
            layer = fast.layers[index]
            norm = fast.final_norm_weight, fast.final_norm_bias

            def run(layer=layer, norm=norm):
                return layer(x, x, varlen, None, table, positions, rotary, *norm)

            times = time_ms(run, repeats=repeats, warmup=1, device=CPU)
            out[kind] = {"layer": index, "window": layer.window, "median_ms": statistics.median(times),
                         "min_ms": min(times), "times_ms": [round(t, 2) for t in times]}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22, help="number of layers (ModernBERT-base: 22)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", nargs="*", default=list(TARGETS), choices=["8x512", "varlen32", "1x8192"],
                        help="cases to time (none: --layer-cost only)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: fastbert and HF sdpa in bf16, checked against HF sdpa in float32")
    parser.add_argument("--optimize", action="store_true", help="also time fastbert.optimize on HF sdpa")
    parser.add_argument("--layer-cost", action="store_true", help="also time a global and a local layer, S=1024")
    parser.add_argument("--out", default=None, help="directory for <name>.json / <name>.md")
    parser.add_argument("--name", default="results", help="file name stem inside --out")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as model_dir:
        save_random_checkpoint(model_dir, args.layers, args.seed)
        config = FastBertConfig.from_json_file(Path(model_dir) / "config.json")
        if args.dtype == "bfloat16":
            runners, reference, fast = build_bf16_runners(model_dir)
        else:
            (runners, fast), reference = build_runners(model_dir, config, args.optimize), None
        cases = {}
        for case in args.cases:
            workload = make_case(case, args.seed)
            inputs = workload.inputs(config, CPU)
            cases[case] = {"batch": [workload.batch, workload.seqlen], "real_tokens": workload.tokens,
                           "lengths": workload.lengths, "runners": bench_case(runners, inputs, args.rounds, reference)}
            print(f"== {case}: batch {workload.batch} x {workload.seqlen}, {workload.tokens} real tokens", flush=True)
            for name, entry in cases[case]["runners"].items():
                print(f"  {name:28s} median {entry['median_ms']:9.1f} ms  min {entry['min_ms']:9.1f} ms  "
                      f"rel err {entry[ERROR_KEYS[reference is None]]:.1e}", flush=True)
        layers = layer_cost(fast, 1024, 10) if args.layer_cost else None
        if layers:
            for kind, entry in layers.items():
                print(f"  layer {entry['layer']} ({kind}, window {entry['window']}) at S=1024: median "
                      f"{entry['median_ms']:.1f} ms", flush=True)

    targets = []
    for case, checks in (BF16_TARGETS if args.dtype == "bfloat16" else TARGETS).items():
        if case not in cases:
            continue
        for runner, peer, needed in checks:
            speedup = cases[case]["runners"][peer]["median_ms"] / cases[case]["runners"][runner]["median_ms"]
            targets.append({"case": case, "runner": runner, "peer": peer, "needed": needed,
                            "speedup": round(speedup, 3), "met": speedup >= needed})
    machine = machine_info(CPU)
    machine.update(threads=args.threads, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   loadavg_before=load_before, loadavg_after=machine["load_average"])
    kernel = cpp_backend.bf16_attention_kernel
    report = interleaved_report(
        machine, f"ModernBERT-base shapes, {args.layers} layers, random weights (seed {args.seed}), {args.dtype}",
        args.rounds, cases, targets,
        fastbert_backend={"backend": "auto", "compiled_capability": cpp_backend.compiled_capability(),
                          "bf16_attention_kernel": kernel(config.head_dim),
                          "bf16_attention_kernel_local": kernel(config.head_dim, window=True)},
        layer_cost_s1024=layers)
    write_interleaved(report, markdown(report, reference is None), args.out, args.name)
    return 0


def markdown(report: dict, against_eager: bool) -> str:
    reference = "HF eager" if against_eager else "HF sdpa in float32"
    lines = interleaved_markdown(
        report, f"CPU benchmark: {report['model']}",
        f"(torch.set_num_threads), torch CPU capability {report['machine']['torch_cpu_capability']}; load average "
        f"(1 min) before/after {report['machine']['loadavg_before'][0]:.2f}/"
        f"{report['machine']['loadavg_after'][0]:.2f} (other jobs shared the 2 cores)",
        "after one untimed checked call (per round each runner once, order rotated); median and min wall time per "
        f"forward call; rel err = max |out - {reference}| / max |{reference}| at real (non-padded) positions.",
        ms_digits=0, baseline="HF eager" if against_eager else "HF sdpa bf16", error_key=ERROR_KEYS[against_eager])
    if report.get("layer_cost_s1024"):
        rows = [[kind, entry["layer"], entry["window"], f"{entry['median_ms']:.1f}", f"{entry['min_ms']:.1f}"]
                for kind, entry in report["layer_cost_s1024"].items()]
        lines += ["", "## One fastbert layer on one 1024-token sequence", "",
                  format_table(("kind", "layer", "window", "median ms", "min ms"), rows, markdown=True)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
