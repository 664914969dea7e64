"""attention (packed variable-length, or padded with a key padding mask; global or in a sliding window; with dropout)
on every backend.

Forward: triton against fp64 references (the global checks are `tools.op_checks`', shared with
benchmarks/gpu_check.py), cpp and eager against the fp64 eager reference (odd lengths, strided q/k/v views, an
all-padded row); NaN/Inf at padded positions never reaching a real row. Window: the rule against transformers'
ModernBERT mask, windows 0..128 and wider than the sequence, zeros for queries whose window holds no real key.
Backward: gradients against the eager op's autograd (fp32 within 1e-5 of an fp64 reference, fp16/bf16 by
fastbert.numerics' rule), gradcheck of the spec's formula, masked keys and empty sequences, packed and padded
agreeing, the blocked recomputation, the triton backward kernels. Dropout: each backend's mask read off its output
(keep rate, 1/(1-p) scale, independence), gradients with the forward's mask. opcheck of the torch ops; the argument
checks and the cost formula. On CPU the triton kernels run in the Triton interpreter: a cheap subset is unmarked, the
rest `interpreter`."""

from __future__ import annotations

import importlib

import pytest
import torch

from fastbert import backends, cpu, ops
from fastbert.numerics import assert_accurate
from fastbert.ops.attention import attended_pairs, attention_cost
from tests.helpers import (
    ALL_DTYPES,
    DEVICE,
    DTYPE_IDS,
    HALF_DTYPES,
    OP_HEADS,
    WINDOWS,
    assert_accurate_fp64,
    attention_args,
    attention_call,
    backend_op,
    check_against_reference,
    check_grads,
    check_no_key_in_window_gives_zeros,
    check_packed_matches_padded,
    check_padding_poison,
    check_rule_matches_transformers,
    check_wide_window_is_global,
    check_window_poison,
    cu_seqlens_of,
    for_backend,
    gradcheck_spec,
    on_device,
    run_grads,
    spec_function,
    torch_op_args,
    transformers_allowed,
)
from tools.op_checks import check_packed, check_padded

attention_spec = importlib.import_module("fastbert.ops.attention")  # (fastbert.ops.attention: the function)
cpp = importlib.import_module("fastbert.backends.cpp")  # imports without its extension (the fixture below fails)

HEAD_DIMS = [32, 64, 80, 96, 128]
INTERPRETER = pytest.mark.interpreter
# the NaN q rows at padded query positions make numpy's matmul warn (triton in the interpreter); those rows' outputs
# are unspecified
NAN_MATMUL = pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")


@pytest.fixture(autouse=True)
def _backends_loaded(request):
    """The backend a test names (its `backend` parameter, or the `cpp`/`triton` in its name) loaded, or the reason it
    did not as the failure: a missing extension or triton fails these tests, never skips them."""
    backend = request.node.callspec.params.get("backend") if hasattr(request.node, "callspec") else None
    name = request.node.originalname
    wanted = {backend} | {b for b in ("cpp", "triton") if f"_{b}_" in f"_{name}_"}
    if "cpp" in wanted and cpp.EXTENSION_ERROR is not None:
        pytest.fail(cpp.EXTENSION_ERROR)
    if "triton" in wanted and backends.available()["triton"] is not None:
        pytest.fail(backends.available()["triton"])



# ============================================================================================== forward, global
def test_triton_packed_fp16_lengths_1_7_130():
    check_packed([1, 7, 130], heads=2, head_dim=64, dtype=torch.float16)


def test_triton_padded_fp16_all_but_one_row_padded_and_a_fully_masked_row():
    check_padded([20, 3, 1, 0], seqlen=20, heads=2, head_dim=32, dtype=torch.float16)


def test_triton_packed_bf16_head_dim_80_padded_to_the_block():
    check_packed([7, 1, 70], heads=2, head_dim=80, dtype=torch.bfloat16)


