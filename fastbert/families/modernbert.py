"""ModernBERT (transformers' ``modernbert``): pre-LN layers with rotary positions, a packed Wqkv, GeGLU FFNs,
global and sliding-window attention layers (each kind with its own RoPE theta), a final LayerNorm, optional biases
(``attention_bias``, ``mlp_bias``, ``norm_bias``), no position table, no token types and no pooler.

Its task heads all run transformers' ModernBertPredictionHead (dense -> ``classifier_activation`` -> LayerNorm)
before a Linear: the decoder (tied to the token embeddings) for masked LM, the classifier on the first token or on
the mean of the real tokens (``classifier_pooling``) for sequence classification and multiple choice, on every
token for token classification and question answering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastbert.families import Family, register

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable

# transformers' defaults (ModernBertConfig.default_theta): RoPE theta of global and of sliding-window layers.
DEFAULT_THETA = {"full_attention": 160_000.0, "sliding_attention": 10_000.0}
POOLINGS = ("cls", "mean")


def _layer_types(raw: dict[str, Any]) -> tuple[str, ...]:
    """config.json's ``layer_types``, or, in checkpoints saved before it existed, the schedule
    ``global_attn_every_n_layers`` gives (layer i global when i % n == 0), as ModernBertConfig derives it."""
    if raw.get("layer_types"):
        return tuple(raw["layer_types"])
    every = raw.get("global_attn_every_n_layers", 3)
    return tuple("sliding_attention" if i % every else "full_attention"
                 for i in range(raw.get("num_hidden_layers", 22)))


def _rope_theta(raw: dict[str, Any]) -> dict[str, float]:
    """RoPE theta per attention kind from ``rope_parameters`` (transformers 5) or ``global_rope_theta`` /
    ``local_rope_theta`` (older checkpoints); ValueError for a RoPE variant other than the default one."""
    if raw.get("rope_scaling"):
        raise ValueError(f"modernbert: rope_scaling {raw['rope_scaling']!r} is not supported (default RoPE only)")
    params = raw.get("rope_parameters") or {}
    old = {"full_attention": raw.get("global_rope_theta"), "sliding_attention": raw.get("local_rope_theta")}
    theta = {}
    for kind in DEFAULT_THETA:
        given = params.get(kind) or {}
        rope_type = given.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"modernbert: rope_type {rope_type!r} for {kind} layers is not supported (only "
                             "'default')")
        theta[kind] = float(given.get("rope_theta") or old[kind] or DEFAULT_THETA[kind])
    return theta


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModernBertConfig's names onto fastbert's."""
    return dict(
        hidden_size=raw.get("hidden_size", 768),
        num_hidden_layers=raw.get("num_hidden_layers", 22),
        num_attention_heads=raw.get("num_attention_heads", 12),
        intermediate_size=raw.get("intermediate_size", 1152),
        hidden_act=raw.get("hidden_activation", "gelu"),
        type_vocab_size=0,
        layer_norm_eps=raw.get("norm_eps", 1e-5),
        has_pooler=False,
        classifier_activation=raw.get("classifier_activation", "gelu"),
        norm_placement="pre",
        final_norm=True,
        positions="rotary",
        rope_theta=_rope_theta(raw),
        layer_types=_layer_types(raw),
        local_attention=raw.get("local_attention", 128),
        glu=True,
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        norm_bias=bool(raw.get("norm_bias", False)),
        embedding_dropout=raw.get("embedding_dropout", 0.0),
        attention_dropout=raw.get("attention_dropout", 0.0),
        attention_output_dropout=raw.get("attention_dropout", 0.0),  # Wo's out_drop uses the same probability
        glu_dropout=raw.get("mlp_dropout", 0.0),
    )


def layer(config: FastBertConfig, index: int) -> str:
    return f"layers.{index}"


def _head_activation(config: FastBertConfig) -> str:
    from fastbert.config import ACTIVATIONS

    name = config.classifier_activation or "gelu"
    return ACTIVATIONS.get(name, name)


def check_task(config: FastBertConfig, task: str) -> None:
    from fastbert.config import ACTIVATIONS
    from fastbert.heads import HEAD_ACTIVATIONS

    pooling = config.extra.get("classifier_pooling", "cls")
    if pooling not in POOLINGS:
        raise ValueError(f"ModernBERT: classifier_pooling {pooling!r} is not supported; supported: {POOLINGS}")
    if _head_activation(config) not in HEAD_ACTIVATIONS:
        raise ValueError(f"ModernBERT: classifier_activation {config.classifier_activation!r} is not supported; "
                         f"supported: {sorted(ACTIVATIONS)}, 'tanh'")


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    extra = config.extra
    activation, eps, labels = _head_activation(config), config.layer_norm_eps, config.num_labels
    dense_bias = bool(extra.get("classifier_bias", False))
    mean = extra.get("classifier_pooling", "cls") == "mean"

    def prediction(out_features: int, source: str) -> DenseSpec:
        """ModernBertPredictionHead (dense -> activation -> LayerNorm) then the classifier Linear (with bias)."""
        return DenseSpec(out_features, source, "classifier", hf_dense="head.dense", activation=activation,
                         hf_norm="head.norm", dense_bias=dense_bias, norm_bias=config.norm_bias, eps=eps)

    return {
        "masked-lm": {"mlm": MLMSpec(config.hidden_size, activation, eps, "head.dense", "head.norm", "decoder", None,
                                     dense_bias=dense_bias, norm_bias=config.norm_bias,
                                     decoder_bias=bool(extra.get("decoder_bias", True)))},
        # "cls": position 0 (transformers' sequence classifier reads last_hidden_state[:, 0])
        "sequence-classification": {"classifier": prediction(labels, "mean" if mean else "first")},
        "token-classification": {"classifier": prediction(labels, "tokens")},
        "question-answering": {"qa_outputs": prediction(labels, "tokens")},
        # "cls": the first real token of each choice (transformers' multiple-choice head: argmax of the mask)
        "multiple-choice": {"classifier": prediction(1, "mean" if mean else "first_real")},
    }


MODERNBERT = register(Family(
    name="modernbert",
    model_types=("modernbert",),
    base_prefix="model",
    config_fields=config_fields,
    layer=layer,
    layer_params=dict(qkv="attn.Wqkv", attn_out="attn.Wo", attn_norm="attn_norm", ffn_in="mlp.Wi", ffn_out="mlp.Wo",
                      ffn_norm="mlp_norm"),
    attention="attn",
    # out_drop is an nn.Identity when the config's attention_dropout is 0; the probabilities' p is a float attribute
    dropout_sites={"embedding": "embeddings.drop", "attention": "attn:attention_dropout",
                   "attention_output": "attn.out_drop", "glu": "mlp.drop"},
    ffn_activation="mlp.act",
    heads=heads,
    layer_list="layers",
    # read by transformers on every call (the sliding-window mask), so an edit after optimize() rebuilds
    live_config=("local_attention",),
    embedding_params={"word": "embeddings.tok_embeddings", "norm": "embeddings.norm"},
    final_norm="final_norm",
    check_task=check_task,
))
