"""Embedding gather (word + position + token type) + LayerNorm + dropout in one kernel.

Each program gathers ROWS rows of the tables, sums them in fp32 (no rounding between the adds, unlike the eager
reference), LayerNorms them with fp32 statistics and drops out (Philox at each element's flat index
row * E + column); one store per element. Token types: ids may be None (then row
0 of the type table is used, as BERT does) and the table may be None (DistilBERT). Positions: ids and table both
None for a model without a position table (ModernBERT: HAS_POSITION off). LayerNorm bias None: no shift (HAS_BIAS).
Shapes: ids of any shape [...] (int32/int64), tables [V, E], [P, E], [T, E] with any strides, LayerNorm [E]
-> [..., E] contiguous in the tables' dtype. E up to 65536; with dropout, fewer than 2**31 output elements. Ids are
not range-checked (the model checks them).

Backward: one kernel of the same shape gathers and sums the rows again (cheaper than keeping the [rows, E] sum from
the forward: the op returns only its LayerNorm), recomputes the fp32 statistics, passes the incoming gradient
through the regenerated dropout mask, and writes the LayerNorm input's gradient in fp32 plus per-program fp32
column sums for the LayerNorm's dW/dB (two-stage: `common.column_sum`). Each table's gradient is then that fp32
gradient summed into the rows its ids gathered (torch's index_add_ into an fp32 zero table, one rounding to the
table's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.embedding_layernorm import SPEC, embedding_layernorm_reference

from .common import (
    MAX_WIDTH,
    backward_row_warps,
    backward_rows_per_program,
    cast_rtne,
    cdiv,
    column_sum,
    define_kernel_op,
    device_reason,
    dropout_args,
    dropout_keep,
    dropout_reason,
    first_reason,
    float_reason,
    launch,
    layernorm_backward_tile,
    layernorm_tile,
    reduction_programs,
    row_block,
    row_tile,
    row_warps,
    rows_per_program,
)

__all__ = ["embedding_layernorm", "embedding_layernorm_reference", "supports"]


@triton.jit
def _gathered_sum(input_ids_ptr, position_ids_ptr, token_type_ids_ptr, word_ptr, stride_word_row, stride_word_col,
                  position_ptr, stride_position_row, stride_position_col, type_ptr, stride_type_row, stride_type_col,
                  offs_r, offs_e, row_mask, mask, HAS_POSITION: tl.constexpr, HAS_TYPE_TABLE: tl.constexpr,
                  HAS_TYPE_IDS: tl.constexpr, ROWS: tl.constexpr):
    """word[ids] (+ position[pos]) (+ type[types], row 0 without ids) for rows ``offs_r``, summed in fp32."""
    word_rows = tl.load(input_ids_ptr + offs_r, mask=row_mask, other=0).to(tl.int64)
    x = tl.load(word_ptr + word_rows[:, None] * stride_word_row + offs_e[None, :] * stride_word_col, mask=mask,
                other=0.0).to(tl.float32)
    if HAS_POSITION:
        position_rows = tl.load(position_ids_ptr + offs_r, mask=row_mask, other=0).to(tl.int64)
        x += tl.load(position_ptr + position_rows[:, None] * stride_position_row
                     + offs_e[None, :] * stride_position_col, mask=mask, other=0.0).to(tl.float32)
    if HAS_TYPE_TABLE:
        if HAS_TYPE_IDS:
            type_rows = tl.load(token_type_ids_ptr + offs_r, mask=row_mask, other=0).to(tl.int64)
        else:
            type_rows = tl.zeros((ROWS,), dtype=tl.int64)
        x += tl.load(type_ptr + type_rows[:, None] * stride_type_row + offs_e[None, :] * stride_type_col, mask=mask,
                     other=0.0).to(tl.float32)
    return x


@triton.jit
def _embedding_layernorm_kernel(
    input_ids_ptr,  # [rows] word ids
    position_ids_ptr,  # [rows] position ids (ignored unless HAS_POSITION)
    token_type_ids_ptr,  # [rows] token type ids (ignored unless HAS_TYPE_IDS)
    word_ptr, stride_word_row, stride_word_col,  # [V, E] word table
    position_ptr, stride_position_row, stride_position_col,  # [P, E] position table (ignored unless HAS_POSITION)
    type_ptr, stride_type_row, stride_type_col,  # [T, E] token type table (ignored unless HAS_TYPE_TABLE)
    weight_ptr, bias_ptr,  # [E] LayerNorm scale and shift (bias ignored unless HAS_BIAS)
    out_ptr,  # [rows, E] contiguous
    rows, E, eps,
    seed, dropout_p, keep_scale,  # dropout (ignored unless DROPOUT): Philox seed, probability, 1 / (1 - p)
    HAS_POSITION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TYPE_TABLE: tl.constexpr,
    HAS_TYPE_IDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= E
):
    offs_r, offs_e, col_mask, mask = row_tile(rows, E, ROWS, BLOCK_E)
    row_mask = offs_r < rows
    x = _gathered_sum(input_ids_ptr, position_ids_ptr, token_type_ids_ptr, word_ptr, stride_word_row,
                      stride_word_col, position_ptr, stride_position_row, stride_position_col, type_ptr,
                      stride_type_row, stride_type_col, offs_r, offs_e, row_mask, mask, HAS_POSITION, HAS_TYPE_TABLE,
                      HAS_TYPE_IDS, ROWS)
    y = layernorm_tile(x, mask, offs_e, col_mask, weight_ptr, bias_ptr, E, eps, HAS_BIAS)
    if DROPOUT:
        keep = dropout_keep(seed, offs_r[:, None] * E + offs_e[None, :], dropout_p)
        y = tl.where(keep, y * keep_scale, 0.0)
    tl.store(out_ptr + offs_r[:, None] * E + offs_e[None, :], cast_rtne(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embedding_layernorm_backward_kernel(
    input_ids_ptr, position_ids_ptr, token_type_ids_ptr,  # [rows] ids, as the forward kernel's
    word_ptr, stride_word_row, stride_word_col,  # [V, E] word table
    position_ptr, stride_position_row, stride_position_col,  # [P, E] position table (ignored unless HAS_POSITION)
    type_ptr, stride_type_row, stride_type_col,  # [T, E] token type table (ignored unless HAS_TYPE_TABLE)
    weight_ptr,  # [E] LayerNorm scale
    grad_ptr, stride_grad_row, stride_grad_col,  # [rows, E] dL/d(output)
    grad_sum_ptr,  # [rows, E] fp32 contiguous: dL/d(gathered sum), what each gathered table row receives
    partial_ptr,  # [programs, 2, E] fp32 contiguous: this program's column sums of dL/dy * x_hat and dL/dy, with
    #               y the LayerNorm's output (its weight's and bias's gradients)
    rows, E, eps,
    seed, dropout_p, keep_scale,  # dropout (ignored unless DROPOUT): as the forward's
    HAS_POSITION: tl.constexpr,
    HAS_TYPE_TABLE: tl.constexpr,
    HAS_TYPE_IDS: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= E
):
    pid = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    offs_e = tl.arange(0, BLOCK_E)
    col_mask = offs_e < E
    weight = tl.load(weight_ptr + offs_e, mask=col_mask, other=0.0).to(tl.float32)
    sum_weight = tl.zeros((BLOCK_E,), dtype=tl.float32)
    sum_bias = tl.zeros((BLOCK_E,), dtype=tl.float32)
    # Row tiles pid, pid + programs, ...: each program's fp32 column sums cover a strided share of the rows.
    for tile in range(pid, tl.cdiv(rows, ROWS), programs):
        offs_r = tile * ROWS + tl.arange(0, ROWS)
        row_mask = offs_r < rows
        mask = row_mask[:, None] & col_mask[None, :]
        x = _gathered_sum(input_ids_ptr, position_ids_ptr, token_type_ids_ptr, word_ptr, stride_word_row,
                          stride_word_col, position_ptr, stride_position_row, stride_position_col, type_ptr,
                          stride_type_row, stride_type_col, offs_r, offs_e, row_mask, mask, HAS_POSITION,
                          HAS_TYPE_TABLE, HAS_TYPE_IDS, ROWS)
        grad = tl.load(grad_ptr + offs_r[:, None] * stride_grad_row + offs_e[None, :] * stride_grad_col, mask=mask,
                       other=0.0).to(tl.float32)
        if DROPOUT:
            keep = dropout_keep(seed, offs_r[:, None] * E + offs_e[None, :], dropout_p)
            grad = tl.where(keep & mask, grad * keep_scale, 0.0)
        grad_x, x_hat = layernorm_backward_tile(x, grad, mask, weight, E, eps)
        tl.store(grad_sum_ptr + offs_r[:, None] * E + offs_e[None, :], grad_x, mask=mask)
        sum_weight += tl.sum(grad * x_hat, axis=0)
        sum_bias += tl.sum(grad, axis=0)
    part = partial_ptr + pid * 2 * E + offs_e
    tl.store(part, sum_weight, mask=col_mask)
    tl.store(part + E, sum_bias, mask=col_mask)


def _width_reason(width: int) -> str | None:
    return f"embedding width {width} exceeds {MAX_WIDTH} (a LayerNorm row must fit one block)" \
        if width > MAX_WIDTH else None


def _kernel_inputs(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                   token_type_embeddings) -> tuple[tuple, dict]:
    """The gather arguments both kernels take (ids, the three tables with their strides) and their flags."""
    has_table = token_type_embeddings is not None
    has_ids = has_table and token_type_ids is not None
    has_position = position_embeddings is not None
    # The kernels read ids with unit stride: a strided view (e.g. `big[:, ::2]`, whose reshape stays a view) must
    # be compacted first; contiguous() copies nothing for the usual inputs.
    ids = input_ids.reshape(-1).contiguous()
    # Absent inputs are replaced by ones present (never read: their constexpr flag is off).
    positions = position_ids.reshape(-1).contiguous() if has_position else ids
    types = token_type_ids.reshape(-1).contiguous() if has_ids else ids
    table = token_type_embeddings if has_table else word_embeddings
    position_table = position_embeddings if has_position else word_embeddings
    args = (ids, positions, types,
            word_embeddings, word_embeddings.stride(0), word_embeddings.stride(1),
            position_table, position_table.stride(0), position_table.stride(1),
            table, table.stride(0), table.stride(1))
    return args, {"HAS_POSITION": has_position, "HAS_TYPE_TABLE": has_table, "HAS_TYPE_IDS": has_ids}


def _launch(input_ids: torch.Tensor, position_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
            word_embeddings: torch.Tensor, position_embeddings: torch.Tensor | None,
            token_type_embeddings: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    width = word_embeddings.shape[1]
    reason = _width_reason(width) or dropout_reason(dropout_p, input_ids.numel() * width)
    if reason:
        raise ValueError(f"fastbert triton embedding_layernorm: {reason}")
    out = torch.empty(*input_ids.shape, width, dtype=word_embeddings.dtype, device=word_embeddings.device)
    rows = input_ids.numel()
    if rows == 0:
        return out
    gather, flags = _kernel_inputs(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                                   token_type_embeddings)
    has_bias = bias is not None
    weight = weight.contiguous()
    bias = bias.contiguous() if has_bias else weight
    per_program = rows_per_program(width)
    launch(_embedding_layernorm_kernel, (cdiv(rows, per_program),),
        *gather, weight, bias, out, rows, width, eps, *dropout_args(dropout_p, dropout_seed),
        **flags, HAS_BIAS=has_bias, DROPOUT=dropout_p > 0, ROWS=per_program, BLOCK_E=row_block(width),
        num_warps=row_warps(width, per_program))
    return out


# ------------------------------------------------------------------------------------------------------ autograd
def _table_grad(table: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
    """Each gathered row's fp32 gradient summed into its table row in fp32, returned in the table's dtype."""
    summed = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    return summed.index_add_(0, ids.reshape(-1), grad_rows).to(table.dtype)


def _backward_impl(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                   token_type_embeddings, weight, grad, eps, dropout_p, dropout_seed):
    width = word_embeddings.shape[1]
    rows = input_ids.numel()
    grad_rows = grad.reshape(-1, width)
    grad_sum = torch.empty((rows, width), dtype=torch.float32, device=grad.device)
    if rows == 0:
        return grad_sum, torch.zeros((2, width), dtype=torch.float32, device=grad.device)
    per_program = backward_rows_per_program(width)
    programs = reduction_programs(cdiv(rows, per_program), grad.device)
    partial = torch.empty((programs, 2 * width), dtype=torch.float32, device=grad.device)
    gather, flags = _kernel_inputs(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                                   token_type_embeddings)
    launch(_embedding_layernorm_backward_kernel, (programs,),
        *gather, weight.contiguous(), grad_rows, grad_rows.stride(0), grad_rows.stride(1), grad_sum, partial,
        rows, width, eps, *dropout_args(dropout_p, dropout_seed),
        **flags, DROPOUT=dropout_p > 0, ROWS=per_program, BLOCK_E=row_block(width),
        num_warps=backward_row_warps(width, per_program))
    return grad_sum, column_sum(partial, torch.float32).view(2, width)


def _backward_fake(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                   token_type_embeddings, weight, grad, eps, dropout_p, dropout_seed):
    width = word_embeddings.shape[1]
    return (grad.new_empty((input_ids.numel(), width), dtype=torch.float32),
            grad.new_empty((2, width), dtype=torch.float32))


# torch.ops.fastbert.triton_embedding_layernorm_backward: (dL/d(gathered sum) [rows, E] fp32, [2, E] fp32: the
# LayerNorm weight's and bias's gradients).
backward_op = define_kernel_op(
    "triton_embedding_layernorm_backward",
    "(Tensor input_ids, Tensor? position_ids, Tensor? token_type_ids, Tensor word_embeddings, "
    "Tensor? position_embeddings, Tensor? token_type_embeddings, Tensor weight, Tensor grad, float eps, "
    "float dropout_p, int dropout_seed) -> (Tensor, Tensor)",
    _backward_impl, _backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = inputs[-3:]
    ctx.has_bias = inputs[7] is not None
    ctx.save_for_backward(*inputs[:7])


def _backward(ctx, grad):
    """The backward kernel (module docstring), then the tables' row sums."""
    (input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
     weight) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_sum, sums = backward_op(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                                 token_type_embeddings, weight, grad, ctx.eps, ctx.dropout_p, ctx.dropout_seed)
    grad_word = grad_position = grad_type = None
    if needs[3]:
        grad_word = _table_grad(word_embeddings, input_ids, grad_sum)
    if needs[4] and position_embeddings is not None:
        grad_position = _table_grad(position_embeddings, position_ids, grad_sum)
    if needs[5] and token_type_embeddings is not None:
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        grad_type = _table_grad(token_type_embeddings, types, grad_sum)
    grad_weight = sums[0].to(weight.dtype) if needs[6] else None
    grad_bias = sums[1].to(weight.dtype) if needs[7] and ctx.has_bias else None
    return None, None, None, grad_word, grad_position, grad_type, grad_weight, grad_bias, None, None, None