def test_triton_unsupported_head_dim_reason():
    q = torch.zeros(4, 2, 12, dtype=torch.float16, device=DEVICE)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    reason = backends.why_not("attention", "triton", q, q, q, cu_seqlens, 4, None, None)
    assert reason is not None and "head_dim 12 not supported" in reason
    with pytest.raises(backends.BackendUnavailable, match="head_dim 12"):
        ops.attention(q, q, q, cu_seqlens=cu_seqlens, max_seqlen=4, backend="triton")
    kernel = importlib.import_module("fastbert.kernels.attention")  # the torch op, past `supports`: a clear error
    with pytest.raises(ValueError, match="head_dim 12 not supported"):
        kernel.attention(q, q, q, cu_seqlens=cu_seqlens, max_seqlen=4)
    many = torch.arange(kernel.MAX_GRID_BATCH + 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds 65535 sequences"):
        kernel.attention(q[:, :, :8], q[:, :, :8], q[:, :, :8], cu_seqlens=many, max_seqlen=1)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_triton_packed_head_dims(head_dim, dtype):
    check_packed([7, 1, 130], heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("head_dim", [8, 48, 256])
def test_triton_packed_other_head_dims(head_dim):
    check_packed([5, 40], heads=2, head_dim=head_dim, dtype=torch.float16)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_triton_padded_head_dims(head_dim, dtype):
    check_padded([130, 7, 1, 0], seqlen=130, heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("heads,head_dim", [(6, 64), (12, 64), (16, 64)], ids=["h6", "h12", "h16"])
def test_triton_packed_bert_head_counts(heads, head_dim):
    check_packed([7, 33], heads=heads, head_dim=head_dim, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_triton_padded_without_mask_and_custom_scale():
    check_padded([9, 9], seqlen=9, heads=3, head_dim=32, dtype=torch.float16, with_mask=False)
    check_packed([9, 4], heads=3, head_dim=32, dtype=torch.float16, scale=0.3)


@pytest.mark.interpreter
def test_triton_single_token_sequences():
    check_packed([1, 1, 1], heads=2, head_dim=32, dtype=torch.float16)
    check_padded([1, 0], seqlen=1, heads=2, head_dim=32, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_triton_long_sequence_1024():
    check_packed([1024], heads=1, head_dim=64, dtype=torch.float16)


@pytest.mark.interpreter
@pytest.mark.slow
def test_triton_long_sequence_4096():
    check_packed([4096, 5], heads=1, head_dim=32, dtype=torch.bfloat16)


@pytest.mark.interpreter
def test_triton_long_sequence_520():
    check_packed([520, 3], heads=1, head_dim=64, dtype=torch.bfloat16)


def _qkv_views(batch_shape, heads, dim, dtype, gen):
    """q, k, v as the strided views qkv_projection returns (one [..., 3, heads, dim] buffer)."""
    packed = torch.randn(*batch_shape, 3, heads, dim, generator=gen).to(dtype)
    return packed.unbind(-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dim", (1, 7, 32, 64))
def test_cpp_packed(dim, dtype):
    """Lengths 1, 7, 130, 383 (past one query chunk and one key block) plus an empty sequence, strided views."""
    gen = torch.Generator().manual_seed(dim)
    lengths = [1, 7, 0, 130, 383]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv_views((sum(lengths),), 2, dim, dtype, gen)
    kwargs = dict(cu_seqlens=cu, max_seqlen=max(lengths), scale=None)
    fast = ops.attention(q, k, v, **kwargs, backend="cpp")
    assert fast.is_contiguous()
    plain = ops.attention(q, k, v, **kwargs, backend="eager")
    reference = ops.attention(q.double(), k.double(), v.double(), **kwargs, backend="eager")
    assert_accurate_fp64(fast, plain, reference, f"packed D={dim}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqlen", (1, 7, 130, 383))
def test_cpp_padded(seqlen, dtype):
    """Key padding mask with holes and an all-padded row (-> zeros), q/k/v strided, an explicit scale."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v = _qkv_views((3, seqlen), 3, 16, dtype, gen)
    mask = torch.rand(3, seqlen, generator=gen) > 0.3
    mask[0, 0] = True
    mask[1] = False
    for key_padding_mask in (mask, None):
        kwargs = dict(key_padding_mask=key_padding_mask, scale=0.2)
        fast = ops.attention(q, k, v, **kwargs, backend="cpp")
        plain = ops.attention(q, k, v, **kwargs, backend="eager")
        reference = ops.attention(q.double(), k.double(), v.double(), **kwargs, backend="eager")
        assert_accurate_fp64(fast, plain, reference, f"padded S={seqlen}")
    assert torch.equal(ops.attention(q, k, v, key_padding_mask=mask, backend="cpp")[1], torch.zeros_like(q[1]))


def test_cpp_bf16_attention_kernel_follows_the_cpu():
    """AMX tiles where the CPU has AMX-BF16, vdpbf16ps register tiles where it has AVX512-BF16 without AMX (both
    in an AVX-512 build, at even head dims up to 256); the vector kernel at odd or larger dims and on every other
    CPU (whose bf16 calls the other tests here then check)."""
    flags = cpu.cpu_info()[1]
    avx512 = cpp.compiled_capability() == "AVX512"
    expected = ("amx" if cpu.AMX_BF16 in flags else "avx512_bf16") if avx512 and "avx512_bf16" in flags else "vector"
    assert cpp.bf16_attention_kernel(2) == expected
    assert cpp.bf16_attention_kernel(32) == expected
    assert cpp.bf16_attention_kernel(256) == expected
    assert cpp.bf16_attention_kernel(7) == "vector"
    assert cpp.bf16_attention_kernel(258) == "vector"


@pytest.mark.parametrize("dim", (2, 32, 48, 130, 256))
def test_cpp_bf16_key_blocks_and_row_padding(dim):
    """Lengths around the bf16 kernels' key block (256), key padding (32) and row padding (32 on AMX, 8 on
    AVX512-BF16): one key, 7-9, 31-33, 255-257 and 600 (three blocks, the online softmax rescaling twice), strided
    views, against fp64 by the numerics rule; head dims that fill the AVX512-BF16 tiles' 32 columns partly (2, 48,
    130) and the largest (256)."""
    gen = torch.Generator().manual_seed(dim)
    lengths = [1, 7, 8, 9, 31, 33, 255, 256, 257, 600]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv_views((sum(lengths),), 2, dim, torch.bfloat16, gen)
    kwargs = dict(cu_seqlens=cu, max_seqlen=max(lengths), scale=None)
    fast = ops.attention(q, k, v, **kwargs, backend="cpp")
    plain = ops.attention(q, k, v, **kwargs, backend="eager")
    reference = ops.attention(q.double(), k.double(), v.double(), **kwargs, backend="eager")
    assert_accurate_fp64(fast, plain, reference, f"packed bf16 D={dim}")


@pytest.mark.parametrize("scale", (-40.0, 40.0), ids=("negative", "positive"))
def test_cpp_bf16_unusual_scales(scale):
    """Scales that spread the scores over thousands, so that most probabilities underflow to 0: positive, and
    negative (the bf16 kernels take positive ones; others run the vector kernel): finite, and accurate by the
    numerics rule."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 64, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _qkv_views((sum(lengths),), 2, 64, torch.bfloat16, gen)
    kwargs = dict(cu_seqlens=cu, max_seqlen=max(lengths), scale=scale)
    fast = ops.attention(q, k, v, **kwargs, backend="cpp")
    assert torch.isfinite(fast).all()
    plain = ops.attention(q, k, v, **kwargs, backend="eager")
    reference = ops.attention(q.double(), k.double(), v.double(), **kwargs, backend="eager")
    assert_accurate_fp64(fast, plain, reference, f"packed bf16 scale={scale}")


# ------------------------------------------------------------------------------------------- padding poison
def _poison_cases():
    """(backend, dtype, head_dim): eager and cpp on CPU, triton in the interpreter (its masked keys' K and V are
    never loaded, so NaN/Inf there cannot leak as 0 * NaN); cpp also at an odd head_dim."""
    cases = [pytest.param("eager", dtype, d, id=f"eager-{DTYPE_IDS[dtype]}-d{d}")
             for dtype in (torch.float32, torch.bfloat16) for d in (8, 16)]
    cases += [pytest.param("cpp", dtype, d, id=f"cpp-{DTYPE_IDS[dtype]}-d{d}")
              for dtype in (torch.float32, torch.bfloat16) for d in (7, 8, 16)]
    cases += [pytest.param("triton", dtype, d, id=f"triton-{DTYPE_IDS[dtype]}-d{d}", marks=INTERPRETER)
              for dtype in (torch.float32, torch.float16) for d in (8, 16)]
    return cases


@NAN_MATMUL
@pytest.mark.parametrize("backend, dtype, head_dim", _poison_cases())
def test_nan_and_inf_at_padded_positions_never_reach_real_rows(backend, dtype, head_dim):
    check_padding_poison(backend, dtype, head_dim, device=DEVICE if backend == "triton" else "cpu")


# ======================================================================================================= window
def _rule_cases():
    cases = [pytest.param(b, w, id=f"{b}-w{w}") for b in ("eager", "cpp") for w in WINDOWS + (3, 24, 25)]
    # triton: the odd window 7 (half 3) and the even 16 (half 8) unmarked, the other widths in the interpreter grid
    cases += [pytest.param("triton", w, id=f"triton-w{w}") for w in (7, 16)]
    cases += [pytest.param("triton", w, id=f"triton-w{w}", marks=INTERPRETER) for w in (0, 1, 2, 128)]
    return cases


@pytest.mark.parametrize("backend, window", _rule_cases())
def test_window_rule_matches_transformers_modernbert_mask(backend, window):
    """Which keys each query attends (probed through the output) equals transformers' ModernBERT mask: padded with
    holes and an all-padding row, packed lengths 1, 7, 13."""
    check_rule_matches_transformers(backend, window, device=DEVICE if backend == "triton" else "cpu")


def test_window_rule_matches_a_transformers_modernbert_layer():
    """A ModernBERT local attention layer (sdpa) and fastbert's attention on its q, k, v give the same context."""
    from transformers import ModernBertConfig
    from transformers.models.modernbert import modeling_modernbert as mb

    torch.manual_seed(0)
    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, local_attention=6, num_hidden_layers=2,
                              global_attn_every_n_layers=2, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    layer = mb.ModernBertAttention(config, layer_idx=1).eval()
    assert layer.sliding_window is not None, "layer 1 must be a local layer"
    seqlen = 19
    hidden = torch.randn(2, seqlen, 32)
    attention_mask = torch.ones(2, seqlen, dtype=torch.long)
    attention_mask[1, 12:] = 0
    mask = transformers_allowed(6, attention_mask)[:, None]
    position_embeddings = mb.ModernBertRotaryEmbedding(config)(hidden, torch.arange(seqlen)[None], "sliding_attention")
    captured = {}

    def capture(module, args, kwargs, output):
        captured["context"] = output[0]

    with torch.no_grad():
        handle = layer.register_forward_hook(capture, with_kwargs=True)
        layer(hidden, position_embeddings=position_embeddings, attention_mask=mask)
        handle.remove()
        q, k, v = layer.Wqkv(hidden).view(2, seqlen, 3, 2, 16).unbind(2)
        cos, sin = position_embeddings
        q, k = mb.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        ours = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v, key_padding_mask=attention_mask.bool(),
                             window=6, backend="eager")
        expected = captured["context"]
        real = attention_mask.bool()
        torch.testing.assert_close(layer.Wo(ours.reshape(2, seqlen, 32))[real], expected[real], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_window_packed_against_reference(dtype, window):
    """Lengths 1, 7, an empty sequence, 130 and 383 (past one query chunk and one key block), strided views."""
    check_against_reference("cpp", dtype, window, [1, 7, 0, 130, 383])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_window_padded_against_reference(dtype, window):
    check_against_reference("cpp", dtype, window, [130, 7, 1, 0], form="padded", scale=0.3)


@pytest.mark.parametrize("head_dim", (1, 7, 64, 80), ids=lambda d: f"d{d}")
def test_cpp_head_dims_with_a_window(head_dim):
    check_against_reference("cpp", torch.float32, 16, [300, 7], head_dim=head_dim)


def test_cpp_long_sequence_window_128():
    """S = 1024, ModernBERT's window: many query chunks and key blocks, each item reading only its band."""
    check_against_reference("cpp", torch.float32, 128, [1024, 333], heads=2, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_window_padded_with_holes_against_reference(dtype):
    """A key padding mask with holes: the window counts padded positions, the kernel walks the real keys' list."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 800, 3, 2, 16, generator=gen).to(dtype).unbind(2)
    mask = torch.rand(3, 800, generator=gen) > 0.6
    mask[2, 100:] = False
    for window in (2, 16, 128, 600):  # 600: over 256 real keys per work item, whose softmax crosses key blocks
        kwargs = {"key_padding_mask": mask, "window": window}
        fast = ops.attention(q, k, v, backend="cpp", **kwargs)
        plain = ops.attention(q, k, v, backend="eager", **kwargs)
        reference = ops.attention(q.double(), k.double(), v.double(), backend="eager", **kwargs)
        assert_accurate_fp64(fast, plain, reference, f"cpp {dtype} holes window={window}")


@pytest.mark.parametrize("dim", (2, 48, 64, 256))
def test_cpp_bf16_window_tiles_across_key_blocks(dim):
    """bf16 with a window (on AVX512-BF16, register tiles that compute only the columns their rows' windows reach):
    sequences of 600 and 1,024 keys whose tiles' bands straddle the 256-key blocks and the 256-row query chunks,
    odd and even windows, head dims that fill the 32-column tiles partly (2, 48) and the largest (256)."""
    for window in (7, 128, 300):
        check_against_reference("cpp", torch.bfloat16, window, [600, 9, 1024], head_dim=dim, heads=1)


def test_triton_window_packed_fp16_lengths_1_7_130():
    check_against_reference("triton", torch.float16, 16, [1, 7, 130], head_dim=64, device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [1, 2, 7, 16, 128], ids=lambda w: f"w{w}")
def test_triton_window_packed(window, dtype):
    check_against_reference("triton", dtype, window, [1, 7, 130], head_dim=64, device=DEVICE)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("window", [2, 7, 128], ids=lambda w: f"w{w}")
def test_triton_window_padded(window, dtype):
    """Right padding and an all-padding row (zeros), an explicit scale."""
    check_against_reference("triton", dtype, window, [130, 7, 1, 0], head_dim=32, form="padded", device=DEVICE,
                            scale=0.3)


@pytest.mark.interpreter
def test_triton_window_128_over_a_long_sequence():
    """S = 520 with blocks of 64: query blocks in the middle skip whole key blocks on both sides."""
    check_against_reference("triton", torch.bfloat16, 128, [520, 3], heads=1, head_dim=64, device=DEVICE)


def _agree_cases():
    cases = [pytest.param(b, w, [1, 7, 130, 300], id=f"{b}-w{w}") for b in ("eager", "cpp") for w in (1, 7, 128)]
    return cases + [pytest.param("triton", 7, [1, 7, 70], id="triton-w7", marks=INTERPRETER)]


@pytest.mark.parametrize("backend, window, lengths", _agree_cases())
def test_window_packed_and_padded_agree(backend, window, lengths):
    check_packed_matches_padded(backend, torch.float32, window, lengths,
                                device=DEVICE if backend == "triton" else "cpu")


def _wide_cases():
    cases = [pytest.param(b, torch.float32, s, id=f"{b}-S{s}") for b in ("eager", "cpp") for s in (1, 2, 7, 130)]
    cases += [pytest.param("cpp", torch.bfloat16, s, id=f"cpp-bf16-S{s}") for s in (2, 130, 300)]
    return cases + [pytest.param("triton", torch.float16, s, id=f"triton-S{s}", marks=INTERPRETER) for s in (1, 7, 130)]


@pytest.mark.parametrize("backend, dtype, seqlen", _wide_cases())
def test_window_wider_than_the_sequence_is_global(backend, dtype, seqlen):
    check_wide_window_is_global(backend, dtype, seqlen, device=DEVICE if backend == "triton" else "cpu")


@NAN_MATMUL
@pytest.mark.parametrize("backend, dtype", [pytest.param("eager", torch.float32, id="eager-fp32"),
                                            pytest.param("cpp", torch.float32, id="cpp-fp32"),
                                            pytest.param("cpp", torch.bfloat16, id="cpp-bf16"),
                                            pytest.param("triton", torch.float16, id="triton-fp16")])
def test_query_without_a_real_key_in_its_window_gives_zeros(backend, dtype):
    check_no_key_in_window_gives_zeros(backend, dtype, device=DEVICE if backend == "triton" else "cpu")


@pytest.mark.parametrize("window", [None, 6], ids=["global", "w6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_nan_in_a_real_query_comes_out_as_nan(dtype, window):
    """NaN in a real query's row is NaN in its output, as in plain PyTorch (zeros would hide a diverged model);
    the other rows stay finite."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(20, 3, 2, 64, generator=gen).to(dtype).unbind(1)
    q = q.clone()
    q[5, 1] = float("nan")
    cu = torch.tensor([0, 20], dtype=torch.int32)
    out = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=20, window=window, backend="cpp")
    assert out[5, 1].isnan().all()
    assert torch.isfinite(out[:5]).all() and torch.isfinite(out[6:]).all() and torch.isfinite(out[5, 0]).all()


def _window_poison_cases():
    cases = [pytest.param(b, dtype, w, id=f"{b}-{DTYPE_IDS[dtype]}-w{w}") for b in ("eager", "cpp")
             for dtype in (torch.float32, torch.bfloat16) for w in (2, 7, 128)]
    cases.append(pytest.param("triton", torch.float32, 7, id="triton-fp32-w7"))
    return cases + [pytest.param("triton", dtype, 2, id=f"triton-{DTYPE_IDS[dtype]}-w2", marks=INTERPRETER)
                    for dtype in (torch.float16, torch.bfloat16)]


@NAN_MATMUL
@pytest.mark.parametrize("backend, dtype, window", _window_poison_cases())
def test_window_nan_and_inf_at_masked_keys_never_reach_real_rows(backend, dtype, window):
    check_window_poison(backend, dtype, window, device=DEVICE if backend == "triton" else "cpu")


def test_eager_window_is_differentiable():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 9, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    torch.autograd.gradcheck(lambda q, k, v: ops.attention(q, k, v, key_padding_mask=mask, window=4,
                                                           backend="eager")[mask], (q, k, v), fast_mode=True)


# ===================================================================================== eager, packed form
def _packed_qkv(lengths, dtype, heads=3, head_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen).to(dtype)
    return (*qkv.unbind(1), cu_seqlens_of(lengths))  # strided views of one buffer, as qkv_projection returns


def _padded_eager(monkeypatch, q, k, v, cu, max_seqlen, window=None):
    """The eager packed form as it runs on CUDA and under tracing: padded to the longest sequence, one masked SDPA."""
    with monkeypatch.context() as patch:
        patch.setattr(attention_spec, "runs_per_sequence", lambda q, cu_seqlens: False)
        return ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, window=window, backend="eager")


@pytest.mark.parametrize("window", [None, 7], ids=["global", "w7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_packed_runs_one_unmasked_sdpa_per_run_of_one_length(monkeypatch, dtype, window):
    """On CPU the eager packed form calls SDPA once per run of consecutive non-empty sequences of one length, on
    their rows alone (no padded row, no mask without a window), and gives what the padded computation gives, within
    the dtype rule."""
    lengths = [1, 0, 7, 7, 0, 7, 130, 3, 3]
    q, k, v, cu = _packed_qkv(lengths, dtype)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[0], query.shape[2], attn_mask is None))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    out = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=130, window=window, backend="eager")
    monkeypatch.undo()
    runs = [(1, 1), (3, 7), (1, 130), (2, 3)]  # (sequences, length): empty sequences join the runs around them
    assert calls == [(count, n, window is None or window // 2 >= n - 1) for count, n in runs]
    assert out.shape == q.shape and out.is_contiguous()
    padded = _padded_eager(monkeypatch, q, k, v, cu, 130, window)
    reference = attention_spec.attention_reference(q.double(), k.double(), v.double(), cu_seqlens=cu,
                                                   max_seqlen=130, window=window)
    assert_accurate(out, padded, reference, what=f"eager packed {DTYPE_IDS[dtype]}")


def test_eager_packed_many_short_sequences_take_one_padded_call(monkeypatch):
    lengths = [2, 3] * 20  # 40 runs of 2.5 tokens on average
    q, k, v, cu = _packed_qkv(lengths, torch.float32)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append(tuple(query.shape))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    out = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=3, backend="eager")
    monkeypatch.undo()
    assert calls == [(40, 3, 3, 8)]  # [sequences, heads, longest, D]
    torch.testing.assert_close(out, _padded_eager(monkeypatch, q, k, v, cu, 3))
    reference = attention_spec.attention_reference(q.double(), k.double(), v.double(), cu_seqlens=cu, max_seqlen=3)
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


def test_eager_packed_many_short_sequences_and_a_long_one_stay_per_run(monkeypatch):
    """Padding 41 sequences to one of 64 tokens would cost 41 x 64^2: the runs are called one by one."""
    q, k, v, cu = _packed_qkv([1, 2] * 20 + [64], torch.float32)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(query, key, value, attn_mask=None, **kwargs):
        calls.append(query.shape[2])
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    out = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=64, backend="eager")
    monkeypatch.undo()
    assert calls == [1, 2] * 20 + [64]
    torch.testing.assert_close(out, _padded_eager(monkeypatch, q, k, v, cu, 64))


def test_eager_packed_gradients_equal_the_padded_form(monkeypatch):
    q, k, v, cu = _packed_qkv([5, 0, 1, 12], torch.float64, seed=4)
    grad = torch.randn(q.shape, dtype=torch.float64)
    results = []
    for run in (lambda *t: ops.attention(*t, cu_seqlens=cu, max_seqlen=12, window=6, backend="eager"),
                lambda *t: _padded_eager(monkeypatch, *t, cu, 12, window=6)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(grad)
        results.append([out.detach(), *(t.grad for t in leaves)])
    for per_sequence, padded in zip(*results, strict=True):
        torch.testing.assert_close(per_sequence, padded, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bounds", [[0, 3, 8], [1, 4, 9], [0, 6, 4, 9]], ids=["short", "offset", "decreasing"])
def test_eager_packed_bad_bounds_are_a_value_error(bounds):
    q = torch.randn(9, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to total_tokens=9"):
        ops.attention(q, q, q, cu_seqlens=torch.tensor(bounds, dtype=torch.int32), max_seqlen=6, backend="eager")


# ======================================================================================== calls and checks
def test_seven_argument_calls_still_run_global_attention():
    """The model's `table.attention(q, k, v, cu_seqlens, max_seqlen, mask, scale)` (no window) on every backend."""
    q, k, v = torch.randn(9, 3, 2, 8).unbind(1)
    cu = cu_seqlens_of([4, 5])
    expected = ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=5, backend="eager")
    for backend in ("eager", "cpp"):
        table = backends.OpTable(backend)
        torch.testing.assert_close(table.attention(q, k, v, cu, 5, None, None), expected)
        torch.testing.assert_close(backends.dispatch("attention", backend, q, k, v, cu, 5, None, None), expected)
    torch.testing.assert_close(backend_op("cpp", "attention")(q, k, v, cu, 5, None, None), expected)


@pytest.mark.parametrize("window", [-1, 2.0, True, "8"], ids=["negative", "float", "bool", "str"])
def test_bad_window_is_a_value_error(window):
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="window must be None .global. or an int >= 0"):
        ops.attention(q, q, q, window=window)


def test_cpp_op_rejects_a_negative_window():
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        backend_op("cpp", "attention")(q, q, q, None, None, None, None, -2)


def test_triton_launcher_rejects_a_negative_window():
    q = torch.zeros(1, 4, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="window must be >= 0"):
        backend_op("triton", "attention")(q, q, q, None, None, None, None, -1)


def test_cpp_op_rejects_bad_inputs():
    op = backend_op("cpp", "attention")
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match=r"key_padding_mask must be bool \[2, 4\]"):
        op(q, q, q, None, None, torch.ones(2, 4), None)
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to total_tokens=8"):
        op(q.view(8, 1, 8), q.view(8, 1, 8), q.view(8, 1, 8), torch.tensor([0, 3, 5], dtype=torch.int32), 4, None, None)
    with pytest.raises(RuntimeError, match="more than max_seqlen=4"):
        op(q.view(8, 1, 8), q.view(8, 1, 8), q.view(8, 1, 8), torch.tensor([0, 3, 8], dtype=torch.int32), 4, None, None)


# ------------------------------------------------------------------------------------------------- cost
@pytest.mark.parametrize("seqlen", (0, 1, 2, 7, 130, 1024))
@pytest.mark.parametrize("window", (None, 0, 1, 2, 7, 128, 5000))
def test_attended_pairs_counts_the_band(seqlen, window):
    positions = torch.arange(seqlen)
    band = torch.ones(seqlen, seqlen, dtype=torch.bool)
    if window is not None:
        band = (positions[:, None] - positions[None, :]).abs() <= window // 2
    assert attended_pairs(seqlen, window) == int(band.sum())


def test_attention_cost_with_a_window():
    assert attention_cost([2, 3], 4, 8, 2) == attention_cost([2, 3], 4, 8, 2, window=None)
    local = attention_cost([1024], 12, 64, 2, window=128)
    assert local.flops == 4 * (1024 * 129 - 64 * 65) * 12 * 64
    assert local.bytes == attention_cost([1024], 12, 64, 2).bytes


# ===================================================================================================== backward
def _grad_cases():
    """(backend, form, lengths, window): cpp over odd lengths and windows 0..8, triton in the interpreter over two
    grids (a cheap case unmarked)."""
    def name(backend, form, lengths, window):
        return f"{backend}-{form}-{'-'.join(map(str, lengths))}-w{window}"

    cases = [pytest.param("cpp", form, lengths, window, id=name("cpp", form, lengths, window))
             for form in ("packed", "padded") for lengths in ([1], [7, 3], [130, 1, 64]) for window in (None, 0, 3, 8)]
    cases.append(pytest.param("triton", "packed", [7, 3], 2, id=name("triton", "packed", [7, 3], 2)))
    cases.append(pytest.param("triton", "packed", [1, 7, 13], None, id=name("triton", "packed", [1, 7, 13], None)))
    grids = ((([1], [7], [13, 1, 7], [130, 7, 0]), (None, 3, 16)), (([1], [9, 0, 4]), (None, 3)))
    for lengths_grid, windows in grids:
        cases += [pytest.param("triton", form, lengths, window, id=name("triton", form, lengths, window),
                               marks=INTERPRETER)
                  for form in ("packed", "padded") for lengths in lengths_grid for window in windows]
    return cases


@pytest.mark.parametrize("backend, form, lengths, window", _grad_cases())
def test_grads_match_eager_fp32(backend, form, lengths, window):
    check_grads("attention", for_backend(backend, attention_args(form, lengths, window=window)), backend,
                call=attention_call)


@pytest.mark.parametrize("form", ["packed", "padded"])
def test_cpp_grads_bf16_and_explicit_scale(form):
    check_grads("attention", attention_args(form, [9, 4], torch.bfloat16, scale=0.3), "cpp", call=attention_call)
    check_grads("attention", attention_args(form, [9, 4], torch.float32, scale=0.3, window=2), "cpp",
                call=attention_call)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_triton_grads_half_window_4(form, dtype):
    check_grads("attention", on_device(attention_args(form, [9, 4], dtype, window=4)), "triton", call=attention_call)


@pytest.mark.interpreter
def test_triton_grads_fp32_explicit_scale_and_head_dim_80():
    check_grads("attention", on_device(attention_args("padded", [13, 7], scale=0.3, head_dim=80)), "triton",
                call=attention_call)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 16], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_triton_grads_half_head_dim_64(form, dtype, window):
    check_grads("attention", on_device(attention_args(form, [70, 13, 1], dtype, window=window, head_dim=64)),
                "triton", call=attention_call)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_all_masked_rows_give_finite_zero_grads(backend, window):
    """A sequence with no real key (length 0 padded, or an empty packed one) and padded queries whose window holds
    no key: their outputs are zeros, so are the gradients they send, and nothing is NaN."""
    q, k, v, _, _, mask, _, _ = attention_args("padded", [6, 0, 2])
    grads = run_grads(lambda *a: attention_call(backend)(*a), (q, k, v, None, None, mask, None, window))
    for g in grads:
        assert torch.isfinite(g).all()
        assert torch.all(g[1] == 0)  # the sequence without keys
    packed = attention_args("packed", [6, 0, 2], window=window)
    for g in run_grads(lambda *a: attention_call(backend)(*a), packed):
        assert torch.isfinite(g).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 2], ids=lambda w: f"w{w}")
