"""Corpus embedding: `fastbert embed`'s pipeline vs sentence-transformers' `encode`, plain and `fastbert.optimize`d.

Same model (default: the embedded all-MiniLM-L6-v2), same real sentences (CPython's documentation,
`fastbert.training.corpus`, 20,000 by default), same run, interleaved rounds; the model is loaded once per
implementation before timing. fastbert embed is timed end to end as the command runs it after loading: reading the
text file, tokenizing, sorting within windows, token-budget batches, the model, pooling, normalising and writing a
.npy file. sentence-transformers' encode is timed on the list of texts (its defaults: batch 32, sorted by length).

    .venv/bin/python benchmarks/embed_bench.py                      # 20,000 sentences, 3 rounds
    .venv/bin/python benchmarks/embed_bench.py --sentences 2000 --rounds 1 --out /tmp/embed-smoke

Writes embed.json and embed.md under --out (default benchmarks/results/cpu-2core-embed). Target (issue 13):
fastbert embed >= 1.6x plain sentence-transformers on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from fastbert import embedding
from fastbert.bench.machine import machine_info
from fastbert.common.resolve import default_model_dir
from fastbert.files import write_atomic
from fastbert.training.corpus import cpython_sentences


def render_markdown(report: dict) -> str:
    """embed.md from embed.json's content: the machine, versions and date of the run, then the table."""
    machine = report["machine"]
    versions = ", ".join(f"{name} {version}" for name, version in machine["versions"].items() if version)
    lines = [f"# Corpus embedding: {report['sentences']:,} sentences of CPython's documentation "
             f"({report['tokens']:,} tokens), {report['model']}", "",
             f"- Date (end of the run): {machine['date']}",
             f"- Machine: {machine['cpu']}, {machine['cpu_cores']} logical CPUs, {report['threads']} torch threads; "
             f"load average (1/5/15 min) at the end {', '.join(f'{v:.2f}' for v in machine['load_average'])}",
             f"- Versions: python {machine['python']}, {versions}",
             f"- Command: `{report.get('command', '.venv/bin/python benchmarks/embed_bench.py')}`",
             f"- {report['rounds']} interleaved rounds, median; model loading excluded; fastbert embed's token budget "
             f"{report['max_batch_tokens']} per batch", "",
             "| implementation | median s | texts/s | tokens/s | speed-up vs plain sentence-transformers | "
             "max abs diff vs plain ST |", "|---|---|---|---|---|---|"]
    for row in report["results"]:
        lines.append(f"| {row['implementation']} | {row['median_s']:.2f} | {row['texts_per_s']:,.0f} | "
                     f"{row['tokens_per_s']:,.0f} | {row['speedup_vs_plain_st']:.2f}x | "
                     f"{row['max_abs_diff_vs_plain_st']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--sentences", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch-tokens", type=int, default=None, help="default: fastbert embed's")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu-2core-embed"))
    parser.add_argument("--render", metavar="DIR", default=None,
                        help="only rewrite DIR/embed.md from DIR/embed.json (no run)")
    return parser.parse_args(argv)


def embed_file(embedder: embedding.Embedder, source: Path, out: Path) -> np.ndarray:
    """`fastbert embed -i source -o out.npy` as the command runs it after loading; the embeddings written."""
    counter, _, name = embedding.open_input(str(source))
    output = embedding.FileOutput(str(out), "npy", embedder.dimension, np.float32)
    try:
        embedding.run(embedder, embedding.read_rows(counter, "text", name=name), output, window_rows=2048)
    finally:
        output.close()
        counter.stream.close()
    return np.load(out)


def implementations(model_dir: str, texts: list[str], source: Path, max_batch_tokens: int | None
                    ) -> tuple[embedding.Embedder, dict[str, Callable[[], np.ndarray]]]:
    """fastbert's embedder and the three timed calls, each model loaded and warmed up on a slice of the texts."""
    from sentence_transformers import SentenceTransformer

    import fastbert

    embedder = embedding.Embedder(model_dir, max_batch_tokens=max_batch_tokens)
    st_plain = SentenceTransformer(model_dir, device="cpu")
    st_fast = fastbert.optimize(SentenceTransformer(model_dir, device="cpu"))
    embedder.embed(texts[:256])  # warm-up on a slice (first-call costs), not timed
    st_plain.encode(texts[:256])
    st_fast.encode(texts[:256])
    return embedder, {
        "fastbert embed": functools.partial(embed_file, embedder, source, source.with_name("out.npy")),
        "sentence-transformers encode": functools.partial(st_plain.encode, texts, convert_to_numpy=True),
        "sentence-transformers encode, fastbert.optimize": functools.partial(st_fast.encode, texts,
                                                                             convert_to_numpy=True),
    }


def interleaved_rounds(calls: dict[str, Callable[[], np.ndarray]], rounds: int
                       ) -> tuple[dict[str, list[float]], dict[str, np.ndarray]]:
    """Each call's seconds per round (one call of each per round) and its last output."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    outputs = {}
    for round_index in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
            print(f"round {round_index + 1}/{rounds}  {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    return times, outputs


def result_rows(times: dict[str, list[float]], outputs: dict[str, np.ndarray], texts: int, tokens: int
                ) -> list[dict]:
    """embed.json's results: median seconds, rates, speed-up and difference against plain sentence-transformers."""
    reference = outputs["sentence-transformers encode"]
    plain = statistics.median(times["sentence-transformers encode"])
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rows.append({"implementation": name, "median_s": median, "times_s": seconds, "texts_per_s": texts / median,
                     "tokens_per_s": tokens / median, "speedup_vs_plain_st": plain / median,
                     "max_abs_diff_vs_plain_st": float(np.abs(outputs[name] - reference).max())})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report = json.loads((Path(args.render) / "embed.json").read_text())
        write_atomic(Path(args.render) / "embed.md", render_markdown(report))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_dir()
    texts = list(cpython_sentences(limit=args.sentences))
    if len(texts) < args.sentences:
        print(f"only {len(texts)} sentences available", file=sys.stderr)
    source = Path(tempfile.mkdtemp(prefix="embed-bench-")) / "corpus.txt"
    source.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    embedder, calls = implementations(model_dir, texts, source, args.max_batch_tokens)
    tokens = sum(len(ids) for ids in embedder.tokenize(texts)[0])
    times, outputs = interleaved_rounds(calls, args.rounds)
    command = ".venv/bin/python benchmarks/embed_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"benchmark": "corpus embedding", "command": command.strip(),
              "model": os.path.basename(os.path.dirname(model_dir)), "sentences": len(texts), "tokens": tokens,
              "rounds": args.rounds, "max_batch_tokens": embedder.max_batch_tokens,
              "threads": torch.get_num_threads(), "machine": machine_info(torch.device("cpu")),
              "results": result_rows(times, outputs, len(texts), tokens)}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "embed.json", json.dumps(report, indent=1) + "\n")
    markdown = render_markdown(report)
    write_atomic(out_dir / "embed.md", markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
