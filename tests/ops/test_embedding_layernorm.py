"""embedding_layernorm (LayerNorm of the gathered word + position + token type rows) on every backend: the forward
against fp64 references (triton's checks are `tools.op_checks`', shared with benchmarks/gpu_check.py) and against
transformers' ModernBertEmbeddings; the backward against the eager op's autograd and by gradcheck of the spec's
formula, the triton embedding backward kernel; dropout fused into the triton kernel (keep rate, scale, seeds,
gradients with the forward's mask); opcheck of the torch ops; the argument checks. On CPU the triton kernels run in
the Triton interpreter: a cheap subset is unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch
from transformers.models.modernbert.configuration_modernbert import ModernBertConfig
from transformers.models.modernbert.modeling_modernbert import ModernBertEmbeddings

from fastbert import ops
from fastbert.numerics import assert_accurate
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    FP32_GRAD_CASES,
    HALF_DTYPES,
    LOW_PRECISION_GRAD_CASES,
    OPCHECK_BACKENDS,
    assert_accurate_fp64,
    check_grads,
    check_triton_backward_kernel,
    check_triton_dropout_grads,
    check_triton_keep_rate,
    for_backend,
    frozen_tables,
    gradcheck_spec,
    ln_op_args,
    op_args,
    opcheck_with_grad,
    torch_op_args,
    triton_call,
)
from tools.op_checks import check_embedding_layernorm

OP = "embedding_layernorm"


# ------------------------------------------------------------------------------------------------- forward

def test_triton_fp16():
    check_embedding_layernorm((3, 7), 384, torch.float16)


def test_triton_strided_ids_are_read_with_their_stride():
    check_embedding_layernorm((1, 9), 64, torch.float16, strided_ids=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("ids_shape,width", [((1, 1), 1024), ((2, 7), 768), ((1, 130), 384)],
                         ids=["1x1-e1024", "2x7-e768", "1x130-e384"])
def test_triton(ids_shape, width, dtype):
    check_embedding_layernorm(ids_shape, width, dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("types", ["default", "none"])
def test_triton_token_type_variants(types):
    check_embedding_layernorm((2, 9), 128, torch.bfloat16, types=types)


@pytest.mark.interpreter
def test_triton_strided_tables_int32_ids_flat_ids():
    check_embedding_layernorm((5,), 312, torch.float16, strided_tables=True, id_dtype=torch.int32)


def test_triton_word_table_only_without_ln_bias_fp16():
    """ModernBERT's embedding: LayerNorm(word[ids]) without positions, token types or LayerNorm bias."""
    check_embedding_layernorm((3, 7), 130, torch.float16, types="none", positions=False, ln_bias=False)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("ids_shape,width", [((1, 1), 7), ((2, 7), 383), ((1, 130), 768)],
                         ids=["1x1-e7", "2x7-e383", "1x130-e768"])
@pytest.mark.parametrize("positions,ln_bias", [(False, False), (False, True), (True, False)],
                         ids=["no-positions-no-bias", "no-positions", "no-bias"])
def test_triton_optional_positions_and_ln_bias(ids_shape, width, dtype, positions, ln_bias):
    check_embedding_layernorm(ids_shape, width, dtype, types="none" if not positions else "ids", positions=positions,
                              ln_bias=ln_bias)


@pytest.mark.parametrize("dtype", CPP_DTYPES)
@pytest.mark.parametrize("width", CPP_WIDTHS)
def test_cpp(width, dtype):
    gen = torch.Generator().manual_seed(width)
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    pos = torch.randint(0, 20, (3, 7), generator=gen)
    types = torch.randint(0, 2, (3, 7), generator=gen)
    tables = [torch.randn(n, width, generator=gen) for n in (50, 20, 2)] + [
        1 + 0.1 * torch.randn(width, generator=gen), torch.randn(width, generator=gen)]
    # (token type ids, type table, positions, LayerNorm bias): BERT, no type ids, DistilBERT, ModernBERT, mixed
    variants = ((types, tables[2], True, True), (None, tables[2], True, True), (None, None, True, True),
                (None, None, False, False), (types, tables[2], False, True), (None, None, True, False))
    for token_types, type_table, positions, ln_bias in variants:
        def args(dt, token_types=token_types, type_table=type_table, positions=positions, ln_bias=ln_bias):
            return (ids, pos if positions else None, token_types, tables[0].to(dt),
                    tables[1].to(dt) if positions else None, None if type_table is None else type_table.to(dt),
                    tables[3].to(dt), tables[4].to(dt) if ln_bias else None, 1e-5)

        fast = ops.embedding_layernorm(*args(dtype), backend="cpp")
        plain = ops.embedding_layernorm_reference(*args(dtype))
        assert_accurate_fp64(fast, plain, ops.embedding_layernorm_reference(*args(torch.float64)),
                             f"emb-ln w={width} positions={positions} ln_bias={ln_bias}")


