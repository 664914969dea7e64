"""DistilBERT: its own config names, a `transformer.layer` stack with q_lin/k_lin/v_lin, no token types and no
pooler."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastbert.families import Family, register

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(
        hidden_size=raw.get("dim", 768),
        num_hidden_layers=raw.get("n_layers", 6),
        num_attention_heads=raw.get("n_heads", 12),
        intermediate_size=raw.get("hidden_dim", 3072),
        hidden_act=raw.get("activation", "gelu"),
        type_vocab_size=0,
        layer_norm_eps=1e-12,  # DistilBERT hard-codes it
        has_pooler=False,
        embedding_dropout=raw.get("dropout", 0.1),
        attention_dropout=raw.get("attention_dropout", 0.1),
        attention_output_dropout=0.0,  # out_lin's result goes to the residual without dropout
        ffn_dropout=raw.get("dropout", 0.1),
    )


def layer(config: FastBertConfig, index: int) -> str:
    return f"transformer.layer.{index}"


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    labels = config.num_labels
    return {
        "masked-lm": {"mlm": MLMSpec(config.hidden_size, config.activation, 1e-12, "vocab_transform",
                                     "vocab_layer_norm", "vocab_projector", None)},
        "sequence-classification": {"classifier": DenseSpec(labels, "first", "classifier", "pre_classifier",
                                                            "relu")},
        "token-classification": {"classifier": DenseSpec(labels, "tokens", "classifier")},
        "question-answering": {"qa_outputs": DenseSpec(labels, "tokens", "qa_outputs")},
        "multiple-choice": {"classifier": DenseSpec(1, "first", "classifier", "pre_classifier", "relu")},
    }


DISTILBERT = register(Family(
    name="distilbert",
    model_types=("distilbert",),
    base_prefix="distilbert",
    config_fields=config_fields,
    layer=layer,
    layer_params=dict(q="attention.q_lin", k="attention.k_lin", v="attention.v_lin", attn_out="attention.out_lin",
                      attn_norm="sa_layer_norm", ffn_in="ffn.lin1", ffn_out="ffn.lin2", ffn_norm="output_layer_norm"),
    attention="attention",
    dropout_sites={"embedding": "embeddings.dropout", "attention": "attention:dropout.p", "ffn": "ffn.dropout"},
    ffn_activation="ffn.activation",
    heads=heads,
    layer_list="transformer.layer",
))
