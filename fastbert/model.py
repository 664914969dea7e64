"""fastbert's BERT-family encoder: embeddings, the layer stack (post-LN, or ModernBERT's pre-LN), pooler.

The encoder removes padding once at the entry (from ``attention_mask``), runs every token-wise op on
[total_tokens, H] with packed variable-length attention, and restores padding once at the exit; padded positions
of ``last_hidden_state`` are zeros. ``padding_free=False`` runs the same ops on the padded batch instead, with a
key padding mask in attention (same numbers at real positions).

Training: in ``train()`` mode dropout acts where the config's ``*_dropout`` fields say (fused into the ops that
take ``dropout_p``); each forward draws one seed from torch's default generator and gives each dropout site its
own (`fastbert.ops.dropout`), so ``torch.manual_seed`` makes training reproducible. In eval mode nothing is drawn.
Each module holds its sites' probabilities (``Embeddings.dropout``, the layers' ``dropout`` tuples, in the order of
their ``DROPOUT_SITES``): `fastbert.optimize` sets them from transformers' modules on every call. Under
torch.compile no seed is drawn: dropout draws from torch's traced RNG instead (`fastbert.ops.dropout.keep_mask`).

Positions: a model with a position table takes positions below ``max_position_embeddings``; a rotary model
(ModernBERT) takes any length, as transformers does: its cos/sin tables grow to the longest position seen.

Row buckets: a CPU inference forward runs its packed tokens grown by filler sequences to the next of a few row
counts (`fastbert.ops.padding.fill_rows`): oneDNN compiles a new GEMM primitive for every row count it meets (tens of
milliseconds each in bfloat16), and buffers of every size fragment the heap (a float32 server grew to 2.1 GB resident
unfilled, 0.9 GB filled). The real rows' numbers are those of the unfilled forward (up to the GEMMs' summation
order). Setting the model's ``row_buckets`` attribute to False turns it off. GPUs do not need it (their graphs
have buckets of their own).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from fastbert import backends
from fastbert.backends import tuning
from fastbert.config import FastBertConfig
from fastbert.ops.backward import activation_grad
from fastbert.ops.dropout import draw_seed, dropout, op_seed
from fastbert.ops.linear_glu import glu_grad
from fastbert.ops.low_rank import AdapterGroup, add_to_heads, augmented_linear
from fastbert.ops.padding import (
    VarlenBatch,
    fill_rows,
    has_gaps,
    pad_tokens,
    unpad_tokens,
    varlen_from_mask,
)
from fastbert.ops.qkv_rotary import rotate_heads, split_packed
from fastbert.ops.spec import SPECS
from fastbert.packing import PackedBatch


@dataclass
class EncoderOutput:
    """last_hidden_state [B, S, H] (zeros at padded positions); pooler_output [B, H] or None; hidden_states: the
    embedding output and every layer's output, each [B, S, H], when asked for; first_position [B, H]: the last state
    at position 0 as computed, where that is padding too when the call read it (`FastBertModel.forward`'s
    ``reads_first_position``, or a pooler), else zeros there."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    first_position: torch.Tensor | None = None


