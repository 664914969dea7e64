"""int8 ModernBERT forward (8 x 128, 2 threads) with the pre-LN C++ steps (csrc/int8.cpp, csrc/rotary.cpp) against
the same steps as torch ops, 7 interleaved rounds, then one profiled forward of each.

    .venv/bin/python benchmarks/results/cpu-2core-modernbert-int8/steps_bench.py CHECKPOINT_DIR > steps.txt
"""

import datetime
import statistics
import sys
import time

import torch

import fastbert
from fastbert import cpu, quantization


def main(directory: str) -> None:
    torch.set_num_threads(2)
    model = fastbert.from_pretrained(directory, dtype="int8")
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(0))
    with_steps = quantization._fused_steps

    def without_pre_ln_steps(steps=quantization.POST_LN_STEPS):
        return False if steps == quantization.PRE_LN_STEPS else with_steps(steps)

    modes = {"C++ steps": with_steps, "torch ops": without_pre_ln_steps}
    times = {name: [] for name in modes}
    with open("/proc/loadavg") as handle:
        load = handle.read().split()[0]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu.cpu_info()[0]}; flags "
          f"{' '.join(cpu.cpu_flags())}; torch {torch.__version__}; 2 threads; 8 x 128; load {load}")
    with torch.inference_mode():
        for check in modes.values():
            quantization._fused_steps = check
            model(input_ids=ids)
        for _ in range(7):
            for name, check in modes.items():
                quantization._fused_steps = check
                start = time.perf_counter()
                model(input_ids=ids)
                times[name].append((time.perf_counter() - start) * 1e3)
        for name in modes:
            print(f"{name}: median {statistics.median(times[name]):.1f} ms, min {min(times[name]):.1f} ms over 7 "
                  "interleaved rounds")
        for name, check in modes.items():
            quantization._fused_steps = check
            with torch.profiler.profile() as prof:
                model(input_ids=ids)
            events = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in events)
            gemm = sum(e.self_cpu_time_total for e in events if e.key.startswith("quantized::"))
            attention = sum(e.self_cpu_time_total for e in events if e.key == "fastbert::cpp_attention")
            print(f"{name}: profile of one forward: int8 GEMMs {100 * gemm / total:.1f} %, attention "
                  f"{100 * attention / total:.1f} %, the rest {100 * (total - gemm - attention) / total:.1f} % of "
                  f"{total / 1e3:.0f} ms self CPU time")
    quantization._fused_steps = with_steps


if __name__ == "__main__":
    main(sys.argv[1])
