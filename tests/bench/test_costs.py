"""fastbert.bench.costs: FLOPs and bytes per op and per encoder token, on hand-computed numbers."""

from fastbert.bench import costs
from fastbert.config import FastBertConfig


def test_encoder_flops_bert_base_known_number():
    # BERT-base, S=128: 12 * (24 * 768^2 + 4 * 128 * 768) = 12 * 14_548_992
    assert costs.encoder_flops_per_token(12, 768, 128) == 174_587_904


def test_encoder_flops_minilm_and_explicit_intermediate():
    # MiniLM-L6-H384: I = 1536 = 4H, so both forms agree: 6 * (24 * 384^2 + 4 * 16 * 384)
    assert costs.encoder_flops_per_token(6, 384, 16) == 6 * (24 * 384**2 + 4 * 16 * 384) == 21_381_120
    assert costs.encoder_flops_per_token(6, 384, 16, intermediate=1536) == 21_381_120
    # I = 2H (not 4H): per layer 8H^2 + 4*H*I + 4SH = 16H^2 + 4SH
    assert costs.encoder_flops_per_token(1, 10, 3, intermediate=20) == 8 * 100 + 4 * 10 * 20 + 4 * 3 * 10


def test_batch_flops_sums_real_lengths_only():
    config = FastBertConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    expected = 3 * costs.encoder_flops_per_token(2, 8, 3, 32) + 5 * costs.encoder_flops_per_token(2, 8, 5, 32)
    assert costs.batch_flops(config, [3, 5]) == expected


def test_gemm_op_costs_by_hand():
    # T=2, H=4, fp32: FLOPs 2*T*H*3H = 192; bytes (x 8 + W 48 + b 12 + qkv out 24) * 4 = 368
    assert costs.qkv_projection_cost(2, 4, 4) == costs.OpCost(192.0, 368.0)
    # T=3, K=5, N=7, fp16: FLOPs 2*3*5*7 = 210; bytes (15 + 35 + 7 + 21) * 2 = 156
    assert costs.linear_activation_cost(3, 5, 7, 2) == costs.OpCost(210.0, 156.0)
    # + 10 FLOPs per output element for bias, residual and LayerNorm; bytes (15 + 35 + 21 + 2*21) * 2 = 226
    assert costs.linear_residual_layernorm_cost(3, 5, 7, 2) == costs.OpCost(210.0 + 210.0, 226.0)


def test_attention_cost_counts_each_sequence_square():
    # lengths 2 and 3, 4 heads, D=8: 4 * (4 + 9) * 4 * 8 FLOPs; q, k, v, out: 4 * 5 tokens * 32 * 2 bytes
    assert costs.attention_cost([2, 3], 4, 8, 2) == costs.OpCost(4 * 13 * 32.0, 4 * 5 * 32 * 2.0)


def test_embedding_layernorm_cost_by_hand():
    # T=2, E=4, fp32, token types: read 3 rows (48 B) + 3 int64 ids (24 B) per token, LN params 32 B, write 16 B
    cost = costs.embedding_layernorm_cost(2, 4, 4, token_types=True)
    assert cost.bytes == 2 * (48 + 24) + 32 + 2 * 16
    assert cost.flops == 2 * 4 * (2 + 8)
    assert costs.embedding_layernorm_cost(2, 4, 4, token_types=False).bytes == 2 * (32 + 16) + 32 + 2 * 16