# torch.ops.fastbert.triton_embedding_layernorm: schema and fake from the op's spec, the backward above.
_op = SPEC.define("triton_", _launch, setup_context=_setup_context, backward=_backward)


def supports(input_ids: torch.Tensor, position_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
             word_embeddings: torch.Tensor, position_embeddings: torch.Tensor | None,
             token_type_embeddings: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
             dropout_p: float = 0.0, dropout_seed: int = 0) -> str | None:
    floats = [word_embeddings, position_embeddings, token_type_embeddings, weight, bias]
    width = word_embeddings.shape[1]
    return first_reason(
        device_reason([input_ids, position_ids, token_type_ids, *floats]),
        float_reason(floats),
        _width_reason(width),
        dropout_reason(dropout_p, input_ids.numel() * width),
    )


def embedding_layernorm(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                        token_type_ids: torch.Tensor | None, word_embeddings: torch.Tensor,
                        position_embeddings: torch.Tensor | None, token_type_embeddings: torch.Tensor | None,
                        weight: torch.Tensor, bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
                        dropout_seed: int = 0) -> torch.Tensor:
    """dropout(LayerNorm(word[ids] + position[pos] + token_type[types])) -> [..., E] (the triton backend's
    `fastbert.ops.embedding_layernorm`; positions, token types and the LayerNorm bias may be None)."""
    return torch.ops.fastbert.triton_embedding_layernorm(input_ids, position_ids, token_type_ids, word_embeddings,
                                                         position_embeddings, token_type_embeddings, weight, bias,
                                                         float(eps), float(dropout_p), int(dropout_seed))
