"""Low-rank adapters (LoRA) inside the fused ops: the op's epilogue applied to x @ W^T + b + s * B(A(dropout(x))).

PEFT's LoRA adds ``lora_B(lora_A(lora_dropout(x))) * scaling`` beside a frozen linear layer. fastbert computes that
sum inside the layer's fused op, so that the op's epilogue (head split, rotary embedding, activation, GLU, dropout +
residual + LayerNorm) follows the sum, and no gradient is computed for the frozen weight
(`fastbert.model.adapted_op` picks the form per op):

- where the op runs its eager implementation (autograd on CPU), the update d = B(u), u = s * A(dropout(x)), rides in
  as a per-token bias, x @ W^T + (b + d), one GEMM plus the rank-r pair, autograd saving what it needs;
- a fused kernel whose epilogue is linear in the projection (the QKV head split, the rotary embedding) or adds a
  residual (without dropout) runs as before and the update is added to its output (`add_to_heads`) or residual;
- a fused kernel with a nonlinear epilogue (GELU, GLU) runs once on the augmented input [x | u] and weight [W | B]
  (r more columns of K), so the kernel applies the epilogue to the sum; `augmented_linear`'s backward gives
  gradients to x, u, B and the bias, and none to W unless it asks for one.

The adapters of one weight's row blocks form an `AdapterGroup`: for Q, K and V packed into one [3H, H] weight, one
concatenated update (u = [u_q | u_k | u_v] in one GEMM when no dropout acts, then a block-diagonal up-projection).

Dropout acts as PEFT's: each adapter's own ``nn.Dropout`` on its input, its p and mode read at call time, a mask per
adapter from torch's default generator (`input_dropout`: on CPU the C++ extension's one-pass counter-based kernel,
elsewhere 16-bit draws, the keep probability rounded to 1/65536; both several times faster than ``nn.Dropout``'s
Bernoulli draw on CPU). Inference without dropout does not come here:
`fastbert.optimize` gives the layer merged weights W + s * B @ A in storage of its own (`AdapterGroup.merged`), so
an unmerged adapter runs at the merged model's speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastbert.ops.backward import compute_dtype, linear_grads
from fastbert.ops.dropout import KERNEL_DTYPES, draw_seed, dropout, kernel_for

_LEVELS = 1 << 16  # input_dropout's resolution


def input_dropout(x: torch.Tensor, p: float) -> tuple[torch.Tensor, float]:
    """(x with each element zeroed with probability p, a scale): their product is nn.Dropout's (unbiased); the
    caller folds the scale into a later product. Where `fastbert.ops.dropout` has a kernel for x (CPU, float32 or
    bfloat16, with the C++ extension) it drops and scales in one pass, seeded from torch's default generator (scale
    1). Otherwise the mask comes from 16-bit integers (p rounded to a multiple of 1/65536), four per 64-bit draw of
    torch's default generator on x's device, and is applied as nn.Dropout applies its own, by a product."""
    if kernel_for(x) is not None and x.dtype in KERNEL_DTYPES:
        return dropout(x, p, draw_seed()), 1.0
    dropped = round(p * _LEVELS)
    if dropped == 0:
        return x, 1.0
    if dropped >= _LEVELS:
        return torch.zeros_like(x), 0.0
    words = (x.numel() + 3) // 4
    bits = torch.empty(words, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)  # every 64-bit value
    keep = bits.view(torch.int16)[:x.numel()].view(x.shape) >= dropped - _LEVELS // 2
    return x * keep, _LEVELS / (_LEVELS - dropped)


@dataclass(frozen=True, eq=False)
class LowRankAdapter:
    """One LoRA adapter of a linear layer [out, in]: down (A) [r, in], up (B) [out, r], the update's scaling, and
    the dropout module applied to its input (None: none; its p and training mode are read at call time)."""

    down: torch.Tensor
    up: torch.Tensor
    scaling: float
    dropout: nn.Dropout | None = None

    def dropping(self) -> bool:
        """Whether the input dropout acts now."""
        module = self.dropout
        return module is not None and module.training and module.p > 0

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A [out, in]: what merging adds to the frozen weight."""
        return (self.up @ self.down) * self.scaling


