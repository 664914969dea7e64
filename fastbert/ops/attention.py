"""Scaled dot-product attention with a key padding mask, in padded or packed variable-length form.

Forms:
- padded: q, k, v [B, S, heads, D], optional `key_padding_mask` bool [B, S] (True = attend to this key);
- packed: q, k, v [T, heads, D] with `cu_seqlens` int32 [B + 1] and `max_seqlen`; tokens attend within their
  own sequence only.
Returns a contiguous tensor shaped like q. Softmax in fp32 in the fused backends; a query whose keys are all
masked gets zeros, never NaN. A masked key contributes exactly nothing on every backend, even when its K or V
hold NaN or Inf: real query rows come out as if those values were zeros (rows at padded query positions are
unspecified). Inputs may be strided views (what `qkv_projection` returns).

Sliding window (ModernBERT's local layers): `window` is the total width, ModernBERT's `config.local_attention`
(e.g. 128). A query at position i attends key j (positions within its own sequence: the packed sequence's token
index, or the padded form's index along S) iff |i - j| <= window // 2, and the key is real. This is transformers'
rule: ModernBertConfig.sliding_window = local_attention // 2 and `create_bidirectional_sliding_window_mask` keeps
`abs(q_idx - kv_idx) <= sliding_window` (tests/ops/test_attention.py compares with it). So window 0 or 1 is each
token attending to itself alone, an odd window w has width w, an even one w + 1, and a window of 2 * (S - 1) or more
is global attention. window=None: global; otherwise an int >= 0 (ValueError else). A query whose window holds no
real key gets zeros. Caution: packed positions count a sequence's kept tokens, so a batch with left padding or
holes, once unpadded, sees other windows than the padded form (and transformers, which counts padded positions);
right-padded batches give the same windows either way.

Dropout (training): ``dropout_p`` > 0 zeroes attention probabilities with probability p and scales the rest by
1 / (1 - p) (`fastbert.ops.dropout`); the mask is indexed [sequence, head, query, key] over the padded layout
(the packed form's sequences padded to ``max_seqlen``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import compute_dtype
from fastbert.ops.dropout import apply_keep, check_dropout, keep_mask, keep_scale
from fastbert.ops.padding import VarlenBatch, pad_tokens, unpad_tokens, varlen_positions
from fastbert.ops.spec import OpCost, OpSpec, declare


def window_half_width(window: int | None, seqlen: int) -> int | None:
    """The largest |i - j| a query may attend, or None when the window is global for sequences of ``seqlen``. A
    trace keeps the band at any length: torch.jit.trace records the branch taken, and a trace made at a length the
    window covers would drop the window at longer ones."""
    if window is None or (window // 2 >= seqlen - 1 and not torch.jit.is_tracing()):
        return None
    return window // 2


def _padded_sdpa(q, k, v, key_padding_mask, scale, half_width=None):
    """[B, S, h, D] attention through PyTorch's SDPA, keys limited to |i - j| <= half_width when given; rows without
    a key zeroed."""
    mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    if half_width is not None:
        position = torch.arange(q.shape[1], device=q.device)
        band = (position[:, None] - position[None, :]).abs() <= half_width
        mask = band[None, None] if mask is None else mask & band
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)
    out = out.transpose(1, 2)
    if key_padding_mask is not None:  # (without one every query has a key: itself, inside any window)
        has_key = mask.any(dim=-1)[:, 0, :, None, None]  # [B, S or 1, 1, 1]: per query
        out = torch.where(has_key, out, out.new_zeros(()))
    return out.contiguous()


def _allowed_keys(key_padding_mask, seqlen, half_width, device):
    """Bool [B or 1, 1, S or 1, S]: which (query, key) pairs may attend (None: all)."""
    allowed = None
    if half_width is not None:
        position = torch.arange(seqlen, device=device)
        allowed = ((position[:, None] - position[None, :]).abs() <= half_width)[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _padded_dropout(q, k, v, key_padding_mask, scale, half_width, dropout_p, dropout_seed):
    """[B, S, h, D] attention with dropout on the probabilities (softmax in fp32), written out: SDPA's own dropout
    draws a mask nobody can regenerate for the backward formula."""
    batch, seqlen, heads, _ = q.shape
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    scores = (qt @ kt.transpose(-1, -2)).to(compute_dtype(q.dtype)) * scale
    allowed = _allowed_keys(key_padding_mask, seqlen, half_width, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if allowed is not None:  # a query without a key: softmax of only -inf is NaN, its output zeros
        probs = probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, dropout_seed, q.device)
    probs = apply_keep(probs, keep, dropout_p)
    return (probs.to(q.dtype) @ vt).transpose(1, 2).contiguous()


def _padded_layout(cu_seqlens, total, max_seqlen, device) -> tuple[VarlenBatch, torch.Tensor]:
    """Where the packed form's ``total`` rows stand in the zero-padded [B, max_seqlen] batch the eager forward and
    the backward compute on (for `pad_tokens` and `unpad_tokens`), and that batch's key padding mask."""
    seq_index, position = varlen_positions(cu_seqlens, total)
    batch = cu_seqlens.numel() - 1
    varlen = VarlenBatch(seq_index * max_seqlen + position, cu_seqlens, max_seqlen, batch, max_seqlen)
    mask = torch.zeros(batch * max_seqlen, dtype=torch.bool, device=device)
    mask[varlen.indices] = True
    return varlen, mask.view(batch, max_seqlen)