@dataclass
class PackedEncoderOutput:
    """`FastBertModel.forward_packed`'s result: last_hidden_state [T, H], the packed batch's rows; pooler_output
    [B, H] (the pooler on each sequence's first token) or None; hidden_states: the embedding output and every
    layer's output, each [T, H], when asked for."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class DropoutSeeds:
    """One forward's dropout: ``seeds(p)`` -> (p, a fresh seed) for the next dropout site in training mode, and
    (0.0, 0) in eval mode or for p = 0. The base seed is drawn (from torch's default generator) only when a site
    needs it, so an eval forward or a model without dropout leaves the global RNG untouched."""

    __slots__ = ("training", "base", "sites")

    def __init__(self, training: bool):
        self.training = training
        self.base: int | None = None
        self.sites = 0

    def __call__(self, p: float) -> tuple[float, int]:
        if not self.training or p == 0.0:
            return 0.0, 0
        if torch.compiler.is_compiling():  # the ops draw from torch's traced RNG (`keep_mask`): no seed to read
            return p, 0
        if self.base is None:
            self.base = draw_seed()
        self.sites += 1
        return p, op_seed(self.base, self.sites)


EVAL = DropoutSeeds(False)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape))


def _weight_and_bias(module: nn.Module, role: str, shape: tuple[int, ...], has_bias: bool) -> None:
    """Parameters ``<role>_weight`` [shape] and ``<role>_bias`` [shape[0]], the bias registered as None when the
    checkpoint has none (so that ``module._parameters[...]`` always finds it)."""
    module.register_parameter(f"{role}_weight", _param(*shape))
    module.register_parameter(f"{role}_bias", _param(shape[0]) if has_bias else None)


def _zero_row(row: int, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()  # (a hook must not change its argument)
    grad[row] = 0  # a Python index: no index tensor copied to the device on every backward
    return grad


def _no_grad_row(table: torch.Tensor | None, row: int | None) -> torch.Tensor | None:
    """``table`` as the lookup's input, with the gradient that reaches ``row`` through it zeroed (a view with a
    hook, under autograd only)."""
    if table is None or row is None or not (table.requires_grad and torch.is_grad_enabled()):
        return table
    view = table.view_as(table)
    view.register_hook(functools.partial(_zero_row, row))
    return view


class Embeddings(nn.Module):
    """Word (+ token type) (+ learned absolute position) embeddings, then LayerNorm (width E). Rotary models have
    no position table, DistilBERT and ModernBERT no token types, ModernBERT may have no LayerNorm bias."""

    def __init__(self, config: FastBertConfig):
        super().__init__()
        width = config.embedding_size
        self.word_embeddings = _param(config.vocab_size, width)
        absolute = config.positions == "absolute"
        self.position_embeddings = _param(config.max_position_embeddings, width) if absolute else None
        self.token_type_embeddings = _param(config.type_vocab_size, width) if config.type_vocab_size else None
        _weight_and_bias(self, "norm", (width,), config.norm_bias)
        self.eps = config.layer_norm_eps
        self.dropout = config.embedding_dropout
        # Table rows that get no gradient from the lookup, as transformers' nn.Embedding(padding_idx=...) (a pad
        # token at an attended position; `fastbert.optimize` reads them from the model's modules).
        self.padding_idx: int | None = config.pad_token_id
        self.position_padding_idx: int | None = config.pad_token_id if config.position_offset is not None else None

    def forward(self, input_ids, position_ids, token_type_ids, table: backends.OpTable,
                seeds: DropoutSeeds = EVAL) -> torch.Tensor:
        if self.position_embeddings is None:  # rotary positions: they act in attention, not here
            position_ids = None
        return table.embedding_layernorm(input_ids, position_ids, token_type_ids,
                                         _no_grad_row(self.word_embeddings, self.padding_idx),
                                         _no_grad_row(self.position_embeddings, self.position_padding_idx),
                                         self.token_type_embeddings, self.norm_weight, self.norm_bias, self.eps,
                                         *seeds(self.dropout))

    def from_inputs_embeds(self, inputs_embeds, position_ids, token_type_ids,
                           seeds: DropoutSeeds = EVAL) -> torch.Tensor:
        """The same sum, LayerNorm and dropout for user-given word vectors (eager: there is nothing to gather)."""
        summed = inputs_embeds
        if self.position_embeddings is not None:
            summed = summed + nn.functional.embedding(position_ids, self.position_embeddings)
        if self.token_type_embeddings is not None:
            summed = summed + nn.functional.embedding(token_type_ids, self.token_type_embeddings)
        normed = nn.functional.layer_norm(summed, summed.shape[-1:], self.norm_weight, self.norm_bias, self.eps)
        return dropout(normed, *seeds(self.dropout))


def attend(table: backends.OpTable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: VarlenBatch,
           key_padding_mask: torch.Tensor | None, scale: float, window: int | None,
           dropout: tuple[float, int]) -> torch.Tensor:
    """A layer's attention -> context [T, H]. q, k, v [T, heads, D]: packed variable-length sequences described
    by ``varlen``, or, with ``key_padding_mask`` [B, S], the whole padded batch (viewed as [B, S, heads, D]).
    ``dropout``: (p, seed) of this site."""
    tokens, heads, head_dim = q.shape
    if key_padding_mask is None:
        context = table.attention(q, k, v, varlen.cu_seqlens, varlen.max_seqlen, None, scale, window, *dropout)
    else:
        shape = (varlen.batch, varlen.seqlen, heads, head_dim)
        context = table.attention(q.view(shape), k.view(shape), v.view(shape), None, None, key_padding_mask, scale,
                                  window, *dropout)
    return context.view(tokens, heads * head_dim)


class PostNormLayer(nn.Module):
    """Post-LN transformer encoder layer (BERT, RoBERTa, ALBERT, DistilBERT, ELECTRA) with Q, K, V packed into one
    [3H, H] weight."""

    # What each entry of ``self.dropout`` is the probability of (`fastbert.families.DROPOUT_SITES`' names).
    DROPOUT_SITES = ("attention", "attention_output", "ffn")

    def __init__(self, config: FastBertConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.activation = config.activation
        self.eps = config.layer_norm_eps
        self.qkv_weight, self.qkv_bias = _param(3 * hidden, hidden), _param(3 * hidden)
        self.attn_out_weight, self.attn_out_bias = _param(hidden, hidden), _param(hidden)
        self.attn_norm_weight, self.attn_norm_bias = _param(hidden), _param(hidden)
        self.ffn_in_weight, self.ffn_in_bias = _param(inner, hidden), _param(inner)
        self.ffn_out_weight, self.ffn_out_bias = _param(hidden, inner), _param(hidden)
        self.ffn_norm_weight, self.ffn_norm_bias = _param(hidden), _param(hidden)
        self.dropout = (config.attention_dropout, config.attention_output_dropout, config.ffn_dropout)
        # Set by `fastbert.optimize`: the model's own query/key/value (weights, biases) that ``qkv_weight`` and
        # ``qkv_bias`` pack. Under autograd the packed tensors are concatenated from them on every call, so the
        # gradients reach the parameters the model's optimizer holds.
        self.qkv_sources: tuple[tuple[nn.Parameter, ...], tuple[nn.Parameter, ...]] | None = None
        # Set by `fastbert.optimize` for a PEFT model: role ("qkv", "attn_out", "ffn_in", "ffn_out") -> the LoRA
        # adapters of that linear. The role's parameter then holds the merged weight (inference reads it); under
        # autograd or adapter dropout `forward_adapted` runs the frozen weight and the update inside the ops.
        self.low_rank: dict[str, AdapterGroup] | None = None

    def packed_qkv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv_weight [3H, H], qkv_bias [3H]) as the forward uses them, in ``dtype`` (the activations')."""
        p = self._parameters
        if self.qkv_sources is not None and torch.is_grad_enabled():
            return self.source_qkv(dtype)
        return p["qkv_weight"], p["qkv_bias"]

    def source_qkv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed Q/K/V weight and bias concatenated from the model's own parameters (differentiably)."""
        weights, biases = self.qkv_sources
        return torch.cat(weights).to(dtype), (torch.cat(biases).to(dtype) if biases else self._parameters["qkv_bias"])

    def forward(self, x: torch.Tensor, varlen: VarlenBatch, key_padding_mask: torch.Tensor | None,
                table: backends.OpTable, seeds: DropoutSeeds = EVAL) -> torch.Tensor:
        """x: [T, H] packed tokens (padding_free) or [B*S, H] with key_padding_mask [B, S]. ``table`` holds the
        ops (argument order of `fastbert.backends.dispatch`); ``seeds`` the forward's dropout."""
        if self.low_rank is not None and runs_adapted(self):
            return self.forward_adapted(x, varlen, key_padding_mask, table, seeds)
        p = self._parameters  # a dict look-up per weight instead of nn.Module.__getattr__ (host time at batch 1)
        attention_p, attention_output_p, ffn_p = self.dropout
        qkv_weight, qkv_bias = self.packed_qkv(x.dtype)
        q, k, v = table.qkv_projection(x, qkv_weight, qkv_bias, self.num_heads)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, None, seeds(attention_p))
        x = table.linear_residual_layernorm(context, p["attn_out_weight"], p["attn_out_bias"], x,
                                            p["attn_norm_weight"], p["attn_norm_bias"], self.eps,
                                            *seeds(attention_output_p))
        inner = table.linear_activation(x, p["ffn_in_weight"], p["ffn_in_bias"], self.activation)
        return table.linear_residual_layernorm(inner, p["ffn_out_weight"], p["ffn_out_bias"], x,
                                               p["ffn_norm_weight"], p["ffn_norm_bias"], self.eps, *seeds(ffn_p))

    def forward_adapted(self, x: torch.Tensor, varlen: VarlenBatch, key_padding_mask: torch.Tensor | None,
                        table: backends.OpTable, seeds: DropoutSeeds = EVAL) -> torch.Tensor:
        """`forward` with the LoRA adapters of ``low_rank`` inside the ops (`fastbert.ops.low_rank`), on the
        frozen weights: autograd computes no gradient for them."""
        p = self._parameters
        attention_p, attention_output_p, ffn_p = self.dropout
        qkv_weight, qkv_bias = self.source_qkv(x.dtype)
        q, k, v = adapted_op(self, table, "qkv_projection", "qkv", x, qkv_weight, qkv_bias, self.num_heads)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, None, seeds(attention_p))
        x = adapted_op(self, table, "linear_residual_layernorm", "attn_out", context, *frozen(self, "attn_out", x),
                       x, p["attn_norm_weight"], p["attn_norm_bias"], self.eps, *seeds(attention_output_p))
        inner = adapted_op(self, table, "linear_activation", "ffn_in", x, *frozen(self, "ffn_in", x), self.activation)
        return adapted_op(self, table, "linear_residual_layernorm", "ffn_out", inner, *frozen(self, "ffn_out", inner),
                          x, p["ffn_norm_weight"], p["ffn_norm_bias"], self.eps, *seeds(ffn_p))


