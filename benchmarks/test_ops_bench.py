"""Per-op benchmark (pytest-benchmark): every available backend of each fused op against the PyTorch ops it
replaces (written as transformers writes them), at BERT-base shapes.

    .venv/bin/python -m pytest benchmarks/test_ops_bench.py                        # quick: 2 x 128 tokens
    FASTBERT_BENCH_FULL=1 .venv/bin/python -m pytest benchmarks/test_ops_bench.py  # 8 x 128 CPU, 32 x 512 CUDA
    FASTBERT_BENCH_OUT=DIR .venv/bin/python -m pytest benchmarks/test_ops_bench.py     # the report into DIR
    FASTBERT_BENCH_THREADS=1 ...                                                   # torch intra-op threads
    FASTBERT_BENCH_DTYPE=bfloat16 ...     # default float16 on CUDA, float32 on CPU; bfloat16: issue 23's per-op view

Rows: "torch" (the unfused PyTorch composition) and the backends eager | triton | cpp | vendor | onednn; a backend
that cannot run the inputs (not built, not this device; triton on CPU would only run in the interpreter) or runs an
earlier backend's implementation (onednn's attention is cpp's) is skipped with its reason. Each row checks its
output against "torch" first, then is timed; extra_info holds the FLOP and byte counts (formulas in
`fastbert.bench.costs`, one function per op), GB/s for the memory-bound op (embedding_layernorm) and TFLOP/s for
the GEMMs and attention. GEMM weights are nn.Parameters, as in models. With FASTBERT_BENCH_OUT set, the run writes
there ops.md (a table with the speed-up of each backend over "torch", same run), ops.json (machine, versions, every row)
and ops_speedup.png.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastbert import backends, cpu, numerics, ops, quantization
from fastbert.bench import costs, machine, recording, report, timing
from fastbert.common import resolve
from fastbert.files import write_atomic
from fastbert.ops.qkv_rotary import qkv_rotary_cost

if os.environ.get("FASTBERT_BENCH_THREADS"):
    torch.set_num_threads(int(os.environ["FASTBERT_BENCH_THREADS"]))
DEVICE = torch.device(resolve.best_device())
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE = DTYPES[os.environ.get("FASTBERT_BENCH_DTYPE") or ("float16" if DEVICE.type == "cuda" else "float32")]
FULL = os.environ.get("FASTBERT_BENCH_FULL", "0") in ("1", "true", "yes")
BATCH, SEQ = (32, 512) if FULL and DEVICE.type == "cuda" else (8, 128) if FULL else (2, 128)
HIDDEN, HEADS, INTERMEDIATE, VOCAB, EPS = 768, 12, 3072, 30522, 1e-12  # BERT-base
HEAD_DIM = HIDDEN // HEADS
GLU_INTERMEDIATE = 1152  # ModernBERT-base: Wi [2 x 1152, 768], Wo [768, 1152]
LONG_SEQ, LOCAL_WINDOW = 1024, 128  # ModernBERT's local layers attend local_attention = 128 positions
TOKENS = BATCH * SEQ
ELEMENT = torch.finfo(DTYPE).bits // 8
MEMORY_BOUND = {"embedding_layernorm"}
IMPLEMENTATIONS = ("torch",) + backends.BACKENDS
_ROWS: list[dict] = []


def _randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


def _weight(out_features: int, in_features: int) -> torch.nn.Parameter:
    """A GEMM weight as models hold it (an nn.Parameter, which the onednn backend packs once and keeps)."""
    return torch.nn.Parameter(_randn(out_features, in_features, scale=in_features ** -0.5), requires_grad=False)


def _varlen_lengths() -> list[int]:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(SEQ // 8, SEQ + 1, (BATCH,), generator=generator).tolist()
    lengths[0] = SEQ
    return lengths


# Each case: (op name, args of the fused op, the unfused PyTorch function of the same args, cost, comparison).
def case_embedding_layernorm():
    ids = torch.randint(0, VOCAB, (TOKENS,), device=DEVICE)
    positions = torch.arange(SEQ, device=DEVICE).repeat(BATCH)
    types = torch.zeros(TOKENS, dtype=torch.long, device=DEVICE)
    args = (ids, positions, types, _randn(VOCAB, HIDDEN), _randn(512, HIDDEN), _randn(2, HIDDEN),
            _randn(HIDDEN), _randn(HIDDEN), EPS)

    def unfused(ids, positions, types, words, position_table, type_table, weight, bias, eps):
        summed = F.embedding(ids, words) + F.embedding(types, type_table) + F.embedding(positions, position_table)
        return F.layer_norm(summed, (HIDDEN,), weight, bias, eps)

    return "embedding_layernorm", args, unfused, costs.embedding_layernorm_cost(TOKENS, HIDDEN, ELEMENT), None


def case_qkv_projection():
    args = (_randn(TOKENS, HIDDEN), _weight(3 * HIDDEN, HIDDEN), _randn(3 * HIDDEN), HEADS)

    def unfused(x, weight, bias, heads):  # transformers: three Linear layers, then a view per head
        return tuple(F.linear(x, w, b).view(TOKENS, heads, HEAD_DIM)
                     for w, b in zip(weight.chunk(3), bias.chunk(3), strict=True))

    return "qkv_projection", args, unfused, costs.qkv_projection_cost(TOKENS, HIDDEN, ELEMENT), None


def case_qkv_rotary():
    """ModernBERT's attention input (Wqkv without bias, rotary on q and k) on the padded batch flattened to
    [B * S, H], against transformers' code: the Linear, its cos/sin computed per forward as ModernBertRotaryEmbedding
    does, apply_rotary_pos_emb (in the [B, S, heads, D] layout, which skips transformers' transposes)."""
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    positions = torch.arange(SEQ, device=DEVICE).repeat(BATCH)
    cos, sin = ops.rotary_tables(160000.0, HEAD_DIM, SEQ, DEVICE)
    args = (_randn(TOKENS, HIDDEN), _weight(3 * HIDDEN, HIDDEN), None, HEADS, positions, cos,
            sin)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float, device=DEVICE) / HEAD_DIM))

    def unfused(x, weight, bias, heads, positions, cos, sin):
        q, k, v = F.linear(x, weight, bias).view(BATCH, SEQ, 3, heads, HEAD_DIM).unbind(2)
        freqs = positions.view(BATCH, SEQ)[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        q, k = apply_rotary_pos_emb(q, k, angles.cos().to(x.dtype), angles.sin().to(x.dtype), unsqueeze_dim=2)
        return tuple(t.reshape(TOKENS, heads, HEAD_DIM) for t in (q, k, v))

    return "qkv_rotary", args, unfused, qkv_rotary_cost(TOKENS, HIDDEN, HEAD_DIM, ELEMENT), None


def _hf_eager_attention(q, k, v, additive_mask):
    """transformers' eager attention on [B, S, heads, D]: scores, mask, softmax, context."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    if additive_mask is not None:
        scores = scores + additive_mask
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).contiguous()


def case_attention():
    qkv = _randn(TOKENS, 3, HEADS, HEAD_DIM)
    q, k, v = qkv.unbind(1)  # strided views, as qkv_projection returns them
    cu = torch.arange(0, TOKENS + 1, SEQ, dtype=torch.int32, device=DEVICE)
    args = (q, k, v, cu, SEQ, None, None)

    def unfused(q, k, v, cu, max_seqlen, mask, scale):
        shape = (BATCH, SEQ, HEADS, HEAD_DIM)
        return _hf_eager_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), None).view(q.shape)

    return "attention", args, unfused, costs.attention_cost([SEQ] * BATCH, HEADS, HEAD_DIM, ELEMENT), None


def case_attention_varlen():
    """Packed variable-length attention against transformers' padded attention with a mask (which also computes
    the padding; the cost counts useful work only)."""
    lengths = _varlen_lengths()
    total = sum(lengths)
    qkv = _randn(total, 3, HEADS, HEAD_DIM)
    q, k, v = qkv.unbind(1)
    cu = F.pad(torch.tensor(lengths, device=DEVICE).cumsum(0), (1, 0)).to(torch.int32)
    mask = torch.zeros(BATCH, SEQ, dtype=torch.bool, device=DEVICE)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    flat = mask.flatten().nonzero().flatten()
    additive = torch.zeros(BATCH, 1, 1, SEQ, dtype=DTYPE, device=DEVICE).masked_fill(~mask[:, None, None, :],
                                                                                       torch.finfo(DTYPE).min)
    args = (q, k, v, cu, SEQ, None, None)

    def unfused(q, k, v, cu, max_seqlen, key_mask, scale):
        def pad(t):
            out = t.new_zeros(BATCH * SEQ, HEADS, HEAD_DIM)
            out[flat] = t
            return out.view(BATCH, SEQ, HEADS, HEAD_DIM)

        return _hf_eager_attention(pad(q), pad(k), pad(v), additive).reshape(BATCH * SEQ, HEADS, HEAD_DIM)[flat]

    return "attention", args, unfused, costs.attention_cost(lengths, HEADS, HEAD_DIM, ELEMENT), "varlen"


def _long_attention(window: int | None):
    """One sequence of LONG_SEQ tokens, 12 heads of 64, globally or in ModernBERT's sliding window, against
    transformers' eager attention with the matching band mask (which computes all S^2 scores; the cost counts the
    attended pairs only): the local layer's fused cost follows S * window, the global one S^2."""
    q, k, v = _randn(LONG_SEQ, 3, HEADS, HEAD_DIM).unbind(1)
    cu = torch.tensor([0, LONG_SEQ], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, cu, LONG_SEQ, None, None, window)
    additive = None
    if window is not None:
        position = torch.arange(LONG_SEQ, device=DEVICE)
        outside = (position[:, None] - position[None, :]).abs() > window // 2
        additive = torch.zeros(LONG_SEQ, LONG_SEQ, dtype=DTYPE, device=DEVICE).masked_fill(outside,
                                                                                             torch.finfo(DTYPE).min)

    def unfused(q, k, v, cu, max_seqlen, mask, scale, window):
        shape = (1, LONG_SEQ, HEADS, HEAD_DIM)
        return _hf_eager_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), additive).view(q.shape)

    cost = costs.attention_cost([LONG_SEQ], HEADS, HEAD_DIM, ELEMENT, window=window)
    return "attention", args, unfused, cost, f"s{LONG_SEQ}" + (f"-window{window}" if window is not None else "")


