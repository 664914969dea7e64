"""The tests several token ops share, written once. Each factory returns a test class for one op; a
tests/ops/test_<op>.py binds it to a Test* name (``TestGrads = grad_tests(OP)``) and pytest collects its tests
there. What differs between the ops (the backends' case lists, the triton backward's kernel) is an argument; the
checks themselves are tests/helpers.py's. Also the inputs the op tests share: BERT's shapes, transformers'
ModernBERT modules with random weights."""

from __future__ import annotations

import pytest
import torch
from transformers.models.modernbert.configuration_modernbert import ModernBertConfig

from tests.helpers import (
    FP32_GRAD_CASES,
    GEMM_FP32_GRAD_CASES,
    GEMM_LOW_PRECISION_GRAD_CASES,
    GEMM_OPCHECK_BACKENDS,
    HALF_DTYPES,
    LOW_PRECISION_GRAD_CASES,
    OPCHECK_BACKENDS,
    backend_op,
    check_grads,
    check_triton_backward_kernel,
    check_triton_dropout_grads,
    for_backend,
    frozen_tables,
    gradcheck_spec,
    ln_op_args,
    op_args,
    opcheck_with_grad,
    torch_op_args,
)

# (rows, hidden, heads): few rows at BERT widths, odd row counts included
BERT_SHAPES = [(1, 1024, 16), (7, 768, 12), (130, 384, 6)]
BERT_SHAPE_IDS = [f"rows{r}-h{h}" for r, h, _ in BERT_SHAPES]
VARIANTS = ["full", "none"]  # op_args' variants: every optional input given, or none


def grad_tests(op: str, gemm: bool = True, opcheck_backends: list | None = None) -> type:
    """Every token op's gradient tests: against the eager op's autograd in fp32 and in fp16/bf16, gradcheck of the
    spec's backward formula, opcheck of the backends' torch ops with inputs that require grad. Backends and row
    counts: tests/helpers.py's case lists, the GEMM-bearing ops' (with the vendor backend) unless ``gemm`` is False;
    ``opcheck_backends`` replaces the opcheck's."""
    if gemm:
        fp32_cases, low_precision_cases, backends = (GEMM_FP32_GRAD_CASES, GEMM_LOW_PRECISION_GRAD_CASES,
                                                     GEMM_OPCHECK_BACKENDS)
    else:
        fp32_cases, low_precision_cases, backends = FP32_GRAD_CASES, LOW_PRECISION_GRAD_CASES, OPCHECK_BACKENDS
    opcheck_backends = backends if opcheck_backends is None else opcheck_backends

    class GradTests:
        @pytest.mark.parametrize("variant", VARIANTS)
        @pytest.mark.parametrize("backend, rows", fp32_cases)
        def test_grads_match_eager_fp32(self, backend, rows, variant):
            check_grads(op, for_backend(backend, op_args(op, rows, torch.float32, variant)), backend)

        @pytest.mark.parametrize("backend, dtype, rows", low_precision_cases)
        def test_grads_low_precision(self, backend, dtype, rows):
            check_grads(op, for_backend(backend, frozen_tables(op, op_args(op, rows, dtype))), backend)

        @pytest.mark.parametrize("variant", VARIANTS)
        def test_gradcheck_backward_formula(self, variant):
            gradcheck_spec(op, op_args(op, 5, torch.float32, variant, small=True))

        @pytest.mark.parametrize("variant", VARIANTS)
        @pytest.mark.parametrize("backend", opcheck_backends)
        def test_opcheck_with_grad(self, backend, variant):
            opcheck_with_grad(op, backend, variant)

    return GradTests


