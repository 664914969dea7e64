"""embedding_layernorm (LayerNorm of the gathered word + position + token type rows) on every backend: the forward
against fp64 references (triton's checks are `tools.op_checks`', shared with benchmarks/gpu_check.py) and against
transformers' ModernBertEmbeddings; the backward against the eager op's autograd and by gradcheck of the spec's
formula, the triton embedding backward kernel; dropout fused into the triton kernel (keep rate, scale, seeds,
gradients with the forward's mask); opcheck of the torch ops; the argument checks. On CPU the triton kernels run in
the Triton interpreter: a cheap subset is unmarked, the rest `interpreter`."""

from __future__ import annotations

import pytest
import torch
from transformers.models.modernbert.modeling_modernbert import ModernBertEmbeddings

from fastbert import ops
from fastbert.numerics import assert_accurate
from tests.helpers import (
    ALL_DTYPES,
    CPP_DTYPES,
    CPP_WIDTHS,
    DEVICE,
    assert_accurate_fp64,
    backend_op,
    check_triton_keep_rate,
    ln_op_args,
    triton_call,
)
from tests.ops.helpers import grad_tests, layernorm_op_tests, modernbert_config, randomised, triton_grad_tests
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


def test_triton_op_past_the_width_limit_is_a_clear_error():
    """The torch op called directly (past `supports`): a row wider than one block is refused with the limit."""
    import importlib

    kernel = importlib.import_module("fastbert.kernels.embedding_layernorm")
    width = kernel.MAX_WIDTH + 1
    table = torch.zeros(2, width, dtype=torch.float16, device=DEVICE)
    ones = torch.ones(width, dtype=torch.float16, device=DEVICE)
    ids = torch.zeros(1, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=f"embedding width {width} exceeds 65536"):
        kernel.embedding_layernorm(ids, None, None, table, None, None, ones, None, 1e-12)


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
    config = modernbert_config(norm_bias=norm_bias)
    embeddings = randomised(ModernBertEmbeddings(config), seed=5)
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
    torch.library.opcheck(backend_op("cpp", "embedding_layernorm").default, case[1])


def test_cpp_op_rejects_bad_ids():
    op = backend_op("cpp", "embedding_layernorm")
    tables = (torch.randn(5, 4), torch.randn(3, 4), None, torch.randn(4), torch.randn(4), 1e-5)
    with pytest.raises(RuntimeError, match="input_ids holds 9, outside the vocabulary"):
        op(torch.tensor([[1, 9]]), torch.tensor([[0, 1]]), None, *tables)
    with pytest.raises(RuntimeError, match=r"position_ids must have input_ids' shape"):
        op(torch.tensor([[1, 2]]), torch.tensor([0, 1]), None, *tables)
    with pytest.raises(RuntimeError, match="position_ids holds 4294967297, outside"):  # not narrowed to int32's 1
        op(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([[0, 2**32 + 1]]), None, *tables)
    with pytest.raises(RuntimeError, match="position_ids and position_embeddings must be given together"):
        op(torch.tensor([[1, 2]]), None, None, *tables)
    with pytest.raises(RuntimeError, match=r"bias must be \[4\]"):
        op(torch.tensor([[1, 2]]), None, None, tables[0], None, None, torch.randn(4), torch.randn(5), 1e-5)


def test_checks_name_the_bad_argument():
    ids, table = torch.randint(0, 5, (2, 3)), torch.randn(5, 4)
    with pytest.raises(ValueError, match="position_ids and position_embeddings must be given together"):
        ops.embedding_layernorm(ids, ids, None, table, None, None, torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match="LayerNorm weight/bias must be"):
        ops.embedding_layernorm(ids, None, None, table, None, None, torch.ones(4), torch.ones(3), 1e-5)


# ------------------------------------------------------------------------------------------------ backward
TestGrads = grad_tests(OP, gemm=False)
TestTritonGrads = triton_grad_tests(OP, "fastbert::triton_embedding_layernorm_backward")
TestLayerNormOp = layernorm_op_tests(OP)  # dW/dB over many rows, and dropout


# ------------------------------------------------------------------------------------------------- dropout
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
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_keep_rate_and_scaling(p):
    check_triton_keep_rate(OP, p)
