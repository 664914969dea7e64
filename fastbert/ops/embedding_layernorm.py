"""Embedding gather (word + position + token type) + LayerNorm.

Shapes: ids of any shape [...]; tables [V, E], [P, E], [T, E]; LayerNorm weight [E] and bias [E]; returns [..., E]
in the tables' dtype. LayerNorm statistics in fp32. Optional parts: token types (DistilBERT has none; ids None with
a table: row 0), positions (``position_ids`` and ``position_embeddings`` both None: ModernBERT, whose positions are
rotary), the LayerNorm bias (None: no shift, ModernBERT's ``norm_bias=False``). With no positions and no token types
this is LayerNorm(word[ids]). Dropout (``dropout_p``, mask from ``dropout_seed``: `fastbert.ops.dropout`) acts on the
LayerNorm's output, as in BERT's embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastbert import backends
from fastbert.ops.backward import layer_norm_grads
from fastbert.ops.dropout import check_dropout, dropout
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.spec import OpCost, OpSpec, declare


def embedding_layernorm_reference(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    word_embeddings: torch.Tensor,
    position_embeddings: torch.Tensor | None,
    token_type_embeddings: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
) -> torch.Tensor:
    """Eager reference: the gathers, their sum, then LayerNorm and dropout (what BERT's embedding module does)."""
    summed = embedding_layernorm_sum(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                                     token_type_embeddings)
    return dropout(layer_norm_fp32(summed, weight, bias, eps), dropout_p, dropout_seed)


def embedding_layernorm_sum(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                            token_type_embeddings) -> torch.Tensor:
    """word[ids] (+ position[pos]) (+ token_type[types], row 0 when the ids are None), in the tables' dtype: the
    LayerNorm's input."""
    summed = F.embedding(input_ids, word_embeddings)
    if position_embeddings is not None:
        summed = summed + F.embedding(position_ids, position_embeddings)
    if token_type_embeddings is not None:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        summed = summed + F.embedding(token_type_ids, token_type_embeddings)
    return summed


def _check(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
           weight, bias, eps, dropout_p=0.0, dropout_seed=0) -> None:
    check_dropout("embedding_layernorm", dropout_p, dropout_seed)
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding_layernorm: input_ids must be int32/int64, got {input_ids.dtype}")
    if (position_ids is None) != (position_embeddings is None):
        raise ValueError("embedding_layernorm: position_ids and position_embeddings must be given together (or "
                         "both None: no position table)")
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(f"embedding_layernorm: position_ids {tuple(position_ids.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    if token_type_ids is not None and token_type_ids.shape != input_ids.shape:
        raise ValueError(f"embedding_layernorm: token_type_ids {tuple(token_type_ids.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    width = word_embeddings.shape[1]
    for name, table in (("position_embeddings", position_embeddings), ("token_type_embeddings", token_type_embeddings)):
        if table is not None and table.shape[1] != width:
            raise ValueError(f"embedding_layernorm: {name} width {table.shape[1]} != word_embeddings width {width}")
    if weight.shape != (width,) or (bias is not None and bias.shape != (width,)):
        raise ValueError(f"embedding_layernorm: LayerNorm weight/bias must be [{width}], got {tuple(weight.shape)}/"
                         f"{None if bias is None else tuple(bias.shape)}")


def _fake(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
          weight, bias, eps, dropout_p=0.0, dropout_seed=0):
    return word_embeddings.new_empty((*input_ids.shape, word_embeddings.shape[1]))


def embedding_layernorm_cost(tokens: int, width: int, dtype_bytes: int, token_types: bool = True,
                             id_bytes: int = 8, positions: bool = True) -> OpCost:
    """Gather word (+ position) (+ token type) rows, sum, LayerNorm. Bytes: the gathered rows, the id tensors, the
    LayerNorm weight and bias, the output. FLOPs: the sums plus ~8 per element for the normalisation."""
    tables = 1 + int(token_types) + int(positions)
    read = tokens * (tables * width * dtype_bytes + tables * id_bytes) + 2 * width * dtype_bytes
    write = tokens * width * dtype_bytes
    return OpCost(flops=float(tokens * width * (tables - 1 + 8)), bytes=float(read + write))


def _setup_context(ctx, inputs, output) -> None:
    ctx.eps, ctx.dropout_p, ctx.dropout_seed = inputs[-3:]
    ctx.save_for_backward(*inputs[:-3])


def _table_grad(table: torch.Tensor, ids: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
    """Each gathered row's gradient summed into its table row (in fp32: ``grad_rows`` is), in the table's dtype."""
    summed = torch.zeros(table.shape, dtype=grad_rows.dtype, device=table.device)
    return summed.index_add_(0, ids.reshape(-1), grad_rows).to(table.dtype)


def _backward(ctx, grad):
    """The gathered sum is recomputed, the LayerNorm's gradient (fp32 statistics and sums) taken, and summed
    into the rows of each table that the ids gathered (fp32 accumulation). With dropout, the incoming gradient first
    goes through the forward's mask, regenerated from its seed."""
    (input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
     weight, bias) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad = dropout(grad, ctx.dropout_p, ctx.dropout_seed)  # the forward's mask, regenerated
    summed = embedding_layernorm_sum(input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings,
                                     token_type_embeddings)
    grad_summed, grad_weight, grad_bias = layer_norm_grads(grad, summed, weight, bias, ctx.eps,
                                                           (any(needs[3:6]), needs[6], needs[7]))
    grad_word = grad_position = grad_type = None
    if any(needs[3:6]):
        grad_rows = grad_summed.reshape(-1, summed.shape[-1])
        if needs[3]:
            grad_word = _table_grad(word_embeddings, input_ids, grad_rows)
        if needs[4] and position_embeddings is not None:
            grad_position = _table_grad(position_embeddings, position_ids, grad_rows)
        if needs[5] and token_type_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            grad_type = _table_grad(token_type_embeddings, types, grad_rows)
    return None, None, None, grad_word, grad_position, grad_type, grad_weight, grad_bias, None, None, None


SPEC = declare(OpSpec(
    name="embedding_layernorm",
    cost=embedding_layernorm_cost,
    schema="(Tensor input_ids, Tensor? position_ids, Tensor? token_type_ids, Tensor word_embeddings, "
           "Tensor? position_embeddings, Tensor? token_type_embeddings, Tensor weight, Tensor? bias, float eps, "
           "float dropout_p=0.0, int dropout_seed=0) -> Tensor",
    fake=_fake,
    check=_check,
    eager=embedding_layernorm_reference,
    reference=embedding_layernorm_reference,
    setup_context=_setup_context,
    backward=_backward,
))


def embedding_layernorm(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    word_embeddings: torch.Tensor,
    position_embeddings: torch.Tensor | None,
    token_type_embeddings: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    backend: str | None = "auto",
) -> torch.Tensor:
    """dropout(LayerNorm(word[ids] + position[pos] + token_type[types])) -> [..., E]; positions, token types and the
    LayerNorm bias may be None (see the module docstring). Ids are not range-checked here (the model checks them
    once per batch)."""
    args = (input_ids, position_ids, token_type_ids, word_embeddings, position_embeddings, token_type_embeddings,
            weight, bias, eps, dropout_p, dropout_seed)
    _check(*args)
    return backends.dispatch("embedding_layernorm", backend, *args)