def runs_per_sequence(q: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether the eager packed forward may call SDPA per sequence (`_per_sequence_sdpa`, which pads many runs of short
    sequences after all): on CPU, on plain tensors, outside tracing. It reads the sequence bounds on the host, which
    costs a synchronisation on CUDA and is data-dependent for torch.compile, jit tracing and fake tensors; those pad
    to the longest sequence instead."""
    return (q.device.type == "cpu" and type(q) is torch.Tensor and type(cu_seqlens) is torch.Tensor
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


# Above this many runs, when no sequence is longer than SHORT_SEQUENCE_TOKENS, one padded call beats a call per run
# (see `_per_sequence_sdpa`); one long sequence among them would make the padded call cost its length squared per
# sequence.
MANY_RUNS = 32
SHORT_SEQUENCE_TOKENS = 32


def _equal_length_runs(bounds: list[int]) -> list[tuple[int, int, int]]:
    """(first row, sequences, length) of each run of consecutive non-empty sequences of one length."""
    runs: list[tuple[int, int, int]] = []
    for start, end in pairwise(bounds):
        length = end - start
        if length and runs and runs[-1][2] == length:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, length)
        elif length:
            runs.append((start, 1, length))
    return runs


def _per_sequence_sdpa(q, k, v, cu_seqlens, scale, window):
    """The packed form as SDPA calls on views of the sequences' rows, one call per run of consecutive sequences of one
    length (a full batch is one call): every key of a sequence is real, so no padding, no mask (but the window's
    band) and no copy in; cost follows each sequence's length. On the 2-core VM (fp32 and bf16, 12 heads of 32) 32
    sequences of 8-128 tokens ran 1.8-2.2x faster this way than padded to the longest for one masked call, 8 x 128
    1.5-1.8x, 40 short sequences and one of 512 15-31x (`benchmarks/eager_cpu.py`). None (the caller pads) for many
    runs of short sequences only, where the calls cost more than the padding (256 sequences of 4-16 tokens). The
    bounds must run from 0 to the number of rows, non-decreasing (ValueError otherwise, as the cpp kernel checks)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(f"attention: cu_seqlens must run from 0 to total_tokens={q.shape[0]} without decreasing, "
                         f"got {bounds}")
    runs = _equal_length_runs(bounds)
    if len(runs) > MANY_RUNS and max(length for _, _, length in runs) <= SHORT_SEQUENCE_TOKENS:
        return None
    pieces = []
    for first, count, length in runs:
        rows = slice(first, first + count * length)
        views = [t[rows].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v)]  # [count, heads, L, D]
        allowed = _allowed_keys(None, length, window_half_width(window, length), q.device)
        out = F.scaled_dot_product_attention(*views, attn_mask=allowed, scale=scale)
        pieces.append(out.transpose(1, 2).flatten(0, 1))
    if len(pieces) == 1:
        return pieces[0].contiguous()
    return torch.cat(pieces) if pieces else q.new_zeros(q.shape)


