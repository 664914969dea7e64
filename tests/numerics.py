"""What the kernel tests share: the device they run on, dtype ids for test names, and the accuracy rule, which is
`fastbert.numerics`' (the same for these tests, `fastbert check` and benchmarks/gpu_check.py). On CPU the kernels
run in the Triton interpreter (conftest sets TRITON_INTERPRET=1), on a GPU natively."""

from __future__ import annotations

import torch

from fastbert.numerics import assert_accurate, max_error
from tools.op_checks import DEVICE, rand

DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

__all__ = ["DEVICE", "DTYPE_IDS", "assert_accurate", "max_error", "rand"]
