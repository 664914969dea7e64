"""``fastbert demo`` (and ``fastbert`` alone): transformers (eager) vs fastbert.from_pretrained (vs
fastbert.optimize) on a batch of real sentences: how far their outputs are apart and how fast each is."""

from __future__ import annotations

import argparse

import torch

from fastbert.bench import report, timing
from fastbert.cli import shared
from fastbert.common.resolve import UserError, resolve_device, resolve_dtype, resolve_model
from fastbert.common.text import SENTENCES, TextEncoder, mean_pool

HEADERS = ("implementation", "median ms", "speed-up", "max abs err (real tokens)", "min cosine of sentence embeddings")


def run(args: argparse.Namespace) -> int:
    """Print the comparison table and the backends fastbert's ops ran on."""
    if args.repeats < 1:  # checked before any model loads: a median of no calls is no number
        raise UserError("--repeats must be >= 1")
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    shared.set_threads(args.threads)  # first: dtype "auto" may time a GEMM at these threads
    dtype = resolve_dtype(args.dtype, device)
    shared.need_transformers("demo")
    batch = TextEncoder(model_dir, config)(SENTENCES, device)
    mask = batch["attention_mask"].bool()
    print(f"fastbert demo: {shared.model_line(model_dir, config, device, dtype)}")
    print(f"{len(SENTENCES)} English sentences, padded to {batch['input_ids'].shape[1]} tokens "
          f"({int(mask.sum())} real); median of {args.repeats} interleaved calls after 2 warm-up calls; "
          f"{torch.get_num_threads()} torch threads\n")
    implementations = load_implementations(model_dir, dtype, device, args.backend, optimize=not args.no_optimize)
    seen: dict = {}
    hidden_states = [shared.forward(model, batch, seen if index else None).last_hidden_state.float()
                     for index, (_, model) in enumerate(implementations)]
    medians = median_times(implementations, batch, device, args.repeats)
    print(report.format_table(HEADERS, comparison_rows(implementations, hidden_states, medians, batch)))
    print()
    for line in shared.backend_lines(seen):
        print(line)
    print("\nspeed-up = transformers' median / this median, same run; errors against transformers in the same "
          "dtype; sentence embeddings: mean pooling + L2 normalisation (sentence-transformers').")
    return 0


def load_implementations(model_dir: str, dtype: torch.dtype, device: torch.device, backend: str,
                         optimize: bool) -> list[tuple[str, torch.nn.Module]]:
    """(name, model): transformers first (the reference), then fastbert's model, then fastbert.optimize(HF).
    fastbert's loads first: its errors name what is wrong with a checkpoint."""
    fast = shared.load_fastbert(model_dir, dtype, device, backend)
    implementations = [("transformers AutoModel (eager)", shared.load_hf_model(model_dir, dtype, device)),
                       (f"fastbert.from_pretrained (backend={backend})", fast)]
    if optimize:
        import fastbert

        optimized = fastbert.optimize(shared.load_hf_model(model_dir, dtype, device), backend=backend)
        implementations.append(("fastbert.optimize(transformers model)", optimized))
    return implementations


def median_times(implementations: list[tuple[str, torch.nn.Module]], batch: dict, device: torch.device,
                 repeats: int) -> list[float]:
    """Median milliseconds per call of each implementation, after 2 warm-up calls each."""
    times: list[list[float]] = [[] for _ in implementations]
    with torch.inference_mode():
        for _, model in implementations:
            timing.time_ms(lambda m=model: m(**batch), repeats=0, warmup=2, device=device)
        for _ in range(repeats):  # interleaved, so a change of load on the machine hits all alike
            for index, (_, model) in enumerate(implementations):
                times[index] += timing.time_ms(lambda m=model: m(**batch), repeats=1, warmup=0, device=device)
    return [timing.percentile(t, 50) for t in times]


def comparison_rows(implementations: list[tuple[str, torch.nn.Module]], hidden_states: list[torch.Tensor],
                    medians: list[float], batch: dict) -> list[list[str]]:
    """The table's rows: each implementation's time and speed-up, and its errors against the first one."""
    mask = batch["attention_mask"].bool()
    reference = hidden_states[0]
    reference_embeddings = mean_pool(reference, batch["attention_mask"])
    rows = [[implementations[0][0], f"{medians[0]:.2f}", "1.00x", "(reference)", "(reference)"]]
    for (name, _), hidden, median in zip(implementations[1:], hidden_states[1:], medians[1:], strict=True):
        error = float((hidden - reference)[mask].abs().max())
        cosine = float((mean_pool(hidden, batch["attention_mask"]) * reference_embeddings).sum(dim=1).min())
        rows.append([name, f"{median:.2f}", f"{medians[0] / median:.2f}x", f"{error:.2e}", f"{cosine:.6f}"])
    return rows