def _eager(q, k, v, cu_seqlens=None, max_seqlen=None, key_padding_mask=None, scale=None, window=None,
           dropout_p=0.0, dropout_seed=0):
    """SDPA on K and V with zeros selected at masked keys, so NaN or Inf stored there never reaches a real row; the
    window as a band of the boolean mask. With dropout, the attention written out (`_padded_dropout`)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if cu_seqlens is None:
        if key_padding_mask is not None:
            # SDPA adds -inf to masked scores and multiplies V by a zero probability: a NaN or Inf in K or V at a
            # masked key would still make its sequence's rows NaN. With zeros selected there it contributes nothing.
            real = key_padding_mask[:, :, None, None]
            k = torch.where(real, k, k.new_zeros(()))
            v = torch.where(real, v, v.new_zeros(()))
        if dropout_p > 0.0:
            return _padded_dropout(q, k, v, key_padding_mask, scale, window_half_width(window, q.shape[1]),
                                   dropout_p, dropout_seed)
        return _padded_sdpa(q, k, v, key_padding_mask, scale, window_half_width(window, q.shape[1]))
    if dropout_p == 0.0 and runs_per_sequence(q, cu_seqlens):
        out = _per_sequence_sdpa(q, k, v, cu_seqlens, scale, window)
        if out is not None:
            return out
    varlen, mask = _padded_layout(cu_seqlens, q.shape[0], max_seqlen, q.device)
    padded = [pad_tokens(t, varlen) for t in (q, k, v)]
    if dropout_p > 0.0:
        out = _padded_dropout(*padded, mask, scale, window_half_width(window, max_seqlen), dropout_p, dropout_seed)
    else:
        out = _padded_sdpa(*padded, mask, scale, window_half_width(window, max_seqlen))
    return unpad_tokens(out, varlen)


def attention_reference(q, k, v, cu_seqlens=None, max_seqlen=None, key_padding_mask=None, scale=None, window=None,
                        dropout_p=0.0, dropout_seed=0):
    """The eager computation in fp32 (SDPA on upcast inputs), for tests of every backend; returns q's dtype."""
    out = _eager(q.float(), k.float(), v.float(), cu_seqlens, max_seqlen, key_padding_mask, scale, window,
                 dropout_p, dropout_seed)
    return out.to(q.dtype)


def check_window(window) -> None:
    """A window is None (global) or a Python int >= 0 (ModernBERT's local_attention); ValueError otherwise."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"attention: window must be None (global) or an int >= 0 (the total width, ModernBERT's "
                         f"local_attention), got {window!r}")


def _check(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale=None, window=None, dropout_p=0.0,
           dropout_seed=0) -> None:
    check_window(window)
    check_dropout("attention", dropout_p, dropout_seed)
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"attention: q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if cu_seqlens is not None:
        if q.dim() != 3:
            raise ValueError(f"attention: packed form takes q [total_tokens, heads, head_dim], got {tuple(q.shape)}")
        if key_padding_mask is not None:
            raise ValueError("attention: give either cu_seqlens (packed) or key_padding_mask (padded), not both")
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("attention: cu_seqlens must be int32 [batch + 1]")
        if max_seqlen is None:
            raise ValueError("attention: the packed form needs max_seqlen")
    else:
        if q.dim() != 4:
            raise ValueError(f"attention: padded form takes q [batch, seq, heads, head_dim], got {tuple(q.shape)}")
        if key_padding_mask is not None and (
            key_padding_mask.dtype != torch.bool or key_padding_mask.shape != q.shape[:2]
        ):
            raise ValueError(f"attention: key_padding_mask must be bool [{q.shape[0]}, {q.shape[1]}], got "
                             f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")


def _fake(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window=None, dropout_p=0.0, dropout_seed=0):
    return q.new_empty(q.shape)


def attended_pairs(seqlen: int, window: int | None = None) -> int:
    """(query, key) pairs one sequence of ``seqlen`` tokens attends: S^2 globally; with a window of half width
    h = window // 2 < S - 1, S * (2h + 1) minus the h * (h + 1) pairs the band loses past both ends."""
    half = window_half_width(window, seqlen)
    if half is None:
        return seqlen * seqlen
    return seqlen * (2 * half + 1) - half * (half + 1)


