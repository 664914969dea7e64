"""QKV projection with rotary position embeddings (RoPE) on q and k: ModernBERT's Wqkv + apply_rotary_pos_emb.

One GEMM over the packed [3 * heads * D, H] weight (rows q | k | v, heads contiguous inside each), an optional
bias, then every head vector u of q and k (halves u1 = u[:D/2], u2 = u[D/2:]) is rotated by the angles of its
token's position, as transformers' ``rotate_half`` form does:

    out[:D/2] = u1 * cos - u2 * sin,    out[D/2:] = u2 * cos + u1 * sin

with cos/sin = cos/sin(position * inv_freq) read from tables of [max_positions, D/2] float32 values
(`rotary_tables`). v is not rotated. The rotation is computed in fp32 (fp64 for fp64 inputs) and stored in x's
dtype. Positions are each token's position within its own sequence: packed (varlen) batches restart them at 0 for
every sequence; a padded batch flattened to [B * S, H] passes arange(S) per row.

Shapes: x [..., H]; weight [3 * heads * D, H]; bias [3 * heads * D] | None; positions int32/int64 [...] (x's
leading shape); cos, sin float32 [P, D/2] -> (q, k, v), each [..., heads, D]. Backends may return views into one
buffer (all of them do) and callers must not assume contiguity, as for `fastbert.ops.qkv_projection`.
Positions must lie in [0, P): the functional entry checks them (a device sync on GPUs; models call the op through
an `OpTable`, which skips checks, and must size the tables to their longest sequence).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import compute_dtype, linear_grads
from fastbert.ops.spec import OpCost, OpSpec, declare

POSITION_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------------------------------- tables
@functools.lru_cache(maxsize=32)
def _tables(theta: float, head_dim: int, max_positions: int, device: torch.device) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    # Built on the CPU in float32 exactly as transformers' default RoPE does (inv_freq from arange(0, D, 2) / D,
    # angles = float(position) * inv_freq), then moved: the same values whatever the device. Outside inference
    # mode, so that a table first built under torch.inference_mode() still serves forwards with autograd.
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return angles.cos().to(device), angles.sin().to(device)


def rotary_tables(theta: float, head_dim: int, max_positions: int,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each float32 [max_positions, head_dim // 2]: cos/sin(p * inv_freq[i]) with
    inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim), transformers' default RoPE (ModernBERT: theta
    160000 for global attention layers, 10000 for sliding-window ones). Cached per (theta, head_dim, max_positions,
    device): every layer of a model shares one pair. The tensors are shared, so never write into them."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rotary_tables: head_dim must be a positive even number, got {head_dim}")
    if max_positions <= 0:
        raise ValueError(f"rotary_tables: max_positions must be positive, got {max_positions}")
    if theta <= 0:
        raise ValueError(f"rotary_tables: theta must be positive, got {theta}")
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _tables(theta, head_dim, max_positions, device)


# ----------------------------------------------------------------------------------------------------- reference
def rotate_heads(u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of head vectors u [..., heads, D] with cos, sin [..., D/2] (already gathered at each
    token's position), in fp32 (fp64 for fp64 u); returns u's dtype."""
    compute = torch.promote_types(u.dtype, torch.float32)
    u1, u2 = u.to(compute).chunk(2, dim=-1)
    c, s = cos.to(compute).unsqueeze(-2), sin.to(compute).unsqueeze(-2)
    return torch.cat((u1 * c - u2 * s, u2 * c + u1 * s), dim=-1).to(u.dtype)