def test_triton_packed_sequence_without_tokens_gets_no_gradient_and_no_nan(window):
    args = on_device(attention_args("packed", [6, 0, 2], window=window))
    for g in run_grads(attention_call("triton"), args):
        assert torch.isfinite(g).all()
    check_grads("attention", args, "triton", call=attention_call)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("backend", ["eager", "cpp"])
def test_nan_at_masked_keys_reaches_no_gradient(backend, window):
    """NaN stored in k and v at masked keys: the gradients are those of zeros stored there (zeros at the masked
    keys themselves), on every real position."""
    q, k, v, _, _, mask, _, _ = attention_args("padded", [9, 5, 2])
    poisoned_k = k.detach().masked_fill(~mask[:, :, None, None], float("nan")).requires_grad_()
    poisoned_v = v.detach().masked_fill(~mask[:, :, None, None], float("nan")).requires_grad_()
    zeroed_k = k.detach().masked_fill(~mask[:, :, None, None], 0.0).requires_grad_()
    zeroed_v = v.detach().masked_fill(~mask[:, :, None, None], 0.0).requires_grad_()
    call = attention_call(backend)

    def grads(k_, v_):
        def fn(q_, k__, v__):  # upstream gradients only at real query rows: padded rows are unspecified outputs
            return call(q_, k__, v__, None, None, mask, None, window) * mask[:, :, None, None]
        return run_grads(fn, (q, k_, v_))

    poisoned, clean = grads(poisoned_k, poisoned_v), grads(zeroed_k, zeroed_v)
    for p, c in zip(poisoned, clean, strict=True):
        assert torch.isfinite(p).all()
        assert torch.equal(p, c)
    assert torch.all(poisoned[1][~mask] == 0) and torch.all(poisoned[2][~mask] == 0)


