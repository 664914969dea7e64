"""The triton GEMM's split-K path (`fastbert.kernels.gemm.split_k`): forced on (SPLIT_K_OVERRIDE) under the
interpreter, every forward epilogue against fp64 references by `fastbert.numerics`' rule (through the triton ops,
`tools.op_checks`), the dropout mask the unsplit kernel draws, gradients through the split forward, and when the
heuristic splits (a 132-SM GPU assumed)."""

from __future__ import annotations

import pytest
import torch

from fastbert import ops
from fastbert.kernels import gemm
from tests.helpers import ALL_DTYPES, DEVICE, check_grads, ln_op_args, rand
from tools.op_checks import (
    check_linear_activation,
    check_linear_residual_layernorm,
    check_linear_residual_prenorm,
    check_qkv_projection,
)


@pytest.fixture
def forced_split(monkeypatch):
    monkeypatch.setattr(gemm, "SPLIT_K_OVERRIDE", 3)


@pytest.mark.parametrize("rows", [1, 7, 130])
def test_split_forward_fp16(forced_split, rows):
    check_linear_residual_layernorm(rows, 96, torch.float16, strided=rows == 7, inner=700)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_split_every_forward_epilogue(forced_split, rows, dtype):
    strided = rows == 7
    check_linear_activation(rows, 384, dtype, "gelu", strided)  # K = 384: three slices of 128
    check_linear_activation(rows, 384, dtype, "silu", strided)
    check_qkv_projection(rows, 384, 6, dtype, strided)
    check_linear_residual_layernorm(rows, 96, dtype, strided, with_bias=False, inner=700)
    check_linear_residual_prenorm(rows, 96, 300, dtype, strided)


def test_split_really_splits_and_keeps_the_dropout_mask(monkeypatch):
    x, weight = rand(9, 700, dtype=torch.float32), rand(64, 700, dtype=torch.float32, scale=0.05)
    bias, residual = rand(64, dtype=torch.float32), rand(9, 64, dtype=torch.float32)
    unsplit = gemm.linear(x, weight, bias, residual=residual, dropout_p=0.3, dropout_seed=11)
    monkeypatch.setattr(gemm, "SPLIT_K_OVERRIDE", 4)
    assert gemm.split_k_meta(9)["BLOCK_K"] == 128
    expected = 3  # 4 slices of K = 700 rounded up to whole 128-deep steps: 3 slices of 256 run
    assert gemm.split_k(9, 64, 700, x.device) == expected
    launched = []
    original = gemm._launch_split_k
    monkeypatch.setattr(gemm, "_launch_split_k", lambda *a: launched.append(a[-1]) or original(*a))
    split = gemm.linear(x, weight, bias, residual=residual, dropout_p=0.3, dropout_seed=11)
    assert launched == [expected]
    assert torch.equal(split == residual, unsplit == residual)  # the same elements dropped
    torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["linear_residual_layernorm", "linear_activation"])
def test_grads_through_the_split_forward(forced_split, op):
    check_grads(op, ln_op_args(op, 7, 48, torch.float32, in_features=300), "triton")


def test_heuristic_splits_only_where_every_tile_underfills(monkeypatch):
    monkeypatch.setattr(gemm, "INTERPRETER", False)
    monkeypatch.setattr(gemm, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert gemm.split_k(16, 768, 3072, cuda) == 6  # 24 tiles of 16 x 32: cdiv(132, 24) slices
    assert gemm.split_k(1, 768, 768, cuda) == 3  # K = 768: slices of at least 256
    assert gemm.split_k(128, 768, 3072, cuda) == 1  # 192 tiles already fill the GPU
    assert gemm.split_k(16, 3072, 768, cuda) == 1  # 96 tiles
    assert gemm.split_k(16, 768, 384, cuda) == 1  # too shallow to slice
    assert gemm.split_k(16, 768, 3072, torch.device("cpu")) == 1
    assert gemm.split_k(1 << 20, 1 << 10, 3072, cuda) == 1  # a workspace past int32 offsets: never


def test_empty_inputs_never_split(forced_split):
    x = torch.empty(0, 700, dtype=torch.float16, device=DEVICE)
    assert ops.linear_activation(x, rand(48, 700, dtype=torch.float16), None, "gelu", backend="triton").shape == (0, 48)
