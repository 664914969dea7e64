"""ALBERT: factorised embeddings (E -> H through the encoder's embedding_hidden_mapping_in), layers shared in
groups (the encoder reads the depth and grouping from the config on every call), a pooler without `.dense`, and
sentence-order prediction instead of next-sentence prediction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastbert.families import Family, bert, register

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    fields = bert.config_fields(raw)
    fields.update(
        embedding_size=raw.get("embedding_size", 128),
        num_hidden_groups=raw.get("num_hidden_groups", 1),
        inner_group_num=raw.get("inner_group_num", 1),
        shared_layers=True,
        hidden_act=raw.get("hidden_act", "gelu_new"),
        embedding_dropout=raw.get("hidden_dropout_prob", 0.0),
        attention_dropout=raw.get("attention_probs_dropout_prob", 0.0),
        attention_output_dropout=raw.get("hidden_dropout_prob", 0.0),
        ffn_dropout=0.0,  # AlbertLayer applies no dropout to its FFN output (its dropout module goes unused)
    )
    return fields


def layer(config: FastBertConfig, index: int) -> str:
    group, inner = divmod(index, config.inner_group_num)
    return f"encoder.albert_layer_groups.{group}.albert_layers.{inner}"


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    labels = config.num_labels
    mlm = MLMSpec(config.embedding_size, config.activation, config.layer_norm_eps, "predictions.dense",
                  "predictions.LayerNorm", "predictions.decoder", "predictions.bias")
    return {
        "masked-lm": {"mlm": mlm},
        "pretraining": {"mlm": mlm, "sop": DenseSpec(labels, "pooler", "sop_classifier.classifier")},
        "sequence-classification": {"classifier": DenseSpec(labels, "pooler", "classifier")},
        "token-classification": {"classifier": DenseSpec(labels, "tokens", "classifier")},
        "question-answering": {"qa_outputs": DenseSpec(labels, "tokens", "qa_outputs")},
        "multiple-choice": {"classifier": DenseSpec(1, "pooler", "classifier")},
    }


ALBERT = register(Family(
    name="albert",
    model_types=("albert",),
    base_prefix="albert",
    config_fields=config_fields,
    layer=layer,
    layer_params=dict(q="attention.query", k="attention.key", v="attention.value", attn_out="attention.dense",
                      attn_norm="attention.LayerNorm", ffn_in="ffn", ffn_out="ffn_output",
                      ffn_norm="full_layer_layer_norm"),
    attention="attention",
    # (AlbertLayer's own dropout module goes unused: its FFN output is not dropped)
    dropout_sites={"embedding": "embeddings.dropout", "attention": "attention:attention_dropout.p",
                   "attention_output": "attention.output_dropout"},
    ffn_activation="activation",
    heads=heads,
    layer_list=None,
    live_config=("num_hidden_layers", "num_hidden_groups", "inner_group_num"),
    embed_proj="encoder.embedding_hidden_mapping_in",
    pooler="pooler",
))