def _poisoned(tensor: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """A leaf copy of [B, S, h, D] ``tensor`` with ``value`` at the masked keys."""
    return tensor.detach().masked_fill(~mask[:, :, None, None], value).requires_grad_()


def _check_triton_masked_keys_and_empty_rows(window: int | None) -> None:
    """Padded [9, 0, 5]: NaN stored in k and v at masked keys gives the gradients of zeros stored there (finite, zero
    at the masked keys); the sequence without keys gets zero gradients."""
    q, k, v, _, _, mask, _, _ = on_device(attention_args("padded", [9, 0, 5]))
    real_rows = mask[:, :, None, None]

    def grads(k_, v_):  # upstream gradients at real query rows only (padded rows' outputs are unspecified)
        return run_grads(lambda *a: attention_call("triton")(*a, None, None, mask, None, window) * real_rows,
                         (q, k_, v_))

    dirty = grads(_poisoned(k, mask, float("nan")), _poisoned(v, mask, float("nan")))
    clean = grads(_poisoned(k, mask, 0.0), _poisoned(v, mask, 0.0))
    for name, d, c in zip("qkv", dirty, clean, strict=True):
        assert torch.isfinite(d).all(), name
        assert torch.equal(d, c), name
        assert torch.all(d[1] == 0), f"d{name} of the sequence without keys"
    assert torch.all(dirty[1][~mask] == 0) and torch.all(dirty[2][~mask] == 0)


def test_triton_padded_nan_at_masked_keys_and_a_sequence_without_keys_window_3():
    _check_triton_masked_keys_and_empty_rows(window=3)


@pytest.mark.interpreter
def test_triton_nan_at_masked_keys_global():
    _check_triton_masked_keys_and_empty_rows(window=None)


@pytest.mark.parametrize("window", [None, 4])
def test_cpp_packed_and_padded_grads_agree(window):
    """The same sequences packed and padded (upstream gradients zero at padded query rows): one set of gradients
    at the real tokens."""
    lengths = [11, 3, 7]
    packed = attention_args("packed", lengths, window=window)
    padded = attention_args("padded", lengths, window=window, seed=5)
    mask = padded[5]
    with torch.no_grad():  # the packed tokens in the padded layout
        for t_packed, t_padded in zip(packed[:3], padded[:3], strict=True):
            t_padded[mask] = t_packed
    seed_gen = torch.Generator().manual_seed(3)
    upstream = torch.randn(packed[0].shape, generator=seed_gen)
    spread = torch.zeros(padded[0].shape)
    spread[mask] = upstream
    call = attention_call("cpp")
    packed_grads = torch.autograd.grad((call(*packed) * upstream).sum(), packed[:3])
    padded_grads = torch.autograd.grad((call(*padded) * spread).sum(), padded[:3])
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert_accurate(b[mask], b[mask], a, what="padded vs packed")


@pytest.mark.interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("window", [None, 4], ids=lambda w: f"w{w}")
def test_triton_packed_and_padded_agree(window, dropout_p):
    """The same sequences packed and padded (upstream gradients zero at padded query rows): one output and one set of
    gradients at the real tokens; with dropout too, since both forms index the mask by (sequence, head, query, key)."""
    lengths = [11, 3, 7]
    packed = on_device(attention_args("packed", lengths, window=window))
    padded = on_device(attention_args("padded", lengths, window=window, seed=5))
    mask = padded[5]
    with torch.no_grad():
        for t_packed, t_padded in zip(packed[:3], padded[:3], strict=True):
            t_padded[mask] = t_packed
    upstream = torch.randn(packed[0].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    spread = torch.zeros(padded[0].shape, device=DEVICE)
    spread[mask] = upstream
    out_packed = attention_call("triton")(*packed, dropout_p, 9)
    out_padded = attention_call("triton")(*padded, dropout_p, 9)
    real = out_padded.detach()[mask]
    assert_accurate(real, real, out_packed.detach(), what="padded vs packed output")
    packed_grads = torch.autograd.grad((out_packed * upstream).sum(), packed[:3])
    padded_grads = torch.autograd.grad((out_padded * spread).sum(), padded[:3])
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert_accurate(b[mask], b[mask], a, what="padded vs packed gradients")


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_backward_in_blocks_equals_one_block(monkeypatch, form, window):
    """The spec's blocked recomputation (sequences and query rows in chunks) gives the gradients of one block."""
    args = attention_args(form, [13, 9, 4], window=window)
    via_spec = spec_function("attention")

    def call(*a):
        return via_spec.apply(*torch_op_args("attention", a))

    whole = run_grads(call, args)
    monkeypatch.setattr(attention_spec, "BACKWARD_BLOCK_ELEMENTS", OP_HEADS * 13 * 3)  # 3 query rows, 1 sequence
    blocked = run_grads(call, args)
    for a, b in zip(whole, blocked, strict=True):
        assert_accurate(b, b, a, what="blocked vs whole")


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_cpp_backward_long_sequence_in_query_chunks(form, window):
    """A sequence longer than the C++ backward's query chunk (256 rows): the chunks' dk/dv sum up, each chunk's
    keys are the union of its rows' windows."""
    check_grads("attention", attention_args(form, [300, 5], window=window), "cpp", call=attention_call)


@pytest.mark.parametrize("window", [None, 3])
def test_cpp_grads_key_mask_with_holes(window):
    """A padded key mask with holes (real keys not a prefix): the window counts positions, masked keys get zero
    gradients, against eager's autograd."""
    q, k, v, _, _, _, _, _ = attention_args("padded", [19, 19, 19])
    mask = torch.rand(3, 19, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[2] = False  # a sequence without keys
    check_grads("attention", (q, k, v, None, None, mask, None, window), "cpp", call=attention_call)


def test_triton_op_carries_the_triton_backward(monkeypatch):
    """The triton op's gradient runs the two Triton backward kernels (not the spec's PyTorch formula), and `supports`
    takes dropout."""
    attention_kernels = importlib.import_module("fastbert.kernels.attention")
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_attention_backward_dq_kernel", "_attention_backward_dkdv_kernel"):
        monkeypatch.setattr(attention_kernels, name, Spy(name, getattr(attention_kernels, name)))
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [3, 2]))
    attention_call("triton")(q, k, v, cu, longest, None, None, None).sum().backward()
    assert launched == ["_attention_backward_dq_kernel", "_attention_backward_dkdv_kernel"]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert attention_kernels.supports(q, k, v, cu, longest, dropout_p=0.1, dropout_seed=3) is None


@pytest.mark.interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=lambda p: f"p{p}")
def test_triton_backward_in_gpu_like_uneven_tiles(monkeypatch, dropout_p):
    """The backward kernels with the uneven blocks a GPU takes (dq: 32 queries x 16 keys, dk/dv: 16 queries x 32 keys)
    while the forward walks 64 x 64 tiles: the same gradients as the eager op (with the kernel's mask under dropout),
    a window cutting through tiles, lengths that end mid-tile."""
    def uneven(head_dim, max_seqlen, dtype, heavy=False):
        block_d = max(16, 1 << (head_dim - 1).bit_length())
        return ({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_D": block_d}, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_D": block_d})

    monkeypatch.setattr(importlib.import_module("fastbert.kernels.attention"), "_backward_meta", uneven)
    args = attention_args("packed", [70, 9, 33], window=21)
    if dropout_p == 0:
        check_grads("attention", on_device(args), "triton", call=attention_call)
    else:
        _check_triton_grads_with_kernel_mask(monkeypatch, args, p=dropout_p, seed=123)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_gradcheck_backward_formula(form, window):
    lengths = [4, 2, 0] if form == "packed" else [4, 2]
    gradcheck_spec("attention", attention_args(form, lengths, window=window, head_dim=2))
    gradcheck_spec("attention", attention_args(form, [3, 2], window=window, scale=0.7, head_dim=4))


