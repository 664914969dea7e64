"""Two costs of a CPU server's variable batches (issue 39), each measured against its fix, interleaved in one run:

1. Row buckets: oneDNN compiles a GEMM primitive for every row count it meets (bfloat16: tens of milliseconds each),
   and a server's packed batches all differ in size. The same stream of server-like batches (1 to 24 requests of 1
   to 8 sentences of CPython's docs, packed) runs through all-MiniLM-L6-v2 with ``row_buckets`` on and off, each
   batch on both in turn (on first, then off: the off run meets the shape of an off batch for the first time as
   it would in a server). Two passes: the first meets new shapes, the second only shapes seen.
2. The model's thread: libgomp stops spinning between parallel regions once the OpenMP workers of all threads
   outnumber the CPUs (`fastbert.common.threads`). The same request-sized forwards (one request of 1 to 8
   sentences) in the main thread, in another thread while the main thread keeps its OpenMP workers, and in
   another thread after `release_openmp_threads`.

    .venv/bin/python benchmarks/cpu_varying_batches.py --dtype bfloat16 --out benchmarks/results/...

Writes varying-batches-<dtype>.json and .md into --out. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default) or float16")
    parser.add_argument("--batches", type=int, default=60, help="server-like batches per pass (default 60)")
    parser.add_argument("--requests", type=int, default=200, help="request-sized forwards per thread case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default torch's)")
    parser.add_argument("--out", default=None, help="directory for the json and md (default: print only)")
    return parser.parse_args(argv)


def request_stream(ids: list[list[int]], count: int, max_requests: int, seed: int) -> list[list[list[int]]]:
    """``count`` batches of 1 to ``max_requests`` requests of 1 to 8 token lists each."""
    rng = random.Random(seed)
    return [[ids[rng.randrange(len(ids))] for _ in range(sum(rng.randint(1, 8) for _ in range(rng.randint(
        1, max_requests))))] for _ in range(count)]


def timed_forward(model, config, rows: list[list[int]]) -> float:
    import torch

    from fastbert.packing import PackedBatch

    batch = PackedBatch.from_token_lists(config, rows)
    start = time.perf_counter()
    with torch.inference_mode():
        model.forward_packed(batch)
    return time.perf_counter() - start


def row_buckets(model, config, batches: list[list[list[int]]]) -> list[dict]:
    """Per pass: the seconds of all batches with row buckets on and off (interleaved, batch by batch)."""
    passes = []
    for number in (1, 2):
        seconds = {"on": 0.0, "off": 0.0}
        for rows in batches:
            for setting in ("on", "off"):
                model.row_buckets = setting == "on"
                seconds[setting] += timed_forward(model, config, rows)
        model.row_buckets = True
        passes.append({"pass": number, "batches": len(batches), "tokens": sum(len(r) for b in batches for r in b),
                       "seconds_on": seconds["on"], "seconds_off": seconds["off"],
                       "speedup": seconds["off"] / seconds["on"]})
    return passes


def in_thread(function) -> list[float]:
    result: list[list[float]] = []
    worker = threading.Thread(target=lambda: result.append(function()))
    worker.start()
    worker.join()
    return result[0]


def model_thread(model, config, requests: list[list[list[int]]]) -> dict:
    """Median milliseconds of a request-sized forward: in the main thread, in a new thread while the main thread
    keeps its OpenMP workers, in a new thread after releasing them (main first again to restore its team)."""
    import torch

    from fastbert.common.threads import release_openmp_threads

    def run() -> list[float]:
        for rows in requests[:20]:
            timed_forward(model, config, rows)
        return [timed_forward(model, config, rows) * 1e3 for rows in requests]

    torch.randn(1 << 20).mul_(2.0)  # the main thread's OpenMP team exists (as after loading a model)
    main = run()
    other = in_thread(run)
    released = release_openmp_threads()
    after = in_thread(run)
    return {"main_ms": statistics.median(main), "other_thread_ms": statistics.median(other),
            "other_thread_after_release_ms": statistics.median(after), "released": released,
            "forwards": len(requests)}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Variable batches on CPU: row buckets and the model's thread ({report['dtype']})", "",
             f"Command: `{report['command']}`", "",
             f"{m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; CPU flags: {m['cpu_flags']}; "
             f"torch {m['torch']}; commit {m['commit']}; {report['date']}", "",
             "| pass | batches | tokens | row buckets on | off | off / on |", "|---|---:|---:|---:|---:|---:|"]
    for p in report["row_buckets"]:
        lines.append(f"| {p['pass']} | {p['batches']} | {p['tokens']} | {p['seconds_on']:.2f} s | "
                     f"{p['seconds_off']:.2f} s | {p['speedup']:.2f}x |")
    t = report["model_thread"]
    lines += ["", f"| request-sized forward (median of {t['forwards']}) | ms |", "|---|---:|",
              f"| main thread | {t['main_ms']:.2f} |",
              f"| another thread, main thread's OpenMP workers kept | {t['other_thread_ms']:.2f} |",
              f"| another thread after `release_openmp_threads` ({t['released']}) | "
              f"{t['other_thread_after_release_ms']:.2f} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import sys

    import torch

    from fastbert.embedding import Embedder
    from fastbert.training.corpus import cpython_sentences

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from distill_cpu import machine

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    embedder = Embedder(dtype=args.dtype, normalize=False)
    model, config = embedder.model, embedder.config
    ids, _ = embedder.tokenize(list(cpython_sentences(limit=4000)))
    batches = request_stream(ids, args.batches, 24, seed=0)
    requests = request_stream(ids, args.requests, 1, seed=1)
    report = {"dtype": args.dtype, "command": "python benchmarks/cpu_varying_batches.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": machine(), "row_buckets": row_buckets(model, config, batches),
              "model_thread": model_thread(model, config, requests)}
    text = markdown(report)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"varying-batches-{args.dtype}.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / f"varying-batches-{args.dtype}.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
