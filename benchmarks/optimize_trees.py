"""Interleaved timing of `fastbert.optimize` across source trees (e.g. before/after a change to optimize.py).

Each round runs one child process per tree (PYTHONPATH=<tree>, so that tree's `fastbert` is imported), in
alternating order; a child builds a seeded random BERT of the given size, optimizes it and reports the median of
its timed repeats for an inference forward (no_grad) and a training step (forward, backward, AdamW step). Medians
over rounds are printed per tree: this VM drifts by +-30 % between runs, so compare trees within one run only.

    .venv/bin/python benchmarks/optimize_trees.py --tree before=/tmp/base --tree after=. --size minilm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {"minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
         "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)}


def child(size: str, repeats: int, batch: int, seqlen: int) -> dict:
    """Times one optimized model in this process (the tree on PYTHONPATH); returns medians in ms."""
    import torch
    import transformers

    import fastbert

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, **SIZES[size])
    config._attn_implementation = "eager"
    model = fastbert.optimize(transformers.BertForSequenceClassification(config))
    ids = torch.randint(1000, 30000, (batch, seqlen))
    mask = torch.ones_like(ids)
    mask[batch // 2:, seqlen * 3 // 4:] = 0  # some padding, as real batches have
    labels = torch.zeros(batch, dtype=torch.long)

    def infer() -> None:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train() -> None:
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    result = {}
    for name, step, mode in (("infer_ms", infer, model.eval), ("train_ms", train, model.train)):
        mode()
        step()  # warm-up: the build, op tables, first allocation
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        result[name] = statistics.median(times)
    result["fastbert"] = fastbert.__file__
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="name=path of a source tree (repeat it)")
    parser.add_argument("--size", choices=sorted(SIZES), default="minilm")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.size, args.repeats, args.batch, args.seqlen)))
        return
    trees = [entry.split("=", 1) for entry in args.tree]
    runs: dict[str, list[dict]] = {name: [] for name, _ in trees}
    for index in range(args.rounds):
        for name, path in trees if index % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path), "FASTBERT_TUNE": "0"}
            command = [sys.executable, os.path.abspath(__file__), "--child", "--size", args.size, "--repeats",
                       str(args.repeats), "--batch", str(args.batch), "--seqlen", str(args.seqlen)]
            out = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd="/tmp").stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    for name, results in runs.items():
        medians = {key: statistics.median(r[key] for r in results) for key in ("infer_ms", "train_ms")}
        print(f"{name:>8} {args.size}: inference {medians['infer_ms']:.1f} ms, training step "
              f"{medians['train_ms']:.1f} ms (medians of {len(results)} rounds; {results[0]['fastbert']})")


if __name__ == "__main__":
    main()