# ====================================================================================================== dropout
def test_gradcheck_with_dropout():
    """With dropout the backward formula regenerates the forward's mask from the seed: gradcheck (the eager
    forward, perturbed, against the formula) fails for any other mask."""
    args = torch_op_args("attention", attention_args("packed", [4, 2], head_dim=2))[:-2] + (0.4, 1234)
    gradcheck_spec("attention", args)


def _cpp_keep_mask(lengths: list[int], heads: int, p: float, seed: int) -> torch.Tensor:
    """The cpp attention's keep mask, read off its forward: bool [B, heads, S, S] over the padded layout. With
    q = k = 0 every probability of a row is 1 / length and v = one-hot rows makes the output row the dropped
    probability row (no reference to the kernel's RNG: what it computes is what is checked)."""
    longest = max(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.zeros(sum(lengths), heads, longest)
    v = torch.cat([torch.eye(longest)[:n] for n in lengths])[:, None, :].expand(-1, heads, -1).contiguous()
    out = ops.attention(q, q, v, cu_seqlens=cu, max_seqlen=longest, dropout_p=p, dropout_seed=seed, backend="cpp")
    keep = torch.zeros(len(lengths), heads, longest, longest, dtype=torch.bool)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths, strict=True)):
        if n == 0:
            continue
        rows = out[start:start + n].transpose(0, 1)  # [heads, n, S]
        kept = rows != 0
        torch.testing.assert_close(rows[kept], torch.full_like(rows[kept], 1 / n / (1 - p)))  # 1/n, scaled
        keep[b, :, :n] = kept
    return keep