@pytest.mark.parametrize("backend", ["eager", "cpp"])
@pytest.mark.parametrize("norm_bias", [False, True], ids=["no-ln-bias", "ln-bias"])
def test_matches_modernbert_embeddings(backend, norm_bias):
    """ModernBertEmbeddings (word table + LayerNorm, no positions nor token types) is embedding_layernorm with
    position_ids, position_embeddings, token types and (for norm_bias=False) the LayerNorm bias all None."""
    config = ModernBertConfig(vocab_size=97, hidden_size=130, intermediate_size=383, num_hidden_layers=1,
                              num_attention_heads=2, pad_token_id=0, mlp_dropout=0.0, embedding_dropout=0.0,
                              norm_bias=norm_bias)
    embeddings = ModernBertEmbeddings(config)
    gen = torch.Generator().manual_seed(5)  # random weights everywhere (LayerNorm weights near 1)
    with torch.no_grad():
        for name, p in embeddings.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    embeddings.eval()
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = embeddings(input_ids=ids)
        ours = ops.embedding_layernorm(ids, None, None, embeddings.tok_embeddings.weight, None, None,
                                       embeddings.norm.weight, embeddings.norm.bias, config.norm_eps, backend=backend)
    assert_accurate(ours, expected, expected.double(), "embeddings")


def _cpp_opcheck_cases():
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (2, 5))
    pos = torch.arange(5).expand(2, 5).contiguous()
    yield (ids, pos, torch.zeros_like(ids), torch.randn(11, 7), torch.randn(6, 7), torch.randn(2, 7), torch.randn(7),
           torch.randn(7), 1e-5)
    yield (ids.int(), pos.int(), None, torch.randn(11, 7), torch.randn(6, 7), None, torch.randn(7), torch.randn(7),
           1e-12)
    yield (ids, None, None, torch.randn(11, 7), None, None, torch.randn(7), None, 1e-5)


@pytest.mark.parametrize("case", list(enumerate(_cpp_opcheck_cases())), ids=lambda c: f"case{c[0]}")
def test_cpp_opcheck_forward(case):
    torch.library.opcheck(torch.ops.fastbert.cpp_embedding_layernorm.default, case[1])


def test_cpp_op_rejects_bad_ids():
    tables = (torch.randn(5, 4), torch.randn(3, 4), None, torch.randn(4), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="input_ids holds 9, outside the vocabulary"):
        torch.ops.fastbert.cpp_embedding_layernorm(torch.tensor([[1, 9]]), torch.tensor([[0, 1]]), None, *tables)
    with pytest.raises(RuntimeError, match=r"position_ids must have input_ids' shape"):
        torch.ops.fastbert.cpp_embedding_layernorm(torch.tensor([[1, 2]]), torch.tensor([0, 1]), None, *tables)
    with pytest.raises(RuntimeError, match="position_ids holds 4294967297, outside"):  # not narrowed to int32's 1
        torch.ops.fastbert.cpp_embedding_layernorm(torch.tensor([[1, 2]], dtype=torch.int32),
                                                   torch.tensor([[0, 2**32 + 1]]), None, *tables)
    with pytest.raises(RuntimeError, match="position_ids and position_embeddings must be given together"):
        torch.ops.fastbert.cpp_embedding_layernorm(torch.tensor([[1, 2]]), None, None, *tables)
    with pytest.raises(RuntimeError, match=r"bias must be \[4\]"):
        torch.ops.fastbert.cpp_embedding_layernorm(torch.tensor([[1, 2]]), None, None, tables[0], None, None,
                                                   torch.randn(4), torch.randn(5), 1e-5)