def attention_cost(seqlens: Sequence[int], heads: int, head_dim: int, dtype_bytes: int,
                   window: int | None = None) -> OpCost:
    """softmax(q k^T) v per sequence and head: 2*P*D for the scores plus 2*P*D for the context, P the attended
    (query, key) pairs (S^2 globally, about S * window with a sliding window: `attended_pairs`). Bytes: q, k, v
    read once and the output written (what a fused kernel moves; the unfused one also writes the S x S scores)."""
    pairs = sum(attended_pairs(s, window) for s in seqlens)
    tokens = sum(seqlens)
    flops = 4 * pairs * heads * head_dim
    moved = 4 * tokens * heads * head_dim * dtype_bytes
    return OpCost(float(flops), float(moved))


# ----------------------------------------------------------------------------------------------------- backward
# Elements of one [sequences, heads, queries, keys] block of recomputed probabilities (fp32: 16 MiB); the backward
# holds about four such blocks at once.
BACKWARD_BLOCK_ELEMENTS = 1 << 22


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window, dropout_p, dropout_seed = inputs
    ctx.max_seqlen, ctx.scale, ctx.window = max_seqlen, scale, window
    ctx.dropout_p, ctx.dropout_seed = dropout_p, dropout_seed
    ctx.save_for_backward(q, k, v, cu_seqlens, key_padding_mask)


