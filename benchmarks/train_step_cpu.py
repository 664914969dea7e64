"""One training step (forward + backward, no optimizer) of fastbert's own model through the eager and the cpp
backends and through `auto`, measured and by its static order, interleaved: the measurement behind
`fastbert.backends.AUTO_ORDER_AUTOGRAD` (the static order under autograd on CPU, per op) and the check that
`auto`'s measured choice (`fastbert.backends.tuning`) is at least as fast as that static order.

    .venv/bin/python benchmarks/train_step_cpu.py      # random BERT, 4 layers, H 256, batch 8 x 128 (half padded)
    .venv/bin/python benchmarks/train_step_cpu.py --layers 2 --hidden 768 --heads 12 --batch 16 --seqlen 512 \\
        --lengths varlen --threads 2                   # 16 sequences of seeded lengths, mean ~60 % of 512

Runners: ``eager`` and ``cpp`` force one backend for every op; ``static`` is `auto` with measuring off (the static
order); ``measured`` is `auto` with measuring on, its choices measured in this run (a fresh temporary tuning cache
unless ``--cache-dir``; its first step, which measures, is reported apart and not timed). ``--lengths``: ``half``
(half the rows half padded), ``varlen`` (lengths uniform in [0.2, 1.0] x seqlen, the first full) or ``full``;
fastbert removes the padding itself (packed attention). ``--dropout``: train() mode with the config's dropout (0.1),
else eval() (no dropout); the cpp runner cannot run it (its LayerNorm-family kernels decline dropout). Prints the
machine, the median and minimum per runner (rounds interleaved, order rotated) and the median per-round ratio
static / measured. Not a test: this VM drifts by +-30 % between runs, so compare runners within one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

import fastbert
from fastbert import backends
from fastbert.backends import tuning
from fastbert.bench.machine import load_average
from fastbert.bench.recording import record_backends

RUNNERS = ("eager", "cpp", "static", "measured")


def batch(size: int, seqlen: int, lengths: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [size, seqlen]; ``lengths``: "half" (the second half of the rows half padded),
    "varlen" (seeded lengths uniform in [0.2, 1.0] x seqlen, the first full) or "full" (no padding)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 2000, (size, seqlen), generator=generator)
    if lengths == "varlen":
        real = (seqlen * (0.2 + 0.8 * torch.rand(size, generator=generator))).long().clamp(min=1)
        real[0] = seqlen
    else:
        real = torch.full((size,), seqlen)
        if lengths == "half":
            real[size // 2:] = seqlen // 2
    lengths = real
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--lengths", choices=["half", "varlen", "full"], default="half")
    parser.add_argument("--dropout", action="store_true", help="train() mode with dropout 0.1 (default: eval())")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--cache-dir", default=None, help="tuning cache for the measured runner (default: a fresh "
                        "temporary one, so it measures in this run)")
    args = parser.parse_args()
    os.environ["FASTBERT_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="fastbert-tune-")
    tuning.forget()
    key = tuning.environment_key(torch.device("cpu"))
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {key['name']}; {os.cpu_count()} "
          f"cores, load average {load_average()}; torch {key['torch']}, fastbert {key['fastbert']}; "
          f"command: {' '.join(sys.argv)}")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp()
    config = transformers.BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                                     max_position_embeddings=max(512, args.seqlen))
    transformers.BertModel(config).save_pretrained(directory)
    models = {}
    for runner in args.runners:
        model = fastbert.from_pretrained(directory, backend="auto" if runner in ("static", "measured") else runner)
        models[runner] = model.train() if args.dropout else model.eval()
    ids, mask = batch(args.batch, args.seqlen, args.lengths)
    real = int(mask.sum())
    print(f"batch {args.batch} x {args.seqlen}, {real} real tokens ({real / mask.numel():.0%}), {args.layers} layers, "
          f"H {args.hidden}, {args.heads} heads, dropout {'0.1' if args.dropout else 'off'}, {args.threads} threads")

    def step(model):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()

    times = {runner: [] for runner in models}
    for runner, model in models.items():
        # A warm-up step, which resolves the model's op tables: the static runner's with measuring off, the
        # measured runner's with it on (they keep those choices afterwards); tables resolved inside report which
        # backend ran each op.
        start = time.perf_counter()
        with record_backends() as seen, backends.measuring(runner != "static"):
            step(model)
        print(f"{runner} ran: " + ", ".join(f"{op} {'/'.join(sorted(counts))}" for op, counts in sorted(seen.items())))
        if runner == "measured":
            print(f"measured's first step (measuring each op class included): "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms")
            print(backends.explain(model))
    order = list(models)
    for round_index in range(args.steps):
        for runner in order[round_index % len(order):] + order[:round_index % len(order)]:  # rotated per round
            start = time.perf_counter()
            step(models[runner])
            times[runner].append((time.perf_counter() - start) * 1e3)
    for runner, values in times.items():
        print(f"{runner}: median {statistics.median(values):.1f} ms, min {min(values):.1f} ms "
              f"({args.threads} thread(s), {args.steps} steps)")
    if "static" in times and "measured" in times:
        ratios = [s / m for s, m in zip(times["static"], times["measured"], strict=True)]
        print(f"static / measured per round: median {statistics.median(ratios):.3f} (> 1: measured faster)")


if __name__ == "__main__":
    main()