def _attention_with_mask(q, k, v, lengths, keep, p, window):
    """Packed attention written out in the inputs' dtype with a given keep mask (the reference for the cpp
    kernel's dropout)."""
    out, start = [], 0
    for b, n in enumerate(lengths):
        qb, kb, vb = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [h, n, D]
        scores = qb @ kb.transpose(-1, -2) / q.shape[-1] ** 0.5
        if window is not None:
            position = torch.arange(n)
            scores = scores.masked_fill((position[:, None] - position[None, :]).abs() > window // 2, float("-inf"))
        probs = torch.softmax(scores, dim=-1) * keep[b, :, :n, :n] / (1 - p)
        out.append((probs @ vb).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpp_dropout_keep_rate_and_scale(p):
    """Over ~0.5M probabilities the kept fraction is 1 - p within 5 standard deviations, kept ones scaled by
    1 / (1 - p) (checked in _cpp_keep_mask); different sequences and heads are not one repeated mask."""
    keep = _cpp_keep_mask([128] * 8, 4, p, seed=11)
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5, rate
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_cpp_dropout_same_seed_same_output():
    q, k, v, cu, longest, _, _, _ = attention_args("packed", [9, 4], requires_grad=False)

    def call(seed, p=0.3):
        return ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest, dropout_p=p, dropout_seed=seed,
                             backend="cpp")

    assert torch.equal(call(5), call(5))
    assert not torch.equal(call(5), call(6))
    assert not torch.equal(call(5), call(5 + 2**40))
    torch.testing.assert_close(call(5, 0.0), ops.attention(q, k, v, cu_seqlens=cu, max_seqlen=longest,
                                                            backend="eager"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
def test_cpp_dropout_backward_uses_the_forward_mask(window):
    """Output and gradients of the cpp kernel with dropout equal attention written out with the mask read off its
    forward (fp32 rule against fp64); the same reference with another seed's mask is far off, so the check
    fails for a backward that regenerates any other mask. An empty sequence gets zero gradients."""
    lengths, p, seed = [37, 0, 5, 20], 0.3, 123
    keep = _cpp_keep_mask(lengths, OP_HEADS, p, seed)
    q, k, v, cu, longest, _, _, _ = attention_args("packed", lengths)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def grads(fn, tensors):
        out = fn(*tensors)
        return (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), tensors))

    fast = grads(lambda *t: ops.attention(*t, cu_seqlens=cu, max_seqlen=longest, window=window, dropout_p=p,
                                          dropout_seed=seed, backend="cpp"), (q, k, v))
    as_double = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = grads(lambda *t: _attention_with_mask(*t, lengths, keep, p, window), as_double)
    for name, f, r in zip(("out", "dq", "dk", "dv"), fast, reference, strict=True):
        assert_accurate(f, f, r, what=f"cpp attention with dropout: {name}")
    other = grads(lambda *t: _attention_with_mask(*t, lengths, _cpp_keep_mask(lengths, OP_HEADS, p, seed + 1), p,
                                                  window), as_double)
    for f, o in zip(fast[1:], other[1:], strict=True):
        assert (f.double() - o).abs().max() > 0.1 * o.abs().max()
    assert torch.all(fast[1] == fast[1]) and fast[1].isfinite().all()


@pytest.mark.parametrize("window", [None, 5])
def test_cpp_dropout_padded_key_mask_with_holes(window):
    """The padded form with a key mask with holes: the mask is indexed by key position (the packed probe's, S equal),
    output and gradients equal the written-out attention with it, masked keys get zero gradients."""
    batch, seqlen, p, seed = 3, 16, 0.4, 77
    keep = _cpp_keep_mask([seqlen] * batch, OP_HEADS, p, seed)
    q, k, v, _, _, _, _, _ = attention_args("padded", [seqlen] * batch)
    key_mask = torch.rand(batch, seqlen, generator=torch.Generator().manual_seed(4)) < 0.7
    key_mask[2] = False  # no keys: zeros and zero gradients
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def reference(q_, k_, v_):
        scores = q_.transpose(1, 2) @ k_.transpose(1, 2).transpose(-1, -2) / q_.shape[-1] ** 0.5  # [B, h, S, S]
        allowed = key_mask[:, None, None, :].expand(batch, 1, seqlen, seqlen)
        if window is not None:
            position = torch.arange(seqlen)
            allowed = allowed & ((position[:, None] - position[None, :]).abs() <= window // 2)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0) * keep / (1 - p)
        return (probs @ v_.transpose(1, 2)).transpose(1, 2)

    def grads(fn, tensors):
        out = fn(*tensors)
        return (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), tensors))

    fast = grads(lambda *t: ops.attention(*t, key_padding_mask=key_mask, window=window, dropout_p=p,
                                          dropout_seed=seed, backend="cpp"), (q, k, v))
    slow = grads(reference, [t.detach().double().requires_grad_() for t in (q, k, v)])
    for name, f, r in zip(("out", "dq", "dk", "dv"), fast, slow, strict=True):
        assert_accurate(f, f, r, what=f"cpp attention, padded with dropout: {name}")
    assert torch.all(fast[2][~key_mask] == 0) and torch.all(fast[3][~key_mask] == 0)