class AdapterGroup:
    """The adapters beside the row blocks of one weight (Q, K and V of the packed QKV weight, each optional, or a
    single block): ``widths`` are the blocks' rows, ``base`` the frozen weight the group adapts (None where the
    layer reads it otherwise: the packed QKV's sources)."""

    def __init__(self, adapters: Sequence[LowRankAdapter | None], widths: Sequence[int],
                 base: torch.Tensor | None = None):
        if len(adapters) != len(widths) or not any(adapters):
            raise ValueError("AdapterGroup: one entry (an adapter or None) per row block, at least one adapter")
        self.adapters = tuple(adapters)
        self.widths = tuple(widths)
        self.present = tuple(adapter for adapter in adapters if adapter is not None)
        self.base = base

    def dropping(self) -> bool:
        """Whether any adapter's input dropout acts now."""
        return any(adapter.dropping() for adapter in self.present)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """u = [s_i * A_i(dropout_i(x))] concatenated over the adapters -> [..., sum of ranks], in x's dtype."""
        if not self.dropping():
            stacked = torch.cat([adapter.down.to(x.dtype) * adapter.scaling for adapter in self.present])
            return F.linear(x, stacked)
        parts = []
        for adapter in self.present:
            kept, scale = input_dropout(x, adapter.dropout.p) if adapter.dropping() else (x, 1.0)
            parts.append(F.linear(kept, adapter.down.to(x.dtype)) * (adapter.scaling * scale))
        return torch.cat(parts, dim=-1)

    def up_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The up-projections as one [sum of widths, sum of ranks] weight: block-diagonal, zero rows for a block
        without an adapter."""
        if len(self.adapters) == 1:
            return self.present[0].up.to(dtype)
        blocks = [adapter.up.to(dtype) if adapter is not None else self.present[0].up.new_zeros((width, 0), dtype=dtype)
                  for adapter, width in zip(self.adapters, self.widths, strict=True)]
        return torch.block_diag(*blocks)

    def update(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The low-rank update B(u) [..., sum of widths] for input x, plus ``bias`` (broadcast over the tokens) when
        given: one GEMM that starts from the bias, no separate pass adding it."""
        u = self.down(x)
        up = self.up_weight(x.dtype)
        if bias is None:
            return F.linear(u, up)
        rows = torch.addmm(bias.to(x.dtype), u.reshape(-1, u.shape[-1]), up.t())
        return rows.view(*u.shape[:-1], up.shape[0])

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """weight (the blocks stacked, [sum of widths, in]) plus each block's s * B @ A, as a new tensor."""
        out = weight.detach().clone()
        offset = 0
        for adapter, width in zip(self.adapters, self.widths, strict=True):
            if adapter is not None:
                out[offset:offset + width] += adapter.delta_weight().detach().to(out.dtype)
            offset += width
        return out


def add_to_heads(heads: Sequence[torch.Tensor], update: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v [T, heads, D] plus the packed QKV update [T, 3 * heads * D] (its three blocks in order)."""
    blocks = update.view(*update.shape[:-1], len(heads), *heads[0].shape[-2:]).unbind(-3)
    return tuple(head + block for head, block in zip(heads, blocks, strict=True))


class _AugmentedLinear(torch.autograd.Function):
    """op([x | u], [W | B], bias, *args), differentiable with a backward that asks ``epilogue_grad`` for the
    gradient of the op's pre-epilogue result (recomputed with one GEMM) and computes W's gradient only if W needs
    one."""

    @staticmethod
    def forward(ctx, op, epilogue_grad, args, x, u, weight, up, bias):
        ctx.epilogue_grad, ctx.args = epilogue_grad, args
        ctx.save_for_backward(x, u, weight, up, bias)
        return op(torch.cat((x, u), dim=-1), torch.cat((weight, up), dim=1), bias, *args)

    @staticmethod
    def backward(ctx, grad):
        x, u, weight, up, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        compute = compute_dtype(x.dtype)
        projected = (F.linear(x, weight, bias) + F.linear(u, up)).to(compute)
        grad_projected = ctx.epilogue_grad(grad.to(compute), projected, *ctx.args)
        grad_x, grad_weight, grad_bias = linear_grads(grad_projected, x, weight, bias, (needs[3], needs[5], needs[7]))
        rows = grad_projected.reshape(-1, grad_projected.shape[-1]).to(u.dtype)
        grad_u = (rows @ up).view(u.shape) if needs[4] else None
        grad_up = rows.t() @ u.reshape(-1, u.shape[-1]) if needs[6] else None
        return None, None, None, grad_x, grad_u, grad_weight, grad_up, grad_bias


def augmented_linear(op: Callable, epilogue_grad: Callable, x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, group: AdapterGroup, *args) -> torch.Tensor:
    """``op(x, weight, bias, *args)`` (a fused linear whose epilogue is nonlinear) with the group's update added
    before the epilogue: the op runs on [x | u] and [weight | B]. ``epilogue_grad(grad, projected, *args)`` is the
    epilogue's backward: the gradient of x @ W^T + b (fp32) given the op's output gradient."""
    return _AugmentedLinear.apply(op, epilogue_grad, args, x, group.down(x), weight, group.up_weight(x.dtype), bias)


class AdaptedLinear(nn.Module):
    """A Linear of fastbert's model with LoRA adapters (the pooler, ALBERT's embedding projection): ``weight`` holds
    the merged weight, which inference reads; under autograd or adapter dropout it runs the frozen weight plus the
    update."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, adapters: AdapterGroup):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.adapters = adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapters = self.adapters
        if torch.is_grad_enabled() or adapters.dropping():
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, adapters.base.to(x.dtype), bias) + adapters.update(x)
        return F.linear(x, self.weight, self.bias)