def test_checks_name_the_bad_argument():
    ids, table = torch.randint(0, 5, (2, 3)), torch.randn(5, 4)
    with pytest.raises(ValueError, match="position_ids and position_embeddings must be given together"):
        ops.embedding_layernorm(ids, ids, None, table, None, None, torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match="LayerNorm weight/bias must be"):
        ops.embedding_layernorm(ids, None, None, table, None, None, torch.ones(4), torch.ones(3), 1e-5)


# ------------------------------------------------------------------------------------------------ backward
@pytest.mark.parametrize("variant", ["full", "none"])
@pytest.mark.parametrize("backend, rows", FP32_GRAD_CASES)
def test_grads_match_eager_fp32(backend, rows, variant):
    check_grads(OP, for_backend(backend, op_args(OP, rows, torch.float32, variant)), backend)


@pytest.mark.parametrize("backend, dtype, rows", LOW_PRECISION_GRAD_CASES)
def test_grads_low_precision(backend, dtype, rows):
    check_grads(OP, for_backend(backend, frozen_tables(OP, op_args(OP, rows, dtype))), backend)


def test_triton_grads_fp32_odd_rows_wide():
    check_grads(OP, ln_op_args(OP, 7, 48, torch.float32), "triton")


def test_triton_backward_runs_the_triton_kernels():
    check_triton_backward_kernel(OP, "fastbert::triton_embedding_layernorm_backward")


@pytest.mark.interpreter
@pytest.mark.parametrize("full", [True, False], ids=["full", "none"])
@pytest.mark.parametrize("rows, width", [(1, 48), (130, 48), (7, 384), (130, 384), (7, 768)])
def test_triton_grads_fp32_bert_widths(rows, width, full):
    check_grads(OP, ln_op_args(OP, rows, width, torch.float32, full=full), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_triton_grads_half_bert_width(dtype):
    check_grads(OP, ln_op_args(OP, 130, 384, dtype), "triton")


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_weight_and_bias_grads_over_many_rows(dtype):
    """dW/dB summed over 1025 rows (each program's fp32 partial sums, then the second stage): within the rule
    (a reduction in bf16 would be far outside it)."""
    check_grads(OP, ln_op_args(OP, 1025, 48, dtype, in_features=16), "triton")


@pytest.mark.parametrize("variant", ["full", "none"])
def test_gradcheck_backward_formula(variant):
    gradcheck_spec(OP, op_args(OP, 5, torch.float32, variant, small=True))


# ------------------------------------------------------------------------------------------------- dropout
def test_gradcheck_with_dropout():
    """With dropout the backward formula regenerates the forward's mask from the seed: gradcheck (the eager
    forward, perturbed, against the formula) fails for any other mask."""
    args = torch_op_args(OP, op_args(OP, 5, torch.float32, "full", small=True))[:-2] + (0.4, 1234)
    gradcheck_spec(OP, args)


def test_triton_same_seed_same_output_other_seed_other_output():
    args = ln_op_args(OP, 33, 48, torch.float32)
    first = triton_call(OP, args, 0.2, 5)
    assert torch.equal(first, triton_call(OP, args, 0.2, 5))
    other = triton_call(OP, args, 0.2, 6)
    assert not torch.equal(first == 0, other == 0)
    plain = triton_call(OP, args)
    assert torch.equal(plain, triton_call(OP, args, 0.0, 123))  # p = 0: the seed plays no part
    torch.testing.assert_close(plain, ops.embedding_layernorm(*args, backend="eager"), rtol=1e-5, atol=1e-5)


@pytest.mark.interpreter
@pytest.mark.parametrize("rows, width", [(7, 48), (130, 384)])
def test_triton_dropout_grads_use_the_forward_mask(rows, width):
    check_triton_dropout_grads(OP, rows, width)


@pytest.mark.interpreter
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_keep_rate_and_scaling(p):
    check_triton_keep_rate(OP, p)


# ------------------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("variant", ["full", "none"])
@pytest.mark.parametrize("backend", OPCHECK_BACKENDS)
def test_opcheck_with_grad(backend, variant):
    opcheck_with_grad(OP, backend, variant)


@pytest.mark.interpreter
def test_triton_opcheck_with_dropout():
    """The torch op (schema, fake, autograd registration, AOTAutograd tracing the backward's kernel ops) with
    p > 0."""
    args = (*ln_op_args(OP, 6, 48, torch.float32), 0.25, 31)
    torch.library.opcheck(torch.ops.fastbert.triton_embedding_layernorm.default, args)