def case_attention_long_global():
    return _long_attention(None)


def case_attention_long_local():
    return _long_attention(LOCAL_WINDOW)


def case_linear_activation():
    args = (_randn(TOKENS, HIDDEN), _weight(INTERMEDIATE, HIDDEN), _randn(INTERMEDIATE), "gelu")

    def unfused(x, weight, bias, activation):
        return F.gelu(F.linear(x, weight, bias))

    return ("linear_activation", args, unfused, costs.linear_activation_cost(TOKENS, HIDDEN, INTERMEDIATE, ELEMENT),
            None)


def case_linear_residual_layernorm():
    args = (_randn(TOKENS, INTERMEDIATE), _weight(HIDDEN, INTERMEDIATE), _randn(HIDDEN),
            _randn(TOKENS, HIDDEN), _randn(HIDDEN), _randn(HIDDEN), EPS)

    def unfused(x, weight, bias, residual, ln_weight, ln_bias, eps):
        return F.layer_norm(F.linear(x, weight, bias) + residual, (HIDDEN,), ln_weight, ln_bias, eps)

    cost = costs.linear_residual_layernorm_cost(TOKENS, INTERMEDIATE, HIDDEN, ELEMENT)
    return "linear_residual_layernorm", args, unfused, cost, None


def case_linear_glu():
    """ModernBERT's MLP input half as transformers writes it: Wi, chunk(2), act(input) * gate (GELU, no bias)."""
    args = (_randn(TOKENS, HIDDEN), _weight(2 * GLU_INTERMEDIATE, HIDDEN), None, "gelu")

    def unfused(x, weight, bias, activation):
        projected, gate = F.linear(x, weight, bias).chunk(2, dim=-1)
        return F.gelu(projected) * gate

    return "linear_glu", args, unfused, ops.SPECS["linear_glu"].cost(TOKENS, HIDDEN, GLU_INTERMEDIATE, ELEMENT), None