# ------------------------------------------------------------------------------- LoRA adapters inside the layers
def runs_adapted(layer: nn.Module) -> bool:
    """Whether ``layer`` runs `forward_adapted`: it holds adapters and autograd records or an adapter's input
    dropout acts (inference without dropout reads the merged weights instead)."""
    groups = layer.low_rank
    return groups is not None and (torch.is_grad_enabled() or any(group.dropping() for group in groups.values()))


def frozen(layer: nn.Module, role: str, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the linear ``role`` without its adapters' update, in ``like``'s dtype."""
    group = layer.low_rank.get(role)
    weight = group.base if group is not None else layer._parameters[f"{role}_weight"]
    bias = layer._parameters[f"{role}_bias"]
    return weight.to(like.dtype), None if bias is None else bias.to(like.dtype)


def adapted_op(layer: nn.Module, table: backends.OpTable, op: str, role: str, x: torch.Tensor,
               weight: torch.Tensor, bias: torch.Tensor | None, *rest):
    """``table.<op>(x, weight, bias, *rest)`` (a fused linear op on the frozen weight) with the update of the
    adapters of ``role`` added before the op's epilogue. Where the op runs its eager implementation (autograd on
    CPU), the update rides in as a per-token bias (x @ W^T + (b + update): autograd saves what it needs, nothing is
    recomputed); elsewhere the fused op runs and `_FUSED_UPDATES` adds the update around it."""
    group = layer.low_rank.get(role)
    if group is None:
        return getattr(table, op)(x, weight, bias, *rest)
    if backends.runs_eager(op, table.backend, x.device.type) or (op in _DROPOUT_OPS and rest[-2] > 0):
        return SPECS[op].eager(x, weight, group.update(x, bias), *rest)
    if op in ("linear_activation", "linear_glu"):  # u is computed inside (`augmented_linear`)
        return _FUSED_UPDATES[op](getattr(table, op), group, None, x, weight, bias, *rest)
    return _FUSED_UPDATES[op](getattr(table, op), group, group.update(x), x, weight, bias, *rest)


def _heads_update(op, group, update, x, weight, bias, num_heads):
    return add_to_heads(op(x, weight, bias, num_heads), update)


def _rotary_update(op, group, update, x, weight, bias, num_heads, positions, cos, sin):
    """The rotary embedding is linear: rotate(q + dq) = rotate(q) + rotate(dq)."""
    q, k, v = op(x, weight, bias, num_heads, positions, cos, sin)
    update_q, update_k, update_v = split_packed(update, num_heads)
    index = positions.long()
    c, s = cos[index], sin[index]
    return q + rotate_heads(update_q, c, s), k + rotate_heads(update_k, c, s), v + update_v


def _residual_update(op, group, update, x, weight, bias, residual, ln_weight, ln_bias, eps, dropout_p, dropout_seed):
    """LN(x @ W^T + b + update + residual), the update through the residual (``adapted_op`` sends calls with
    dropout to the eager form instead: a fused kernel may draw its own mask)."""
    return op(x, weight, bias, residual + update.to(residual.dtype), ln_weight, ln_bias, eps, dropout_p, dropout_seed)


def _augmented_update(epilogue_grad):
    """The update of an op with a nonlinear epilogue: the op runs on [x | u] and [W | B] (`augmented_linear`)."""
    def run(op, group, update, x, weight, bias, activation):
        return augmented_linear(op, epilogue_grad, x, weight, bias, group, activation)
    return run


# op -> how its fused implementation takes an adapter update (`adapted_op`)
_FUSED_UPDATES = {"qkv_projection": _heads_update, "qkv_rotary": _rotary_update,
                  "linear_residual_layernorm": _residual_update, "linear_residual_prenorm": _residual_update,
                  "linear_activation": _augmented_update(activation_grad), "linear_glu": _augmented_update(glu_grad)}
_DROPOUT_OPS = {"linear_residual_layernorm", "linear_residual_prenorm"}  # their last two arguments: p, seed


class PreNormLayer(nn.Module):
    """ModernBERT's pre-LN layer: x + Wo(attention(rotary(Wqkv(attn_norm(x))))), then
    x + Wo(act(input) * gate) with [input | gate] = Wi(mlp_norm(x)) (GeGLU).

    The LayerNorm before each block is fused into the op that ends the block before it: the layer takes the
    residual stream and its normed copy and returns both, the normed one by the *next* norm, whose parameters the
    caller passes (the next layer's ``attn_norm``, or the model's final norm after the last layer). So this layer's
    own ``attn_norm`` is applied by the layer before it; the first layer has none (its attention reads the
    embedding LayerNorm's output). Sliding-window layers attend keys within ``window // 2`` positions."""

    DROPOUT_SITES = ("attention", "attention_output", "glu", "ffn")  # the entries of ``self.dropout``

    def __init__(self, config: FastBertConfig, index: int):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.num_heads = config.num_attention_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.activation = config.activation
        self.eps = config.layer_norm_eps
        self.window = config.layer_window(index)
        self.theta = config.layer_theta(index)
        self.dropout = (config.attention_dropout, config.attention_output_dropout, config.glu_dropout,
                        config.ffn_dropout)

        shapes = {"qkv": ((3 * hidden, hidden), config.attention_bias),
                  "attn_out": ((hidden, hidden), config.attention_bias),
                  "attn_norm": ((hidden,), config.norm_bias),
                  "ffn_norm": ((hidden,), config.norm_bias),
                  "ffn_in": ((2 * inner, hidden), config.mlp_bias),  # rows: [input | gate]
                  "ffn_out": ((hidden, inner), config.mlp_bias)}
        if index == 0:
            del shapes["attn_norm"]
        for role, (shape, has_bias) in shapes.items():
            _weight_and_bias(self, role, shape, has_bias)
        self.low_rank: dict[str, AdapterGroup] | None = None  # LoRA adapters, as `PostNormLayer.low_rank`

    def forward(self, x: torch.Tensor, normed: torch.Tensor, varlen: VarlenBatch,
                key_padding_mask: torch.Tensor | None, table: backends.OpTable, positions: torch.Tensor,
                rotary: dict, next_norm_weight: torch.Tensor, next_norm_bias: torch.Tensor | None,
                seeds: DropoutSeeds = EVAL) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, H] (packed, or [B*S, H] with key_padding_mask [B, S]); normed: x through
        this layer's attention norm; positions [T]: each token's position in its sequence; rotary: theta ->
        (cos, sin) tables. Returns (x after the layer, that x through the next norm)."""
        if self.low_rank is not None and runs_adapted(self):
            return self.forward_adapted(x, normed, varlen, key_padding_mask, table, positions, rotary,
                                        next_norm_weight, next_norm_bias, seeds)
        p = self._parameters  # a dict look-up per weight instead of nn.Module.__getattr__ (host time at batch 1)
        attention_p, attention_output_p, glu_p, ffn_p = self.dropout
        cos, sin = rotary[self.theta]
        q, k, v = table.qkv_rotary(normed, p["qkv_weight"], p["qkv_bias"], self.num_heads, positions, cos, sin)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, self.window, seeds(attention_p))
        x, normed = table.linear_residual_prenorm(context, p["attn_out_weight"], p["attn_out_bias"], x,
                                                  p["ffn_norm_weight"], p["ffn_norm_bias"], self.eps,
                                                  *seeds(attention_output_p))
        inner = dropout(table.linear_glu(normed, p["ffn_in_weight"], p["ffn_in_bias"], self.activation),
                        *seeds(glu_p))  # (unfused: ModernBERT's mlp_dropout, 0 in its released configs)
        return table.linear_residual_prenorm(inner, p["ffn_out_weight"], p["ffn_out_bias"], x, next_norm_weight,
                                             next_norm_bias, self.eps, *seeds(ffn_p))

    def forward_adapted(self, x: torch.Tensor, normed: torch.Tensor, varlen: VarlenBatch,
                        key_padding_mask: torch.Tensor | None, table: backends.OpTable, positions: torch.Tensor,
                        rotary: dict, next_norm_weight: torch.Tensor, next_norm_bias: torch.Tensor | None,
                        seeds: DropoutSeeds = EVAL) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the LoRA adapters of ``low_rank`` inside the ops, on the frozen weights (the QKV
        update rotated like the projection: the rotary embedding is linear)."""
        p = self._parameters
        attention_p, attention_output_p, glu_p, ffn_p = self.dropout
        cos, sin = rotary[self.theta]
        q, k, v = adapted_op(self, table, "qkv_rotary", "qkv", normed, *frozen(self, "qkv", normed), self.num_heads,
                             positions, cos, sin)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, self.window, seeds(attention_p))
        x, normed = adapted_op(self, table, "linear_residual_prenorm", "attn_out", context,
                               *frozen(self, "attn_out", context), x, p["ffn_norm_weight"], p["ffn_norm_bias"],
                               self.eps, *seeds(attention_output_p))
        glu = adapted_op(self, table, "linear_glu", "ffn_in", normed, *frozen(self, "ffn_in", normed), self.activation)
        inner = dropout(glu, *seeds(glu_p))
        return adapted_op(self, table, "linear_residual_prenorm", "ffn_out", inner, *frozen(self, "ffn_out", inner), x,
                          next_norm_weight, next_norm_bias, self.eps, *seeds(ffn_p))


