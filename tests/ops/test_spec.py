"""The op registry: every fused op declared once, its torch ops (cpp and triton) made from that one declaration."""

from __future__ import annotations

import importlib

import pytest
import torch

from fastbert import backends, ops
from fastbert.ops.spec import OpSpec, declare

FUSED = {"embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm",
         "qkv_rotary", "linear_glu", "linear_residual_prenorm"}


def test_every_fused_op_is_declared_with_all_its_parts():
    assert set(ops.SPECS) == FUSED
    for name, spec in ops.SPECS.items():
        assert spec.name == name
        assert all(callable(part) for part in (spec.check, spec.eager, spec.reference, spec.cost, spec.fake))
        assert spec.schema.startswith("(") and ("-> Tensor" in spec.schema or "-> (Tensor" in spec.schema)
        assert backends._REGISTRY[name]["eager"].fn is spec.eager


@pytest.mark.parametrize("prefix", ["cpp_", "triton_"], ids=["cpp", "triton"])
def test_registered_torch_ops_carry_the_spec_schema(prefix):
    module = "fastbert.backends.cpp" if prefix == "cpp_" else "fastbert.kernels"
    importlib.import_module(module)  # both are installed with the dev extras the test suite needs
    for name, spec in ops.SPECS.items():
        if prefix == "cpp_" and name == "qkv_projection":
            continue  # the cpp backend's QKV is one addmm: no torch op of its own
        op = getattr(torch.ops.fastbert, prefix + name).default
        assert op._schema == torch._C.parse_schema(f"fastbert::{prefix}{name}{spec.schema}")  # (0.0 prints "0.")


def test_the_fake_gives_the_shape_of_the_eager_result():
    x, w, b = torch.randn(3, 5, 8), torch.randn(12, 8), torch.randn(12)
    spec = ops.SPECS["linear_activation"]
    with torch.device("meta"):
        fake = spec.fake(x.to("meta"), w.to("meta"), b.to("meta"), "gelu")
    assert fake.shape == spec.eager(x, w, b, "gelu").shape


def test_an_op_cannot_be_declared_twice():
    spec = ops.SPECS["attention"]
    with pytest.raises(ValueError, match="declared twice"):
        declare(OpSpec(name="attention", check=spec.check, eager=spec.eager, reference=spec.reference))


def test_cost_formulas_count_a_multiply_add_as_two_flops():
    cost = ops.SPECS["linear_activation"].cost(tokens=3, in_features=5, out_features=7, dtype_bytes=2)
    assert cost.flops == 2 * 3 * 5 * 7


def test_every_spec_has_a_backward_on_every_backend():
    importlib.import_module("fastbert.backends.cpp")
    for op, spec in ops.SPECS.items():
        assert spec.has_backward, op
        assert backends._REGISTRY[op]["cpp"].has_backward, op