def case_linear_residual_prenorm():
    """ModernBERT's MLP output: Wo (no bias), + residual, then the next layer's attn_norm (LayerNorm without bias)."""
    args = (_randn(TOKENS, GLU_INTERMEDIATE), _weight(HIDDEN, GLU_INTERMEDIATE), None,
            _randn(TOKENS, HIDDEN), _randn(HIDDEN), None, 1e-5)

    def unfused(x, weight, bias, residual, ln_weight, ln_bias, eps):
        summed = residual + F.linear(x, weight, bias)
        return summed, F.layer_norm(summed, (HIDDEN,), ln_weight, ln_bias, eps)

    cost = ops.SPECS["linear_residual_prenorm"].cost(TOKENS, GLU_INTERMEDIATE, HIDDEN, ELEMENT)
    return "linear_residual_prenorm", args, unfused, cost, None


CASES = [case_embedding_layernorm, case_qkv_projection, case_qkv_rotary, case_attention, case_attention_varlen,
         case_attention_long_global, case_attention_long_local, case_linear_activation, case_linear_residual_layernorm,
         case_linear_glu, case_linear_residual_prenorm]


def _fused(op: str, backend: str):
    entry = {"embedding_layernorm": ops.embedding_layernorm, "qkv_projection": ops.qkv_projection,
             "qkv_rotary": ops.qkv_rotary,
             "linear_activation": ops.linear_activation, "linear_residual_layernorm": ops.linear_residual_layernorm,
             "linear_glu": ops.linear_glu, "linear_residual_prenorm": ops.linear_residual_prenorm}
    if op == "attention":
        return lambda q, k, v, cu, max_seqlen, mask, scale, window=None: ops.attention(
            q, k, v, cu_seqlens=cu, max_seqlen=max_seqlen, window=window, backend=backend)
    return lambda *args: entry[op](*args, backend=backend)