def qkv_rotary_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
                         positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Eager reference (differentiable): one linear, views split into q, k, v and heads, then q and k rotated."""
    packed = F.linear(x, weight, bias)
    head_dim = weight.shape[0] // (3 * num_heads)
    q, k, v = packed.view(*x.shape[:-1], 3, num_heads, head_dim).unbind(-3)
    index = positions.long()
    c, s = cos[index], sin[index]
    return rotate_heads(q, c, s), rotate_heads(k, c, s), v


# ----------------------------------------------------------------------------------------------------- checks
def _check(x, weight, bias, num_heads, positions, cos, sin) -> None:
    if x.dim() < 1:
        raise ValueError("qkv_rotary: x must be [..., H], got a scalar")
    if not x.is_floating_point():
        raise TypeError(f"qkv_rotary: x must be a floating tensor, got {x.dtype}")
    hidden = x.shape[-1]
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"qkv_rotary: num_heads must be a positive int, got {num_heads!r}")
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"qkv_rotary: weight must be [3*heads*head_dim, {hidden}] with heads={num_heads}, "
                         f"got {tuple(weight.shape)}")
    head_dim = weight.shape[0] // (3 * num_heads)
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"qkv_rotary: head_dim = {weight.shape[0]} / (3 * {num_heads}) = {head_dim} must be even "
                         "and positive (rotary pairs its halves)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"qkv_rotary: weight and bias must have x's dtype {x.dtype}, got {weight.dtype} and "
                        f"{None if bias is None else bias.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"qkv_rotary: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if positions.dtype not in POSITION_DTYPES:
        raise TypeError(f"qkv_rotary: positions must be int32 or int64, got {positions.dtype}")
    if positions.shape != x.shape[:-1]:
        raise ValueError(f"qkv_rotary: positions must have x's leading shape {tuple(x.shape[:-1])}, got "
                         f"{tuple(positions.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dtype != torch.float32:
            raise TypeError(f"qkv_rotary: {name} must be float32 (see rotary_tables), got {table.dtype}")
        if table.dim() != 2 or table.shape[1] != head_dim // 2 or table.shape[0] == 0:
            raise ValueError(f"qkv_rotary: {name} must be [max_positions, head_dim/2 = {head_dim // 2}], got "
                             f"{tuple(table.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"qkv_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    devices = {t.device for t in (x, weight, bias, positions, cos, sin) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"qkv_rotary: all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if positions.numel() and positions.device.type != "meta" and not torch.compiler.is_compiling():
        low, high = int(positions.min()), int(positions.max())
        if low < 0 or high >= cos.shape[0]:
            raise ValueError(f"qkv_rotary: positions must lie in [0, {cos.shape[0]}) (the tables' rows), got "
                             f"[{low}, {high}]")


def _fake(x, weight, bias, positions, cos, sin, num_heads):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The torch op (for backends whose kernel is one) returns the packed [..., 3 * heads * D] buffer, q and k rotated;
# the functional entry splits it into q, k, v views (no schema can return views of one buffer without copies).
def qkv_rotary_cost(tokens: int, hidden: int, head_dim: int, dtype_bytes: int, bias: bool = False,
                    position_bytes: int = 8) -> OpCost:
    """x [T, H] @ W^T [H, 3H] (+ bias), then the rotation of q and k (4 multiplies and 2 adds per pair of
    elements: 3 FLOPs per element of q and k). Bytes: x, W, bias, the q/k/v outputs, each token's position and
    its cos/sin rows (fp32, D/2 each)."""
    flops = 2 * tokens * hidden * 3 * hidden + 3 * 2 * tokens * hidden
    moved = ((tokens * hidden + 3 * hidden * hidden + (3 * hidden if bias else 0) + 3 * tokens * hidden) * dtype_bytes
             + tokens * (position_bytes + 2 * (head_dim // 2) * 4))
    return OpCost(float(flops), float(moved))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, positions, cos, sin, num_heads = inputs
    ctx.num_heads = num_heads
    ctx.save_for_backward(x, weight, bias, positions, cos, sin)


def _backward(ctx, grad):
    """q's and k's gradients rotated back (the transposed rotation, fp32), v's as they are: the linear layer's
    upstream gradient. The tables' gradients (rarely wanted) recompute the projection."""
    x, weight, bias, positions, cos, sin = ctx.saved_tensors
    needs = ctx.needs_input_grad
    heads = ctx.num_heads
    head_dim = weight.shape[0] // (3 * heads)
    compute = compute_dtype(x.dtype)
    index = positions.long()
    c = cos[index].to(compute).unsqueeze(-2).unsqueeze(-3)  # [..., 1, 1, D/2]: q and k, every head
    s = sin[index].to(compute).unsqueeze(-2).unsqueeze(-3)
    grad = grad.reshape(*x.shape[:-1], 3, heads, head_dim).to(compute)
    g1, g2 = grad[..., :2, :, :].chunk(2, dim=-1)
    grad_qk = torch.cat((g1 * c + g2 * s, g2 * c - g1 * s), dim=-1)
    grad_packed = torch.cat((grad_qk, grad[..., 2:, :, :]), dim=-3).reshape(*x.shape[:-1], weight.shape[0])
    grad_x, grad_weight, grad_bias = linear_grads(grad_packed, x, weight, bias, needs[:3])
    grad_cos = grad_sin = None
    if needs[4] or needs[5]:
        packed = F.linear(x, weight, bias).reshape(*x.shape[:-1], 3, heads, head_dim)
        u1, u2 = packed[..., :2, :, :].to(compute).chunk(2, dim=-1)
        flat = index.reshape(-1)
        half = head_dim // 2
        if needs[4]:
            per_token = (g1 * u1 + g2 * u2).sum(dim=(-3, -2)).reshape(-1, half)
            grad_cos = torch.zeros(cos.shape, dtype=compute, device=cos.device).index_add_(0, flat, per_token)
            grad_cos = grad_cos.to(cos.dtype)
        if needs[5]:
            per_token = (g2 * u1 - g1 * u2).sum(dim=(-3, -2)).reshape(-1, half)
            grad_sin = torch.zeros(sin.shape, dtype=compute, device=sin.device).index_add_(0, flat, per_token)
            grad_sin = grad_sin.to(sin.dtype)
    return grad_x, grad_weight, grad_bias, None, grad_cos, grad_sin, None


SPEC = declare(OpSpec(
    name="qkv_rotary",
    cost=qkv_rotary_cost,
    schema="(Tensor x, Tensor weight, Tensor? bias, Tensor positions, Tensor cos, Tensor sin, int num_heads) "
           "-> Tensor",
    fake=_fake,
    check=_check,
    eager=qkv_rotary_reference,
    reference=qkv_rotary_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def split_packed(packed: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed [..., 3 * heads * D] result of a backend's torch op -> (q, k, v) views [..., heads, D]."""
    head_dim = packed.shape[-1] // (3 * num_heads)
    q, k, v = packed.view(*packed.shape[:-1], 3, num_heads, head_dim).unbind(-3)
    return q, k, v


def qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, num_heads: int,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
               backend: str | None = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) = split(x @ weight.T + bias), q and k rotated by RoPE at ``positions`` (see the module
    docstring). x [..., H]; weight [3 * heads * D, H]; bias [3 * heads * D] | None; positions int [...] (x's
    leading shape, each token's position in its own sequence, in [0, P)); cos, sin float32 [P, D/2] from
    `rotary_tables`. Returns three [..., heads, D] tensors (possibly strided views of one buffer)."""
    _check(x, weight, bias, num_heads, positions, cos, sin)
    return backends.dispatch("qkv_rotary", backend, x, weight, bias, num_heads, positions, cos, sin)
