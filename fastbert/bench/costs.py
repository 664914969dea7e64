"""Cost formulas: FLOPs and bytes moved by each fused op (`OpCost`), and FLOPs per token of the whole encoder.

A multiply-add counts 2 FLOPs; bytes are what a fused kernel reads plus writes. The per-op benchmark
(benchmarks/test_ops_bench.py) turns them into GB/s and TFLOP/s, the end-to-end one into a roofline fraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastbert.config import FastBertConfig


@dataclass(frozen=True)
class OpCost:
    """Work of one op call: floating point operations (a multiply-add counts 2) and bytes read plus written."""

    flops: float
    bytes: float


def encoder_flops_per_token(layers: int, hidden: int, seqlen: int, intermediate: int | None = None) -> float:
    """FLOPs per token of a BERT encoder stack with a sequence of ``seqlen`` tokens (multiply-add = 2 FLOPs).

    Per layer: Q, K, V and output projections 2*4*H^2, FFN 2*2*H*I, attention scores and context 2*2*S*H. With
    I = 4H this is the usual ``L * (24*H^2 + 4*S*H)``; embeddings, LayerNorms, softmax and the pooler are left out
    (they are a few per cent at BERT sizes).
    """
    intermediate = 4 * hidden if intermediate is None else intermediate
    return float(layers * (8 * hidden * hidden + 4 * hidden * intermediate + 4 * seqlen * hidden))


def batch_flops(config: FastBertConfig, lengths: Sequence[int]) -> float:
    """Useful FLOPs of one forward over sequences of the given real lengths (padding excluded)."""
    return sum(length * encoder_flops_per_token(config.num_hidden_layers, config.hidden_size, length,
                                                config.intermediate_size) for length in lengths)


def embedding_layernorm_cost(tokens: int, width: int, dtype_bytes: int, token_types: bool = True,
                             id_bytes: int = 8) -> OpCost:
    """Gather word + position (+ token type) rows, sum, LayerNorm. Bytes: the gathered rows, the id tensors, the
    LayerNorm weight and bias, the output. FLOPs: the sums plus ~8 per element for the normalisation."""
    tables = 3 if token_types else 2
    read = tokens * (tables * width * dtype_bytes + tables * id_bytes) + 2 * width * dtype_bytes
    write = tokens * width * dtype_bytes
    return OpCost(flops=float(tokens * width * (tables - 1 + 8)), bytes=float(read + write))


def qkv_projection_cost(tokens: int, hidden: int, dtype_bytes: int) -> OpCost:
    """x [T, H] @ W^T [H, 3H] + bias. Bytes: x, W, bias, q/k/v outputs."""
    flops = 2 * tokens * hidden * 3 * hidden
    moved = (tokens * hidden + 3 * hidden * hidden + 3 * hidden + 3 * tokens * hidden) * dtype_bytes
    return OpCost(float(flops), float(moved))


def attention_cost(seqlens: Sequence[int], heads: int, head_dim: int, dtype_bytes: int) -> OpCost:
    """softmax(q k^T) v per sequence and head: 2*S^2*D for the scores plus 2*S^2*D for the context. Bytes: q, k, v
    read once and the output written (what a fused kernel moves; the unfused one also writes the S x S scores)."""
    squares = sum(s * s for s in seqlens)
    tokens = sum(seqlens)
    flops = 4 * squares * heads * head_dim
    moved = 4 * tokens * heads * head_dim * dtype_bytes
    return OpCost(float(flops), float(moved))


def linear_activation_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """act(x [T, K] @ W^T [K, N] + b). Bytes: x, W, b, the output."""
    flops = 2 * tokens * in_features * out_features
    moved = (tokens * in_features + in_features * out_features + out_features + tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def linear_residual_layernorm_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """LayerNorm(x [T, K] @ W^T + b + residual [T, N]). Bytes: x, W, b, residual, LN weight and bias, output."""
    flops = 2 * tokens * in_features * out_features + 10 * tokens * out_features
    moved = (tokens * in_features + in_features * out_features + 3 * out_features
             + 2 * tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))