def triton_grad_tests(op: str, backward_kernel: str) -> type:
    """The triton backward of an op with one (the Triton interpreter on CPU): its own kernels run (the torch op
    ``backward_kernel``, no aten LayerNorm backward), and its fp32 gradients at odd row counts and BERT widths, with
    and without the optional inputs, and fp16/bf16 ones at width 384."""

    class TritonGradTests:
        def test_triton_grads_fp32_odd_rows_wide(self):
            check_grads(op, ln_op_args(op, 7, 48, torch.float32), "triton")

        def test_triton_backward_runs_the_triton_kernels(self):
            check_triton_backward_kernel(op, backward_kernel)

        @pytest.mark.interpreter
        @pytest.mark.parametrize("full", [True, False], ids=VARIANTS)
        @pytest.mark.parametrize("rows, width", [(1, 48), (130, 48), (7, 384), (130, 384), (7, 768)])
        def test_triton_grads_fp32_bert_widths(self, rows, width, full):
            check_grads(op, ln_op_args(op, rows, width, torch.float32, full=full), "triton")

        @pytest.mark.interpreter
        @pytest.mark.parametrize("dtype", HALF_DTYPES)
        def test_triton_grads_half_bert_width(self, dtype):
            check_grads(op, ln_op_args(op, 130, 384, dtype), "triton")

    return TritonGradTests


def layernorm_op_tests(op: str) -> type:
    """The ops that end in a LayerNorm with dropout fused into their triton kernels (embedding_layernorm,
    linear_residual_layernorm, linear_residual_prenorm): the triton backward's dW/dB over many rows; gradcheck of
    the backward formula with dropout, the triton gradients with the forward's mask, opcheck with p > 0."""

    class LayerNormOpTests:
        @pytest.mark.interpreter
        @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
        def test_triton_weight_and_bias_grads_over_many_rows(self, dtype):
            """dW/dB summed over 1025 rows (each program's fp32 partial sums, then the second stage): within the
            rule (a reduction in bf16 would be far outside it)."""
            check_grads(op, ln_op_args(op, 1025, 48, dtype, in_features=16), "triton")

        def test_gradcheck_with_dropout(self):
            """With dropout the backward formula regenerates the forward's mask from the seed: gradcheck (the eager
            forward, perturbed, against the formula) fails for any other mask."""
            args = torch_op_args(op, op_args(op, 5, torch.float32, "full", small=True))[:-2] + (0.4, 1234)
            gradcheck_spec(op, args)

        @pytest.mark.interpreter
        @pytest.mark.parametrize("rows, width", [(7, 48), (130, 384)])
        def test_triton_dropout_grads_use_the_forward_mask(self, rows, width):
            check_triton_dropout_grads(op, rows, width)

        @pytest.mark.interpreter
        def test_triton_opcheck_with_dropout(self):
            """The torch op (schema, fake, autograd registration, AOTAutograd tracing the backward's kernel ops)
            with p > 0."""
            args = (*ln_op_args(op, 6, 48, torch.float32), 0.25, 31)
            torch.library.opcheck(backend_op("triton", op).default, args)

    return LayerNormOpTests


def activation_grad_tests(op: str) -> type:
    """The ops with an activation (linear_activation, linear_glu): gradients of the activations but gelu, the
    cpp backend's against the eager op's autograd and the spec's formula by gradcheck."""

    class ActivationGradTests:
        @pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
        def test_cpp_grads_other_activations(self, activation):
            check_grads(op, op_args(op, 33, torch.float32, activation), "cpp")

        @pytest.mark.parametrize("activation", ["gelu_tanh", "relu", "silu"])
        def test_gradcheck_other_activations(self, activation):
            gradcheck_spec(op, op_args(op, 4, torch.float32, activation, small=True))

    return ActivationGradTests


def modernbert_config(**overrides) -> ModernBertConfig:
    """A one-layer ModernBERT of odd sizes (hidden 130, intermediate 383, vocabulary 97) without dropout."""
    sizes = dict(vocab_size=97, hidden_size=130, intermediate_size=383, num_hidden_layers=1, num_attention_heads=2,
                 pad_token_id=0, mlp_dropout=0.0, embedding_dropout=0.0)
    return ModernBertConfig(**{**sizes, **overrides})


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` in eval mode with random weights everywhere (LayerNorm weights near 1), so biases and scales are
    exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    return module.eval()
