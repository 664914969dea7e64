"""One training step (forward + backward, no optimizer) of fastbert's own model through the eager and the cpp
backends, interleaved: the measurement behind `fastbert.backends.AUTO_ORDER_AUTOGRAD` (auto trains through eager on
CPU while cpp's backward recomputes with PyTorch ops).

    .venv/bin/python benchmarks/train_step_cpu.py      # random BERT, 4 layers, H 256, batch 8 x 128 (half padded)
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
import transformers

import fastbert


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    directory = tempfile.mkdtemp()
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024)
    transformers.BertModel(config).save_pretrained(directory)
    models = {backend: fastbert.from_pretrained(directory, backend=backend).eval() for backend in ("eager", "cpp")}
    ids = torch.randint(1000, 2000, (8, 128))
    mask = torch.ones_like(ids)
    mask[4:, 64:] = 0

    def step(model):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()

    times = {backend: [] for backend in models}
    for model in models.values():
        step(model)
    for _ in range(10):
        for backend, model in models.items():
            start = time.perf_counter()
            step(model)
            times[backend].append((time.perf_counter() - start) * 1e3)
    for backend, values in times.items():
        print(f"{backend}: median {statistics.median(values):.1f} ms, min {min(values):.1f} ms (1 thread, 10 steps)")


if __name__ == "__main__":
    main()