def _padded_grads(q, k, v, grad, key_padding_mask, scale, half_width, dropout_p=0.0, dropout_seed=0):
    """(dq, dk, dv) of the eager padded attention, each [B, S, h, D] in the inputs' (compute) dtype. The
    probabilities are recomputed block by block (a few sequences and query rows at a time, every key and head), so
    no [S, S] matrix exists for the whole batch; a query without an allowed key has zero probabilities (its output
    was zeros), and k, v hold zeros at masked keys (the caller selects them). With dropout, the forward's keep mask
    is regenerated from its seed (one bool [B, h, S, S])."""
    batch, seqlen, heads, _ = q.shape
    q, k, v, grad = (t.transpose(1, 2) for t in (q, k, v, grad))  # [B, h, S, D]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    allowed = _allowed_keys(key_padding_mask, seqlen, half_width, q.device)
    keep = keep_mask((batch, heads, seqlen, seqlen), dropout_p, dropout_seed, q.device) if dropout_p > 0 else None
    query_rows = max(1, min(seqlen, BACKWARD_BLOCK_ELEMENTS // max(1, heads * seqlen)))
    sequences = max(1, min(batch, BACKWARD_BLOCK_ELEMENTS // max(1, heads * query_rows * seqlen)))
    for first in range(0, batch, sequences):
        rows = slice(first, first + sequences)
        k_block, v_block = k[rows], v[rows]
        for start in range(0, seqlen, query_rows):
            queries = slice(start, start + query_rows)
            q_block, grad_block = q[rows, :, queries], grad[rows, :, queries]
            scores = (q_block @ k_block.transpose(-1, -2)) * scale
            if allowed is not None:
                block_allowed = allowed[rows if allowed.shape[0] > 1 else slice(None), :,
                                        queries if allowed.shape[2] > 1 else slice(None)]  # (broadcast dims kept)
                scores = scores.masked_fill(~block_allowed, float("-inf"))
                # a query with no allowed key: softmax of all -inf is NaN; its output was zeros, its probabilities 0
                probs = torch.softmax(scores, dim=-1).masked_fill(~block_allowed.any(dim=-1, keepdim=True), 0.0)
            else:
                probs = torch.softmax(scores, dim=-1)
            grad_probs = grad_block @ v_block.transpose(-1, -2)
            if keep is not None:  # out = dropped(P) @ v: v sees the dropped probabilities, P the masked gradient
                block_keep = keep[rows, :, queries] * keep_scale(dropout_p)
                dv[rows] += (probs * block_keep).transpose(-1, -2) @ grad_block
                grad_probs = grad_probs * block_keep
            else:
                dv[rows] += probs.transpose(-1, -2) @ grad_block
            grad_scores = probs * (grad_probs - (probs * grad_probs).sum(dim=-1, keepdim=True)) * scale
            dq[rows, :, queries] = grad_scores @ k_block
            dk[rows] += grad_scores.transpose(-1, -2) @ q_block
    return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


def _backward(ctx, grad):
    """Gradients of q, k, v, as the eager attention's (rows at padded query positions included, computed as
    the forward computes them), in fp32 (fp64 for fp64 inputs) from probabilities recomputed in blocks
    (`_padded_grads`). Masked keys get zero gradients and what they store (even NaN) reaches no gradient; the
    packed form is scattered into a zero-padded batch, as the eager forward does."""
    q, k, v, cu_seqlens, key_padding_mask = ctx.saved_tensors
    compute = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if ctx.scale is None else ctx.scale
    q_c, k_c, v_c, grad_c = (t.to(compute) for t in (q, k, v, grad))
    if cu_seqlens is None:
        if key_padding_mask is not None:
            real = key_padding_mask[:, :, None, None]
            k_c = torch.where(real, k_c, k_c.new_zeros(()))
            v_c = torch.where(real, v_c, v_c.new_zeros(()))
        dq, dk, dv = _padded_grads(q_c, k_c, v_c, grad_c, key_padding_mask, scale,
                                   window_half_width(ctx.window, q.shape[1]), ctx.dropout_p, ctx.dropout_seed)
        if key_padding_mask is not None:  # the forward selected zeros there: nothing flows to the stored values
            dk = torch.where(real, dk, dk.new_zeros(()))
            dv = torch.where(real, dv, dv.new_zeros(()))
    else:
        varlen, mask = _padded_layout(cu_seqlens, q.shape[0], ctx.max_seqlen, q.device)
        padded = _padded_grads(*(pad_tokens(t, varlen) for t in (q_c, k_c, v_c, grad_c)), mask, scale,
                               window_half_width(ctx.window, ctx.max_seqlen), ctx.dropout_p, ctx.dropout_seed)
        dq, dk, dv = (unpad_tokens(t, varlen) for t in padded)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None


SPEC = declare(OpSpec(
    name="attention",
    cost=attention_cost,
    schema="(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens, int? max_seqlen, Tensor? key_padding_mask, "
           "float? scale, int? window=None, float dropout_p=0.0, int dropout_seed=0) -> Tensor",
    fake=_fake,
    check=_check,
    eager=_eager,
    reference=attention_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    backend: str | None = "auto",
) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, masked as described in the module docstring; scale defaults to D^-0.5;
    ``window`` (total width, None = global) limits each query to keys within window // 2 positions; ``dropout_p``
    drops probabilities (mask drawn from ``dropout_seed``)."""
    _check(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window, dropout_p, dropout_seed)
    return backends.dispatch("attention", backend, q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window,
                             dropout_p, dropout_seed)
