"""Benchmark and check tooling shared by `fastbert bench`/`check`/`demo`, benchmarks/ and the tests, one module
per responsibility:

- `costs`: FLOPs and bytes moved per fused op (`OpCost`) and per encoder token;
- `timing`: synchronise, time calls, percentiles, a measured peak FLOP/s;
- `machine`: machine tag, CPU/GPU, vector features, versions, git commit, for results files;
- `recording`: which backend each op ran on (`record_backends`);
- `workloads`: batches of random token ids with given real lengths;
- `peers`: transformers eager/SDPA, torch.compile, ONNX Runtime and fastbert, loaded as callables;
- `e2e`: the end-to-end benchmark (`BenchSettings`, `run_e2e`);
- `report`: tables, Markdown, JSON and plots of the results, each file written atomically (`fastbert.files`).

The accuracy checks of the triton backend's ops at any shape (tests/ops, benchmarks/gpu_check.py) are not part of the
package: they are `tools/op_checks.py`.

The modules import nothing heavy at import time (transformers, onnxruntime, matplotlib, tqdm inside functions).
"""
