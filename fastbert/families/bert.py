"""BERT (and the checkpoints that declare model_type "bert": MiniLM, bge, ...): the layout the other families
vary. `config_fields`, `layer` and `LAYER_PARAMS` are shared with RoBERTa and ELECTRA."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastbert.families import Family, register

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """BertConfig's names, which are fastbert's. Dropout: hidden_dropout_prob on the embeddings and after each
    sublayer's output projection, attention_probs_dropout_prob on the attention probabilities."""
    hidden_dropout = raw.get("hidden_dropout_prob", 0.1)
    return dict(
        embedding_dropout=hidden_dropout,
        attention_dropout=raw.get("attention_probs_dropout_prob", 0.1),
        attention_output_dropout=hidden_dropout,
        ffn_dropout=hidden_dropout,
        hidden_size=raw.get("hidden_size", 768),
        num_hidden_layers=raw.get("num_hidden_layers", 12),
        num_attention_heads=raw.get("num_attention_heads", 12),
        intermediate_size=raw.get("intermediate_size", 3072),
        hidden_act=raw.get("hidden_act", "gelu"),
        type_vocab_size=raw.get("type_vocab_size", 2),
        layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
    )


def layer(config: FastBertConfig, index: int) -> str:
    return f"encoder.layer.{index}"


LAYER_PARAMS = dict(q="attention.self.query", k="attention.self.key", v="attention.self.value",
                    attn_out="attention.output.dense", attn_norm="attention.output.LayerNorm",
                    ffn_in="intermediate.dense", ffn_out="output.dense", ffn_norm="output.LayerNorm")


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    labels, eps = config.num_labels, config.layer_norm_eps
    mlm = MLMSpec(config.hidden_size, config.activation, eps, "cls.predictions.transform.dense",
                  "cls.predictions.transform.LayerNorm", "cls.predictions.decoder", "cls.predictions.bias")
    nsp = DenseSpec(2, "pooler", "cls.seq_relationship")
    return {
        "masked-lm": {"mlm": mlm},
        "next-sentence": {"nsp": nsp},
        "pretraining": {"mlm": mlm, "nsp": nsp},
        "sequence-classification": {"classifier": DenseSpec(labels, "pooler", "classifier")},
        "token-classification": {"classifier": DenseSpec(labels, "tokens", "classifier")},
        "question-answering": {"qa_outputs": DenseSpec(labels, "tokens", "qa_outputs")},
        "multiple-choice": {"classifier": DenseSpec(1, "pooler", "classifier")},
    }


BERT = register(Family(
    name="bert",
    model_types=("bert",),
    base_prefix="bert",
    config_fields=config_fields,
    layer=layer,
    layer_params=LAYER_PARAMS,
    attention="attention.self",
    ffn_activation="intermediate.intermediate_act_fn",
    heads=heads,
))
