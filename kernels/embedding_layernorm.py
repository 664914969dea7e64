"""Embedding gather (word + position + token type) + LayerNorm in one kernel.

Each program gathers ROWS rows of the tables, sums them in fp32 (no rounding between the adds, unlike the eager
reference), and LayerNorms them with fp32 statistics; one store per element. Token types: ids may be None (then row
0 of the type table is used, as BERT does) and the table may be None (DistilBERT). Positions: ids and table both
None for a model without a position table (ModernBERT: HAS_POSITION off). LayerNorm bias None: no shift (HAS_BIAS).
Shapes: ids of any shape [...] (int32/int64), tables [V, E], [P, E], [T, E] with any strides, LayerNorm [E]
-> [..., E] contiguous in the tables' dtype. E up to 65536. Ids are not range-checked (the model checks them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastbert.ops.embedding_layernorm import SPEC, embedding_layernorm_reference

from ._common import (
    cast_rtne,
    device_reason,
    first_reason,
    float_reason,
    layernorm_tile,
    row_block,
    row_warps,
    rows_per_program,
)

__all__ = ["embedding_layernorm", "embedding_layernorm_reference", "supports"]

MAX_WIDTH = 65536


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
    HAS_POSITION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TYPE_TABLE: tl.constexpr,
    HAS_TYPE_IDS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,  # power of two >= E
):
    pid = tl.program_id(0).to(tl.int64)
    offs_r = pid * ROWS + tl.arange(0, ROWS)
    offs_e = tl.arange(0, BLOCK_E)
    row_mask = offs_r < rows
    col_mask = offs_e < E
    mask = row_mask[:, None] & col_mask[None, :]
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
    y = layernorm_tile(x, mask, offs_e, col_mask, weight_ptr, bias_ptr, E, eps, HAS_BIAS)
    tl.store(out_ptr + offs_r[:, None] * E + offs_e[None, :], cast_rtne(y, out_ptr.dtype.element_ty), mask=mask)


def supports(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
             weight, bias, eps, dropout_p=0.0, dropout_seed=0) -> str | None:
    floats = [word_embeddings, position_embeddings, token_type_embeddings, weight, bias]
    width = word_embeddings.shape[1]
    return first_reason(
        device_reason([input_ids, position_ids, token_type_ids, *floats]),
        float_reason(floats),
        f"embedding width {width} exceeds {MAX_WIDTH}" if width > MAX_WIDTH else None,
        "dropout_p > 0: this kernel has no dropout yet" if dropout_p > 0 else None,
    )


def _launch(input_ids: torch.Tensor, position_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
            word_embeddings: torch.Tensor, position_embeddings: torch.Tensor | None,
            token_type_embeddings: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            eps: float, dropout_p: float = 0.0, dropout_seed: int = 0) -> torch.Tensor:
    if dropout_p > 0:
        raise ValueError("fastbert triton embedding_layernorm: no dropout in this kernel yet (dropout_p > 0)")
    width = word_embeddings.shape[1]
    out = torch.empty(*input_ids.shape, width, dtype=word_embeddings.dtype, device=word_embeddings.device)
    rows = input_ids.numel()
    if rows == 0:
        return out
    has_table = token_type_embeddings is not None
    has_ids = has_table and token_type_ids is not None
    has_position = position_embeddings is not None
    has_bias = bias is not None
    # The kernel reads ids and LayerNorm vectors with unit stride: a strided view (e.g. `big[:, ::2]`, whose
    # reshape stays a view) must be compacted first; contiguous() copies nothing for the usual inputs.
    ids = input_ids.reshape(-1).contiguous()
    # Absent inputs are replaced by ones present (never read: their constexpr flag is off).
    positions = position_ids.reshape(-1).contiguous() if has_position else ids
    types = token_type_ids.reshape(-1).contiguous() if has_ids else ids
    weight = weight.contiguous()
    bias = bias.contiguous() if has_bias else weight
    table = token_type_embeddings if has_table else word_embeddings
    position_table = position_embeddings if has_position else word_embeddings
    per_program = rows_per_program(width)
    _embedding_layernorm_kernel[(triton.cdiv(rows, per_program),)](
        ids, positions, types,
        word_embeddings, word_embeddings.stride(0), word_embeddings.stride(1),
        position_table, position_table.stride(0), position_table.stride(1),
        table, table.stride(0), table.stride(1),
        weight, bias, out, rows, width, eps,
        HAS_POSITION=has_position, HAS_BIAS=has_bias, HAS_TYPE_TABLE=has_table, HAS_TYPE_IDS=has_ids,
        ROWS=per_program, BLOCK_E=row_block(width),
        num_warps=row_warps(width, per_program))
    return out


# torch.ops.fastbert.triton_embedding_layernorm: schema and fake from the op's spec.
_op = SPEC.define("triton_", _launch)


def embedding_layernorm(input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                        token_type_ids: torch.Tensor | None, word_embeddings: torch.Tensor,
                        position_embeddings: torch.Tensor | None, token_type_embeddings: torch.Tensor | None,
                        weight: torch.Tensor, bias: torch.Tensor | None, eps: float, dropout_p: float = 0.0,
                        dropout_seed: int = 0) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[types]) -> [..., E] (the triton backend's
    `fastbert.ops.embedding_layernorm`; positions, token types and the LayerNorm bias may be None)."""
    return torch.ops.fastbert.triton_embedding_layernorm(input_ids, position_ids, token_type_ids, word_embeddings,
                                                         position_embeddings, token_type_embeddings, weight, bias,
                                                         float(eps), float(dropout_p), int(dropout_seed))