def _outputs(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _check_against_unfused(case_name: str, impl: str, got, expected, unfused, args: tuple) -> None:
    """fp32: each output within 2e-4 of the unfused ops'; fp16/bf16: `fastbert.numerics`' rule, both against the
    unfused ops run on float32 copies of the inputs."""
    if DTYPE == torch.float32:
        for want, have in zip(_outputs(expected), _outputs(got), strict=True):
            torch.testing.assert_close(have, want, atol=2e-4, rtol=2e-4)
        return
    upcast = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    for want, have, exact in zip(_outputs(expected), _outputs(got), _outputs(unfused(*upcast)), strict=True):
        numerics.assert_accurate(have, want, exact, f"{case_name} {impl}")


def _synchronized(fn, args):
    def run():
        out = fn(*args)
        timing.synchronize(DEVICE)
        return out

    return run


@pytest.fixture(scope="module", autouse=True)
def _markdown_report():
    yield
    out = os.environ.get("FASTBERT_BENCH_OUT")
    if not out or not _ROWS:
        return
    baseline = {row["case"]: row["median_s"] for row in _ROWS if row["impl"] == "torch"}
    rows = []
    for row in _ROWS:
        rate = (f"{row['bytes'] / row['median_s'] / 1e9:.1f} GB/s" if row["op"] in MEMORY_BOUND
                else f"{row['flops'] / row['median_s'] / 1e12:.3f} TFLOP/s")
        speedup = baseline.get(row["case"], 0) / row["median_s"]
        rows.append([row["case"], row["impl"], f"{row['median_s'] * 1e3:.3f}", rate,
                     f"{speedup:.2f}x" if row["impl"] != "torch" else "-", f"{row['flops']:.3g}",
                     f"{row['bytes']:.3g}"])
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    info = machine.machine_info(DEVICE)
    header = [f"# fastbert per-op benchmark: {info['tag']}", "",
              f"- {info['gpu'] or info['cpu']} ({info['cpu_cores']} cores, {torch.get_num_threads()} torch threads), "
              f"{info['date']}, torch {info['versions']['torch']}, load average (1, 5, 15 min) "
              + "/".join(f"{v:.1f}" for v in info["load_average"] or []),
              f"- CPU flags (of {', '.join(cpu.FEATURES)}): {', '.join(info['cpu_flags']) or 'none'}",
              "- rows run one after another (pytest-benchmark), not interleaved: on a busy machine compare "
              "ratios with care",
              f"- BERT-base shapes: {BATCH} x {SEQ} tokens, H={HIDDEN}, heads={HEADS}, I={INTERMEDIATE}, "
              f"{str(DTYPE)[6:]}; median of pytest-benchmark rounds",
              "- speed-up: median of the unfused PyTorch ops ('torch') / median of the row, same run",
              *_precision_note(),
              "- backends available: "
              + "; ".join(f"{k}: {v}" for k, v in recording.backend_availability().items()), ""]
    table = report.format_table(("case", "implementation", "median ms", "rate", "speed-up vs torch", "FLOPs",
                                 "bytes"), rows, markdown=True)
    write_atomic(path / "ops.md", "\n".join(header) + "\n" + table + "\n")
    write_atomic(path / "ops.json", json.dumps({"machine": info, "threads": torch.get_num_threads(), "rows": _ROWS},
                                               indent=1, default=str))
    _plot_speedups(baseline, path / "ops_speedup.png", info["tag"])


def _precision_note() -> list[str]:
    """On CPU in bfloat16, whether the CPU computes it natively, and what `dtype="auto"` picks here."""
    if DEVICE.type != "cpu" or DTYPE != torch.bfloat16:
        return []
    native = cpu.native_bf16()
    if not native:
        return ["- bfloat16 is emulated here (neither AMX nor AVX-512 BF16): these rows compare emulations, not the "
                "native bfloat16 of an AMX or AVX-512 BF16 CPU"]
    return [f"- bfloat16: the CPU computes it natively ({', '.join(native)}); `dtype=\"auto\"` picks "
            f"{quantization.auto_cpu_dtype()[1]}"]


def _plot_speedups(baseline: dict[str, float], png: Path, tag: str) -> None:
    """One bar per (case, backend): the unfused torch median over the backend's median, same run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(row["case"] for row in _ROWS))
    impls = [impl for impl in dict.fromkeys(row["impl"] for row in _ROWS) if impl != "torch"]
    medians = {(row["case"], row["impl"]): row["median_s"] for row in _ROWS}
    series = {impl: [baseline[case] / medians[case, impl] if (case, impl) in medians and case in baseline else None
                     for case in cases] for impl in impls}
    fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(cases)), 4.5))
    report.grouped_bars(ax, cases, series, lambda v: f"{v:.2f}x")
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speed-up vs unfused torch (same run)")
    ax.set_title(f"fastbert per-op speed-up: {tag}")
    ax.legend()
    report.save_figure(fig, png, dpi=110)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[len("case_"):])
def test_op(benchmark, case, impl):
    torch.manual_seed(0)
    op, args, unfused, cost, variant = case()
    case_name = op + (f"-{variant}" if variant else "")
    if impl == "torch":
        fn = unfused
    else:
        if impl == "triton" and DEVICE.type == "cpu":
            pytest.skip("triton on CPU runs only under the interpreter: not a speed measurement")
        with torch.inference_mode():
            reason = backends.why_not(op, impl, *args)
        if reason:
            pytest.skip(reason)
        same = backends.same_implementation(op, impl, list(IMPLEMENTATIONS[1:IMPLEMENTATIONS.index(impl)]))
        if same:
            pytest.skip(f"{impl} runs {same}'s implementation of {op}")
        fn = _fused(op, impl)
    with torch.inference_mode():
        expected, got = unfused(*args), fn(*args)
        _check_against_unfused(case_name, impl, got, expected, unfused, args)
        benchmark.group = case_name
        benchmark.extra_info.update(op=op, impl=impl, device=DEVICE.type, dtype=str(DTYPE)[6:], tokens=TOKENS,
                                    flops=cost.flops, bytes=cost.bytes)
        benchmark(_synchronized(fn, args))
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable
        return
    median = stats.stats.median
    if op in MEMORY_BOUND:
        benchmark.extra_info["GB/s"] = cost.bytes / median / 1e9
    else:
        benchmark.extra_info["TFLOP/s"] = cost.flops / median / 1e12
    _ROWS.append(dict(case=case_name, op=op, impl=impl, median_s=median, flops=cost.flops, bytes=cost.bytes))