def _triton_keep_mask(batch: int, heads: int, seqlen: int, p: float, seed: int) -> torch.Tensor:
    """Bool [batch, heads, seqlen, seqlen]: the triton kernel's dropout mask, read off its output (q = k = 0 gives
    every key the weight 1 / S, V = one-hot of the key's position puts keep / (S (1 - p)) at output[i, j]), after
    checking that every output element is 0 or exactly the kept value 1 / (S (1 - p)) (the scale). The mask is a
    function of (seed, sequence, head, query, key) only, so it is the one any call with these sizes draws."""
    head_dim = max(8, -(-seqlen // 8) * 8)
    v = torch.eye(seqlen, head_dim, device=DEVICE).expand(batch, heads, seqlen, head_dim).transpose(1, 2).contiguous()
    zeros = torch.zeros_like(v)
    out = attention_call("triton")(zeros, zeros, v, None, None, None, None, None, p, seed)[..., :seqlen]
    scaled = out.double() * seqlen * (1 - p)  # 1 where kept
    assert torch.all((scaled == 0) | ((scaled - 1).abs() <= 1e-6)), "kept values are not 1 / (S (1 - p))"
    return (scaled > 0.5).permute(0, 2, 1, 3).cpu()


def _check_triton_grads_with_kernel_mask(monkeypatch, args: tuple, p: float, seed: int) -> None:
    """Output and gradients of the triton op with dropout (p, seed) against the eager op run with the kernel's own
    mask (patched into `fastbert.ops.attention.keep_mask`, which the eager forward and the spec's backward read)."""
    q, cu_seqlens, max_seqlen = args[0], args[3], args[4]
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    seqlen = max_seqlen if cu_seqlens is not None else q.shape[1]
    mask = _triton_keep_mask(batch, OP_HEADS, seqlen, p, seed)
    assert 0 < mask.double().mean() < 1

    def kernel_mask(shape, p_, seed_, device):
        assert tuple(shape) == tuple(mask.shape) and (p_, seed_) == (p, seed)
        return mask.to(device)

    monkeypatch.setattr(attention_spec, "keep_mask", kernel_mask)
    args = (*on_device(args), p, seed)
    with torch.no_grad():
        fast = attention_call("triton")(*args)
        plain = attention_call("eager")(*args)
        reference = attention_call("eager")(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                              else a for a in args))
    assert_accurate(fast, plain, reference, what="dropout forward with the kernel's mask")
    check_grads("attention", args, "triton", call=attention_call)


def test_triton_dropout_grads_use_the_forward_mask(monkeypatch):
    _check_triton_grads_with_kernel_mask(monkeypatch, attention_args("padded", [7, 3]), p=0.3, seed=11)


def test_triton_dropout_same_seed_repeats_other_seed_differs():
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [7, 5]))
    run = attention_call("triton")
    with torch.no_grad():
        first, again = (run(q, k, v, cu, longest, None, None, None, 0.4, 5) for _ in range(2))
        other = run(q, k, v, cu, longest, None, None, None, 0.4, 6)
        high_word = run(q, k, v, cu, longest, None, None, None, 0.4, 5 + (1 << 32))  # the seed's upper 32 bits count
        without = run(q, k, v, cu, longest, None, None, None)
        nothing_kept = run(q, k, v, cu, longest, None, None, None, 1.0, 5)
    assert torch.equal(first, again)
    for name, different in (("seed 6", other), ("seed 5 + 2**32", high_word), ("no dropout", without)):
        assert (first - different).abs().max() > 0.1, name
    assert torch.equal(nothing_kept, torch.zeros_like(nothing_kept))


