"""Cost formulas: FLOPs per token of the whole encoder, and (from the op specs) FLOPs and bytes of each fused op.

A multiply-add counts 2 FLOPs; bytes are what a fused kernel reads plus writes. The per-op benchmark
(benchmarks/test_ops_bench.py) turns them into GB/s and TFLOP/s, the end-to-end one into a roofline fraction.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastbert.config import FastBertConfig
from fastbert.ops.attention import attended_pairs as attention_pairs  # the op's own band count
from fastbert.ops.attention import attention_cost
from fastbert.ops.embedding_layernorm import embedding_layernorm_cost
from fastbert.ops.linear_activation import linear_activation_cost
from fastbert.ops.linear_residual_layernorm import linear_residual_layernorm_cost
from fastbert.ops.qkv_projection import qkv_projection_cost
from fastbert.ops.spec import OpCost

# Each op's formula lives in its spec (`fastbert.ops.SPECS[op].cost`); these names stay for the benchmarks.
__all__ = ["OpCost", "attention_cost", "batch_flops", "embedding_layernorm_cost", "encoder_flops_per_token",
           "linear_activation_cost", "linear_residual_layernorm_cost", "qkv_projection_cost"]


def encoder_flops_per_token(layers: int, hidden: int, seqlen: int, intermediate: int | None = None) -> float:
    """FLOPs per token of a BERT encoder stack with a sequence of ``seqlen`` tokens (multiply-add = 2 FLOPs).

    Per layer: Q, K, V and output projections 2*4*H^2, FFN 2*2*H*I, attention scores and context 2*2*S*H. With
    I = 4H this is the usual ``L * (24*H^2 + 4*S*H)``; embeddings, LayerNorms, softmax and the pooler are left out
    (they are a few per cent at BERT sizes).
    """
    intermediate = 4 * hidden if intermediate is None else intermediate
    return float(layers * (8 * hidden * hidden + 4 * hidden * intermediate + 4 * seqlen * hidden))


def batch_flops(config: FastBertConfig, lengths: Sequence[int]) -> float:
    """Useful FLOPs of one forward over sequences of the given real lengths (padding excluded).

    BERT's layers as `encoder_flops_per_token`. ModernBERT's differ in two places: the GLU FFN's input projection
    gives 2I columns (FFN 2*3*H*I instead of 2*2*H*I), and a sliding-window layer's attention covers only the
    (query, key) pairs within its window (`attention_pairs`) instead of S^2."""
    hidden, inner = config.hidden_size, config.intermediate_size
    if not config.glu and not config.layer_types:
        return sum(length * encoder_flops_per_token(config.num_hidden_layers, hidden, length, inner)
                   for length in lengths)
    ffn = (6 if config.glu else 4) * hidden * inner
    total = 0.0
    for index in range(config.num_hidden_layers):
        window = config.layer_window(index)
        for length in lengths:
            total += length * (8 * hidden * hidden + ffn) + 4 * attention_pairs(length, window) * hidden
    return total