def normalize_attention_mask(attention_mask: torch.Tensor | None, batch: int, seqlen: int,
                             check_values: bool = True) -> torch.Tensor | None:
    """Check a user's [B, S] attention mask (1 = token, 0 = padding) and return it as bool."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != (batch, seqlen):
        raise ValueError(f"attention_mask must have shape [batch, seq] = [{batch}, {seqlen}] (1 for tokens, 0 for "
                         f"padding), got {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.dtype.is_complex:
        raise TypeError(f"attention_mask must be bool, integer or float 0/1, got {attention_mask.dtype}")
    if check_values and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        additive = "; additive float masks are not accepted" if attention_mask.is_floating_point() else ""
        raise ValueError(f"attention_mask of dtype {attention_mask.dtype} must hold only 0 and 1 (1 = attend, "
                         f"0 = padding){additive}")
    return attention_mask != 0


def zero_padding(states: list[torch.Tensor], key_padding_mask: torch.Tensor) -> list[torch.Tensor]:
    """[B, S, H] states with zeros where the [B, S] ``key_padding_mask`` is False, as the padding-free form leaves
    them (a select, not a product: a NaN or Inf computed at a padded position must not survive as NaN * 0)."""
    keep = key_padding_mask[..., None]
    return [torch.where(keep, s, s.new_zeros(())) for s in states]


class FastBertModel(nn.Module):
    """The encoder of any supported family: embeddings (+ E->H projection), the layer stack, the pooler."""

    row_buckets = True  # (also the default of a model pickled before the attribute existed)

    def __init__(self, config: FastBertConfig, backend: str = "auto", padding_free: bool = True):
        super().__init__()
        backends.requested_backend(backend)  # an unknown name fails here, not at the first forward
        self.config = config
        self.backend = backend
        self.padding_free = padding_free
        self.validate_inputs = True
        self.row_buckets = True  # CPU inference: packed rows filled to a bucket (module docstring)
        # The padded form computes rows for padded positions too; by default they are zeroed like the padding-free
        # path's (`fastbert.optimize` keeps them, as transformers computes them).
        self.zero_padded_rows = True
        self.embeddings = Embeddings(config)
        self.embed_proj = (nn.Linear(config.embedding_size, config.hidden_size)
                           if config.embedding_size != config.hidden_size else None)
        self.pre_norm = config.norm_placement == "pre"
        if self.pre_norm:
            self.layers = nn.ModuleList(PreNormLayer(config, index) for index in range(config.num_unique_layers))
        else:
            self.layers = nn.ModuleList(PostNormLayer(config) for _ in range(config.num_unique_layers))
        self.schedule = config.layer_schedule()
        if config.final_norm:
            _weight_and_bias(self, "final_norm", (config.hidden_size,), config.norm_bias)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if config.has_pooler else None

    # ----------------------------------------------------------------------------------------------- inputs
    def default_position_ids(self, input_ids: torch.Tensor | None, batch: int, seqlen: int,
                             device: torch.device) -> torch.Tensor:
        """Position ids [B, S] for a call that gives none: 0..S-1; with offset positions (RoBERTa) the count of
        non-pad tokens so far after the padding index, pad tokens at the padding index (transformers' rule), or
        offset..offset+S-1 for inputs_embeds (``input_ids`` None)."""
        offset = self.config.position_offset
        if offset is None:
            return torch.arange(seqlen, device=device).expand(batch, seqlen)
        if input_ids is not None:
            not_pad = input_ids.ne(self.config.pad_token_id).int()
            return (torch.cumsum(not_pad, dim=1) * not_pad).long() + self.config.pad_token_id
        return torch.arange(offset, offset + seqlen, device=device).expand(batch, seqlen)

    def validate_ids(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor,
                     token_type_ids: torch.Tensor | None) -> int:
        """Range checks of the ids, one min/max pass each (reading them syncs a GPU: `validate_inputs=False`
        skips this for callers that have checked their inputs). Returns the highest position id. Positions must
        lie below ``max_position_embeddings`` only where there is a position table: rotary positions have none."""
        cfg = self.config
        if input_ids is not None:
            low, high = (int(v) for v in torch.aminmax(input_ids))
            if low < 0 or high >= cfg.vocab_size:
                raise IndexError(f"input_ids hold token id {high if high >= cfg.vocab_size else low}, outside the "
                                 f"vocabulary [0, {cfg.vocab_size})")
        low, high = (int(v) for v in torch.aminmax(position_ids))
        if low < 0:
            raise ValueError(f"position ids must not be negative, got {low}")
        if high >= cfg.max_position_embeddings and cfg.positions == "absolute":
            raise ValueError(f"position id {high} is past the model's position table (max_position_embeddings="
                             f"{cfg.max_position_embeddings}): a sequence longer than the model takes (truncate it), "
                             "or position_ids out of range")
        if token_type_ids is not None:
            if cfg.type_vocab_size == 0:
                raise ValueError(f"{cfg.model_type} takes no token_type_ids")
            low, high_type = (int(v) for v in torch.aminmax(token_type_ids))
            if low < 0 or high_type >= cfg.type_vocab_size:
                raise IndexError(f"token_type_ids must lie in [0, {cfg.type_vocab_size})")
        return high

    @staticmethod
    def _batch_shape(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> tuple[int, int]:
        """(batch, seqlen) of a call, after checking that it gives one well-formed, non-empty input."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        if input_ids is not None and (input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32)):
            raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if inputs_embeds is not None and inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be [batch, seq, embedding], got {tuple(inputs_embeds.shape)}")
        batch, seqlen = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        if batch == 0 or seqlen == 0:
            raise ValueError(f"empty input: batch {batch} x sequence length {seqlen}; give at least one token")
        return batch, seqlen

    def _complete_ids(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                      position_ids: torch.Tensor | None, batch: int, seqlen: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(position_ids, token_type_ids) [B, S] of a call: the given ones ([B, S], [1, S] or [S]) checked and
        broadcast over the batch,
        the defaults otherwise (token types None for a model that has none)."""
        if token_type_ids is not None and token_type_ids.dim() == 1:  # [S], as transformers broadcasts it
            token_type_ids = token_type_ids.unsqueeze(0)
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        for name, ids in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
            if ids is not None and (ids.dim() != 2 or ids.shape[0] not in (1, batch) or ids.shape[1] != seqlen):
                raise ValueError(f"{name} must have shape [{batch}, {seqlen}] (or [1, {seqlen}]), got "
                                 f"{tuple(ids.shape)}")
        if position_ids is None:
            position_ids = self.default_position_ids(input_ids, batch, seqlen, device)
        else:
            position_ids = position_ids.expand(batch, seqlen)
        if token_type_ids is not None:
            token_type_ids = token_type_ids.expand(batch, seqlen)
        elif self.config.type_vocab_size:
            token_type_ids = torch.zeros(batch, seqlen, dtype=torch.long, device=device)
        return position_ids, token_type_ids

    # ---------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        keep_padded_rows: bool = False,
        reads_first_position: bool = False,
    ) -> EncoderOutput:
        """Encode a batch. input_ids / attention_mask / token_type_ids / position_ids: [B, S]; inputs_embeds:
        [B, S, E] instead of input_ids. Returns last_hidden_state [B, S, H] with zeros at padded positions;
        ``keep_padded_rows``: this call runs the padded form and keeps the rows it computes at padded positions, as
        transformers computes them (for a loss that reads them), whatever ``padding_free`` and
        ``zero_padded_rows`` say. The pooler, and a caller that says ``reads_first_position`` (a first-token head,
        reading ``first_position``), read position 0: where it is padding in some row (left padding), the call
        runs the padded form, which computes it as transformers does."""
        batch, seqlen = self._batch_shape(input_ids, inputs_embeds)
        device = (input_ids if input_ids is not None else inputs_embeds).device
        # Under torch.compile, reading tensor values (checks, padding removal) would break the graph: the compiled
        # model skips the value checks and runs the padded form with a key padding mask instead. torch.jit.trace
        # takes the padded form too: a traced graph of the padding-free form would bake in the example's lengths.
        compiling = torch.compiler.is_compiling() or torch.jit.is_tracing()
        # (the graphs are of the padding-free form: a padded call, see `padding_free`, launches every op)
        mask, gapped = None, False
        if not compiling and attention_mask is not None and "sliding_attention" in self.config.layer_types:
            # Windows are measured in packed positions: a row with a hole in its mask runs the padded form.
            mask = normalize_attention_mask(attention_mask, batch, seqlen)
            gapped = has_gaps(mask)
        padded = compiling or gapped or keep_padded_rows or not self.padding_free
        graphs = None if padded else self.__dict__.get("cuda_graphs")
        if graphs is not None:  # `fastbert.cuda_graphs.PackedCudaGraphs`: a replayed graph, or None for this path
            replayed = graphs.run(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                                  output_hidden_states, reads_first_position)
            if replayed is not None:
                return replayed
        if mask is None:
            mask = normalize_attention_mask(attention_mask, batch, seqlen, check_values=not compiling)
        position_ids, token_type_ids = self._complete_ids(input_ids, token_type_ids, position_ids, batch, seqlen,
                                                          device)
        # The rotary tables must cover every position: the highest when the ids were read, else the default ones'.
        position_count = seqlen
        if self.validate_inputs and not compiling:
            position_count = self.validate_ids(input_ids, position_ids, token_type_ids) + 1
        varlen = varlen_from_mask(None if padded else mask, batch, seqlen, device)
        if varlen.first_padded and (self.pooler is not None or reads_first_position):
            padded = True
            varlen = varlen_from_mask(None, batch, seqlen, device)
        key_padding_mask = mask if padded else None

        types = None if token_type_ids is None else unpad_tokens(token_type_ids, varlen)
        positions = unpad_tokens(position_ids, varlen)
        tokens = unpad_tokens(input_ids if inputs_embeds is None else inputs_embeds, varlen)
        states = self.encode_tokens(tokens, positions, types, varlen, key_padding_mask,
                                    embedded=inputs_embeds is not None, all_states=output_hidden_states,
                                    position_count=position_count)
        states = [pad_tokens(s, varlen) for s in states]
        first = states[-1][:, 0]  # before padded rows are zeroed: a left-padded row's position 0 is one
        pooled = None if self.pooler is None else torch.tanh(self.pooler(first))
        if key_padding_mask is not None and self.zero_padded_rows and not keep_padded_rows:
            states = zero_padding(states, key_padding_mask)
        return EncoderOutput(states[-1], pooled, tuple(states) if output_hidden_states else None, first)

    def forward_packed(self, batch: PackedBatch, output_hidden_states: bool = False) -> PackedEncoderOutput:
        """Encode a `fastbert.packing.PackedBatch` (on the model's device): no padding, and no tensor value read
        back from the device (its checks were made on the host when it was packed)."""
        if batch.device != self.embeddings.word_embeddings.device:
            raise ValueError(f"the packed batch is on {batch.device}, the model on "
                             f"{self.embeddings.word_embeddings.device}: move it with batch.to(device)")
        varlen = VarlenBatch(None, batch.cu_seqlens, batch.max_seqlen, batch.batch_size, batch.max_seqlen)
        states = self.encode_tokens(batch.input_ids, batch.position_ids, batch.token_type_ids, varlen, None,
                                    all_states=output_hidden_states, position_count=batch.position_count)
        hidden = states[-1]
        pooled = None
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(hidden.index_select(0, batch.cu_seqlens[:-1].long())))
        return PackedEncoderOutput(hidden, pooled, tuple(states) if output_hidden_states else None)

    def encode_tokens(self, tokens: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None,
                      varlen: VarlenBatch, key_padding_mask: torch.Tensor | None, embedded: bool = False,
                      all_states: bool = False, position_count: int = 0) -> list[torch.Tensor]:
        """Embeddings and the layer stack on flat tokens, reading no tensor values (CUDA-graph capturable).

        tokens: ids [T] (or word vectors [T, E] when ``embedded``); positions, types [T]; ``varlen`` describes
        the packed batch, or the whole padded batch when ``key_padding_mask`` [B, S] is given; ``position_count``:
        positions lie below it (rotary models; ``max_position_embeddings`` at least). Returns the hidden states
        [T, H]: the last only, or the embedding output and every layer's when ``all_states``.

        Under ``auto``, a CPU inference forward runs the whole-model winner of its class (`whole_model_backend`).
        A CPU inference forward runs the packed tokens filled to a row bucket (module docstring)."""
        like = self.embeddings.word_embeddings
        if key_padding_mask is None and self.fills_row_buckets(like):
            pad = self.config.pad_token_id
            filled = fill_rows(tokens, positions, types, varlen, pad if 0 <= pad < self.config.vocab_size else 0)
            if filled is not None:
                states = self._encode_tokens(like, filled.tokens, filled.positions, filled.types, filled.varlen,
                                             None, embedded, all_states, position_count)
                return [state[: filled.rows] for state in states]
        return self._encode_tokens(like, tokens, positions, types, varlen, key_padding_mask, embedded, all_states,
                                   position_count)

    def fills_row_buckets(self, like: torch.Tensor) -> bool:
        """Whether this call's packed tokens are filled to a row bucket: on a CPU, without autograd, outside
        torch.compile and jit tracing, unless ``row_buckets`` is off."""
        return (self.row_buckets and like.device.type == "cpu" and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling() and not torch.jit.is_tracing())

    def _encode_tokens(self, like: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       types: torch.Tensor | None, varlen: VarlenBatch, key_padding_mask: torch.Tensor | None,
                       embedded: bool, all_states: bool, position_count: int) -> list[torch.Tensor]:
        """`encode_tokens` on these rows as they are: the whole-model backend of their class, or the op table."""
        call = (tokens, positions, types, varlen, key_padding_mask, embedded, all_states, position_count)
        backend = self.whole_model_backend(tokens, like, call)
        if backend is not None:
            try:
                return self._encode(self.op_table(like, backend), *call)
            except backends.BackendUnavailable:  # the winner cannot run this model alone (an inference-mode weight
                # onednn declines, say): the per-op table runs this class from now on
                self._model_choices[self._choice_key(tokens, like)] = backends.MODEL_TABLE
        return self._encode(self.op_table(like), *call)

    def whole_model_backend(self, tokens: torch.Tensor, like: torch.Tensor, call: tuple) -> str | None:
        """The backend that runs every op of this forward alone, when the whole-model decision for its class
        (`fastbert.backends.decide_model`, made on the first such forward) is one; None for the per-op table.
        Only ``auto`` CPU inference forwards (no grad, eval mode), neither compiled nor traced, are decided whole
        (the decision's key reads the thread count, which would break a compiled graph)."""
        if (self.training or torch.is_grad_enabled() or like.device.type != "cpu" or not tuning.enabled()
                or torch.compiler.is_compiling() or torch.jit.is_tracing()
                or backends.requested_backend(self.backend) != "auto"):
            return None
        if type(next(iter(self.layers._modules.values()))) not in (PostNormLayer, PreNormLayer):
            return None  # int8 layers (`fastbert.quantization`) run GEMMs of their own: no backend to choose for them
        memo = self.__dict__.setdefault("_model_choices", {})
        choice = memo.get(self._choice_key(tokens, like))
        if choice is None:
            if not tuning.can_measure([tokens, like]):
                return None
            backends.preload(self.backend, like.device.type)  # a backend's first load moves the generation
            key = self._choice_key(tokens, like)

            def run(candidate: str) -> list[torch.Tensor]:
                table = candidate == backends.MODEL_TABLE
                return self._encode(self.op_table(like, None if table else candidate), *call)

            cls = backends.model_class(self.signature, like.dtype, tokens.shape[0])
            decision = backends.decide_model(cls, like.device, run, self.parameters())
            self.__dict__.setdefault("_model_decisions", {})[cls] = decision
            if len(memo) > 64:  # stale generations and cache locations
                memo.clear()
            choice = memo[key] = decision.backend
        return None if choice == backends.MODEL_TABLE else choice

    @staticmethod
    def _choice_key(tokens: torch.Tensor, like: torch.Tensor) -> tuple:
        return (like.dtype, torch.get_num_threads(), tuning.bucket(tokens.shape[0]), tuning.state(),
                backends.generation())

    @functools.cached_property
    def signature(self) -> str:
        """The architecture, as the tuning cache names a model: its type and a digest of its config."""
        digest = hashlib.sha256(repr(self.config).encode()).hexdigest()[:12]
        return f"{self.config.model_type}-{digest}"

    def _encode(self, table, tokens: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None,
                varlen: VarlenBatch, key_padding_mask: torch.Tensor | None, embedded: bool, all_states: bool,
                position_count: int) -> list[torch.Tensor]:
        """`encode_tokens` on the ops of ``table``."""
        seeds = DropoutSeeds(True) if self.training else EVAL
        if embedded:
            x = self.embeddings.from_inputs_embeds(tokens, positions, types, seeds)
        else:
            x = self.embeddings(tokens, positions, types, table, seeds)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        if self.pre_norm:
            rotary = self.rotary_tables(x.device, position_count)
            return self._pre_norm_stack(x, positions, varlen, key_padding_mask, table, all_states, seeds, rotary)
        states = [x]
        layers = self.layers._modules  # by string key: ModuleList indexing costs microseconds per layer
        for index in self.schedule:
            x = layers[str(index)](x, varlen, key_padding_mask, table, seeds)
            if all_states:
                states.append(x)
        return states if all_states else [x]

    def _pre_norm_stack(self, x: torch.Tensor, positions: torch.Tensor, varlen: VarlenBatch,
                        key_padding_mask: torch.Tensor | None, table, all_states: bool,
                        seeds: DropoutSeeds, rotary: dict) -> list[torch.Tensor]:
        """The pre-LN stack: each layer ends with the norm the next one starts with (the final norm after the
        last). States as transformers reports them: the embeddings, each layer's residual stream, and the last
        one after the final norm (transformers ties hidden_states[-1] to last_hidden_state)."""
        layers = self.layers._modules
        states, normed = [x], x  # the first layer's attention reads the embedding LayerNorm's output
        own = self._parameters
        for step, index in enumerate(self.schedule):
            if step + 1 < len(self.schedule):
                upcoming = layers[str(self.schedule[step + 1])]._parameters
                weight, bias = upcoming["attn_norm_weight"], upcoming["attn_norm_bias"]
            else:
                weight, bias = own["final_norm_weight"], own["final_norm_bias"]
            x, normed = layers[str(index)](x, normed, varlen, key_padding_mask, table, positions, rotary, weight,
                                           bias, seeds)
            if all_states:
                states.append(x)
        if all_states:
            states[-1] = normed
            return states
        return [normed]

    def rotary_tables(self, device: torch.device, position_count: int = 0) -> dict[float, tuple[torch.Tensor,
                                                                                               torch.Tensor]]:
        """theta -> (cos, sin) float32 [P, head_dim / 2] for every RoPE theta the layers use, on ``device``
        (shared, cached: `fastbert.ops.qkv_rotary.rotary_tables`). P is ``max_position_embeddings``, or for a
        longer input (RoPE has no length limit) the next power of two >= ``position_count``: few sizes, so few
        tables and few recompilations; their first rows are the shorter tables' values."""
        cache = self.__dict__.setdefault("_rotary", {})
        length = self.config.max_position_embeddings
        if position_count > length:
            length = 1 << (position_count - 1).bit_length()
        held = cache.get(device)
        if held is None or held[0] < length:
            from fastbert.ops.qkv_rotary import rotary_tables

            cfg = self.config
            thetas = {layer.theta for layer in self.layers}
            held = cache[device] = (length, {theta: rotary_tables(theta, cfg.head_dim, length, device)
                                             for theta in thetas})
        return held[1]

    def op_table(self, like: torch.Tensor, backend: str | None = None) -> backends.OpTable | backends.PerCallDispatch:
        """The ops for tensors like ``like`` under the current grad mode, on ``backend`` (default: the model's):
        resolved once per (device, dtype, grad mode, training mode, backend, `backends.generation()`), then called
        directly (while torch.compile traces, every call dispatches instead)."""
        backend = backend or self.backend
        if torch.compiler.is_compiling():
            return backends.PerCallDispatch(backend)
        # Training mode is part of the key: its dropout (p > 0) is an argument some kernels decline.
        key = (like.device, like.dtype, torch.is_grad_enabled(), self.training, backend, backends.generation())
        tables = self.__dict__.setdefault("_op_tables", {})
        table = tables.get(key)
        if table is None:
            if len(tables) > 16:  # stale generations
                tables.clear()
            table = tables[key] = backends.OpTable(backend, training=self.training)
        return table

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_op_tables", None)  # resolved per process
        state.pop("_model_choices", None)
        state.pop("_model_decisions", None)
        state.pop("_rotary", None)
        return state

    def pool(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """tanh(dense(first token)) [B, H], or None for a model without a pooler. hidden: [B, S, H]."""
        return torch.tanh(self.pooler(hidden[:, 0])) if self.pooler is not None else None