@pytest.mark.interpreter
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_triton_dropout_keep_rate_scale_and_independence(p):
    """65,536 draws (4 sequences x 4 heads x 64 x 64): the keep rate within 5 standard deviations of 1 - p, kept
    values scaled by exactly 1/(1-p) (_triton_keep_mask checks it), neighbouring keys and queries independent (no
    shared Philox counters), and each (sequence, head) its own mask."""
    keep = _triton_keep_mask(4, 4, 64, p, seed=2024).double()
    n = keep.numel()
    sigma = ((1 - p) * p / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma, keep.mean()
    pair_sigma = ((1 - p) ** 2 * (1 - (1 - p) ** 2) / n) ** 0.5
    for name, both in (("keys", keep[..., 1:] * keep[..., :-1]), ("queries", keep[..., 1:, :] * keep[..., :-1, :])):
        assert abs(both.mean().item() - (1 - p) ** 2) < 6 * pair_sigma, name
    slabs = keep.reshape(16, -1)
    differ = (slabs[:, None, :] != slabs[None, :, :]).double().mean(-1)  # fraction of pairs that differ
    off_diagonal = differ[~torch.eye(16, dtype=torch.bool)]
    assert off_diagonal.min() > 2 * p * (1 - p) - 0.05, off_diagonal.min()


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 5], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_triton_dropout_grads_with_the_kernel_mask(monkeypatch, form, window):
    _check_triton_grads_with_kernel_mask(monkeypatch, attention_args(form, [13, 1, 7], window=window), p=0.2, seed=77)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_triton_dropout_grads_half_with_the_kernel_mask(monkeypatch, dtype):
    _check_triton_grads_with_kernel_mask(monkeypatch, attention_args("packed", [33, 7], dtype, head_dim=64), p=0.1,
                                         seed=3)


@pytest.mark.interpreter
def test_triton_dropout_one_keeps_nothing_and_sends_no_gradient():
    args = on_device(attention_args("padded", [7, 3]))
    out = attention_call("triton")(*args, 1.0, 4)
    assert torch.equal(out, torch.zeros_like(out))
    for g in torch.autograd.grad((out * torch.randn_like(out)).sum(), args[:3]):
        assert torch.equal(g, torch.zeros_like(g))


# ====================================================================================================== opcheck
def _opcheck_grad_cases():
    """(backend, torch op arguments with q, k, v requiring grad): packed with a window, padded, and with dropout
    (each backend's own mask); triton in the interpreter."""
    cases = {"packed-w2": attention_args("packed", [5, 2], window=2), "padded": attention_args("padded", [5, 2]),
             "packed-dropout": (*attention_args("packed", [5, 2]), 0.3, 7),
             "packed-w2-dropout": (*attention_args("packed", [5, 2], window=2), 0.3, 8),
             "padded-dropout": (*attention_args("padded", [5, 2]), 0.3, 8)}
    return ([pytest.param("cpp", args, id=f"cpp-{name}") for name, args in cases.items()]
            + [pytest.param("triton", args, id=f"triton-{name}", marks=INTERPRETER) for name, args in cases.items()])


@pytest.mark.parametrize("backend, args", _opcheck_grad_cases())
def test_opcheck_with_grad(backend, args):
    torch.library.opcheck(backend_op(backend, "attention").default, for_backend(backend, args))


def _opcheck_forward_cases():
    """(backend, torch op arguments without grad): packed with an empty sequence, padded with an all-masked row and
    a scale, each global and in a window; triton in the interpreter."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(10, 3, 2, 8, generator=gen).unbind(1)
    cu = cu_seqlens_of([3, 0, 7])
    pq, pk, pv = torch.randn(2, 6, 3, 2, 8, generator=gen).unbind(2)
    mask = torch.tensor([[True] * 4 + [False] * 2, [False] * 6])
    cases = {"packed": (q, k, v, cu, 7, None, None), "packed-w2": (q, k, v, cu, 7, None, None, 2),
             "padded-scale": (pq, pk, pv, None, None, mask, 0.5), "padded-w3": (pq, pk, pv, None, None, mask, 0.5, 3),
             "nomask-w0": (pq, pk, pv, None, None, None, None, 0)}
    return ([pytest.param("cpp", args, id=f"cpp-{name}") for name, args in cases.items()]
            + [pytest.param("triton", args, id=f"triton-{name}", marks=INTERPRETER) for name, args in cases.items()])


@pytest.mark.parametrize("backend, args", _opcheck_forward_cases())
def test_opcheck_forward(backend, args):
    torch.library.opcheck(backend_op(backend, "attention").default, for_backend(backend, args))


@pytest.mark.interpreter
def test_triton_opcheck_backward_op():
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [5, 2]))
    with torch.no_grad():
        out = attention_call("triton")(q, k, v, cu, longest, None, None, None, 0.3, 8)
    grad = torch.randn_like(out)
    args = (grad, *(t.detach() for t in (q, k, v)), out, cu, longest, None, None, 2, 0.3, 8)
    torch.library.opcheck(backend_op("triton", "attention_backward").default, args)
