"""The ops ModernBERT's layers are built from, against transformers' own modules: linear_glu (the MLP's Wi, its
chunk(2) and act(input) * gate), linear_residual_prenorm (a sublayer's residual add and the next pre-LN norm),
embedding_layernorm without positions, token types or LayerNorm bias (ModernBertEmbeddings), and the activation
names of transformers (activation_from_hf); plus the argument checks and fakes of the new ops. Every backend
available on CPU (eager, cpp; triton runs in tests/ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.modernbert.configuration_modernbert import ModernBertConfig
from transformers.models.modernbert.modeling_modernbert import ModernBertEmbeddings, ModernBertMLP

from fastbert import ops
from fastbert.numerics import assert_accurate
from fastbert.ops.linear_activation import HF_ACTIVATIONS

CPU_BACKENDS = ["eager", "cpp"]


def _config(**overrides) -> ModernBertConfig:
    sizes = dict(vocab_size=97, hidden_size=130, intermediate_size=383, num_hidden_layers=1, num_attention_heads=2,
                 pad_token_id=0, mlp_dropout=0.0, embedding_dropout=0.0)
    return ModernBertConfig(**{**sizes, **overrides})


def _randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random weights everywhere (LayerNorm weights near 1), so biases and scales are exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else torch.randn(p.shape, generator=gen) / max(1, p.shape[-1]) ** 0.5)
    return module.eval()


@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS))
def test_activation_from_hf_computes_transformers_activation(name):
    x = torch.linspace(-9, 9, 2001, dtype=torch.float64)
    ours = ops.apply_activation(x, ops.activation_from_hf(name))
    torch.testing.assert_close(ours, ACT2FN[name](x), rtol=1e-6, atol=1e-6)


def test_activation_from_hf_refuses_other_functions():
    for name in ("quick_gelu", "gelu_10", "tanh", "mish"):
        with pytest.raises(ValueError, match="not supported"):
            ops.activation_from_hf(name)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("hidden_activation", ["gelu", "gelu_pytorch_tanh", "silu", "relu"])
@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "bias"])
def test_mlp_sublayer_matches_modernbert(backend, hidden_activation, mlp_bias):
    """hidden + Wo(act(Wi_in h) * Wi_gate h) with h = mlp_norm(hidden): transformers' ModernBertMLP and
    LayerNorm(bias=False) against linear_glu + linear_residual_prenorm (fp32, within the 1e-5 rule)."""
    config = _config(hidden_activation=hidden_activation, mlp_bias=mlp_bias)
    mlp = _randomise(ModernBertMLP(config), seed=1)
    mlp_norm = _randomise(torch.nn.LayerNorm(130, eps=config.norm_eps, bias=config.norm_bias), seed=2)
    next_norm = _randomise(torch.nn.LayerNorm(130, eps=config.norm_eps, bias=config.norm_bias), seed=3)
    hidden = torch.randn(2, 7, 130, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected_sum = hidden + mlp(mlp_norm(hidden))
        expected_next = next_norm(expected_sum)
        activation = ops.activation_from_hf(config.hidden_activation)
        gated = ops.linear_glu(mlp_norm(hidden), mlp.Wi.weight, mlp.Wi.bias, activation, backend=backend)
        summed, next_normed = ops.linear_residual_prenorm(gated, mlp.Wo.weight, mlp.Wo.bias, hidden,
                                                          next_norm.weight, next_norm.bias, config.norm_eps,
                                                          backend=backend)
    assert_accurate(summed, expected_sum, expected_sum.double(), "summed")
    assert_accurate(next_normed, expected_next, expected_next.double(), "next norm")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("norm_bias", [False, True], ids=["no-ln-bias", "ln-bias"])
def test_embeddings_match_modernbert(backend, norm_bias):
    """ModernBertEmbeddings (word table + LayerNorm, no positions nor token types) is embedding_layernorm with
    position_ids, position_embeddings, token types and (for norm_bias=False) the LayerNorm bias all None."""
    config = _config(norm_bias=norm_bias)
    embeddings = _randomise(ModernBertEmbeddings(config), seed=5)
    ids = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = embeddings(input_ids=ids)
        ours = ops.embedding_layernorm(ids, None, None, embeddings.tok_embeddings.weight, None, None,
                                       embeddings.norm.weight, embeddings.norm.bias, config.norm_eps, backend=backend)
    assert_accurate(ours, expected, expected.double(), "embeddings")


def test_linear_glu_splits_weight_rows_as_chunk():
    """The first I rows of Wi project the input half, the last I the gate: a gate of zeros gives zeros."""
    x = torch.randn(4, 6)
    weight = torch.cat([torch.randn(5, 6), torch.zeros(5, 6)])
    assert ops.linear_glu(x, weight, None, "gelu", backend="eager").abs().max() == 0
    weight = torch.cat([torch.zeros(5, 6), torch.randn(5, 6)])  # act(0) = 0 for every activation
    for backend in CPU_BACKENDS:
        assert ops.linear_glu(x, weight, None, "silu", backend=backend).abs().max() == 0


def test_checks_name_the_bad_argument():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"weight must be \[2I, 8\]"):
        ops.linear_glu(x, torch.randn(7, 8), None, "gelu")
    with pytest.raises(ValueError, match=r"weight must be \[2I, 8\]"):
        ops.linear_glu(x, torch.randn(6, 9), None, "gelu")
    with pytest.raises(ValueError, match=r"bias must be \[6\]"):
        ops.linear_glu(x, torch.randn(6, 8), torch.randn(3), "gelu")
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        ops.linear_glu(x, torch.randn(6, 8), None, "swish")  # transformers' name: activation_from_hf maps it
    with pytest.raises(ValueError, match=r"residual must be \(3, 5\)"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 4), torch.ones(5), None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_weight must be \[5\]"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 5), torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match=r"ln_bias must be \[5\]"):
        ops.linear_residual_prenorm(x, torch.randn(5, 8), None, torch.randn(3, 5), torch.ones(5), torch.ones(6), 1e-5)
    ids, table = torch.randint(0, 5, (2, 3)), torch.randn(5, 4)
    with pytest.raises(ValueError, match="position_ids and position_embeddings must be given together"):
        ops.embedding_layernorm(ids, ids, None, table, None, None, torch.ones(4), None, 1e-5)
    with pytest.raises(ValueError, match="LayerNorm weight/bias must be"):
        ops.embedding_layernorm(ids, None, None, table, None, None, torch.ones(4), torch.ones(3), 1e-5)


def test_fakes_give_the_eager_shapes():
    x, weight, residual = torch.randn(2, 3, 8), torch.randn(10, 8), torch.randn(2, 3, 10)
    glu = ops.SPECS["linear_glu"]
    prenorm = ops.SPECS["linear_residual_prenorm"]
    meta = [t.to("meta") for t in (x, weight, residual)]
    assert glu.fake(meta[0], meta[1], None, "gelu").shape == glu.eager(x, weight, None, "gelu").shape == (2, 3, 5)
    fake = prenorm.fake(meta[0], meta[1], None, meta[2], meta[1][:, 0], None, 1e-5)
    eager = prenorm.eager(x, weight, None, residual, weight[:, 0], None, 1e-5)
    assert [f.shape for f in fake] == [e.shape for e in eager] == [(2, 3, 10)] * 2


def test_layer_norm_fp32_without_bias_is_the_unshifted_layernorm():
    x = torch.randn(4, 9, dtype=torch.bfloat16)
    weight = torch.rand(9, dtype=torch.bfloat16) + 0.5
    expected = F.layer_norm(x.double(), (9,), weight.double(), None, 1e-5)
    assert_accurate(ops.layernorm.layer_norm_fp32(x, weight, None, 1e-5), F.layer_norm(x, (9,), weight, None, 1e-5),
                    expected, "bf16 LayerNorm without bias")
