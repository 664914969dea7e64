"""Fine-tuning figures for benchmarks/results/: `fastbert finetune` on each task, then one JSON and one Markdown
table of held-out accuracy against the majority-class baseline.

    .venv/bin/python benchmarks/finetune_cpu.py --runs /tmp/ft --out benchmarks/results/cpu-2core-finetune \
        --steps topic=40 pair=40 code=30 --batch-size 16 --learning-rate 2e-4 --threads 2
    .venv/bin/python benchmarks/finetune_cpu.py --runs /tmp/ft --out DIR --collect-only   # runs already done

Each task's run (checkpoints, the fine-tuned model, metrics.jsonl, results.json) stays under --runs; --out gets
finetune.json (every task's results.json, its metrics records and the machine) and finetune.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fastbert.bench.machine import git_commit
from fastbert.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]


def machine() -> dict:
    """CPU model, cores, platform and Python of this machine, for finetune.json."""
    from fastbert.bench.machine import machine_info

    info = machine_info("cpu")
    return {"cpu": info["cpu"], "cores": info["cpu_cores"], "platform": info["platform"], "python": info["python"]}


def _markdown(record: dict) -> str:
    lines = [f"# `fastbert finetune` on CPU ({record['date']})", "",
             f"Machine: {record['machine']['cpu']}, {record['machine']['cores']} cores (shared with other jobs), "
             f"python {record['machine']['python']}; commit {record['commit']}.", "",
             "| task | labels | train / held-out | steps x batch | held-out accuracy | majority baseline | "
             "before training | macro F1 | train time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, result in record["tasks"].items():
        unit = " words" if result["kind"] == "token" else ""
        held = result["evaluation"]["count"]
        lines.append(
            f"| {name} | {', '.join(result['labels'])} | {result['train']['examples']} / {held}{unit} | "
            f"{result['training']['steps']} x {result['settings']['batch_size']} | "
            f"{result['evaluation']['accuracy']:.3f} | {result['majority_baseline']['accuracy']:.3f} "
            f"('{result['majority_baseline']['label']}') | {result['accuracy_before_training']:.3f} | "
            f"{result['evaluation']['macro_f1']:.3f} | {result['training']['seconds_total']:.0f} s |")
    lines += ["", "Per label (held out): precision / recall / F1 (support)", ""]
    for name, result in record["tasks"].items():
        parts = [f"{label} {p['precision']:.2f} / {p['recall']:.2f} / {p['f1']:.2f} ({p['support']})"
                 for label, p in zip(result["labels"], result["evaluation"]["per_label"], strict=True)]
        lines.append(f"- {name}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run (unless --collect-only) and collect the fine-tuning runs; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", required=True, help="directory holding one run directory per task")
    parser.add_argument("--out", required=True, help="where finetune.json and finetune.md go")
    parser.add_argument("--steps", nargs="+", default=["topic=40", "pair=40", "code=30"], metavar="TASK=N")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--collect-only", action="store_true", help="only collect runs already in --runs")
    parser.add_argument("--commit", default=None, help="the commit the runs were made from (default: HEAD)")
    args = parser.parse_args(argv)
    steps = dict(item.split("=", 1) for item in args.steps)
    runs = Path(args.runs)
    if not args.collect_only:
        for task, count in steps.items():
            if (runs / task).exists():
                shutil.rmtree(runs / task)
            command = [sys.executable, "-m", "fastbert.cli", "finetune", "--task", task, "-o", str(runs / task),
                       "--max-steps", count, "--batch-size", str(args.batch_size), "--learning-rate",
                       str(args.learning_rate), "--threads", str(args.threads), "--log-every", "5"]
            if args.model:
                command += ["--model", args.model]
            subprocess.run(command, cwd=ROOT, check=True)
    record = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(),
              "commit": args.commit or git_commit(ROOT) or "unknown", "tasks": {}}
    for task in steps:
        result = json.loads((runs / task / "results.json").read_text())
        result["metrics"] = [json.loads(line) for line in (runs / task / "metrics.jsonl").read_text().splitlines()]
        record["tasks"][task] = result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "finetune.json", json.dumps(record, indent=1) + "\n")
    write_atomic(out / "finetune.md", _markdown(record))
    print(_markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
