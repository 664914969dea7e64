"""ELECTRA: BERT's encoder with factorised embeddings projected by `embeddings_project` when E != H, no pooler,
and its own heads: the replaced-token discriminator (pretraining), the generator's LM head and a sequence
summary for multiple choice, whose config options are checked by `check_task`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fastbert.families import bert, register
from fastbert.families.bert import BERT

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable
    from fastbert.heads import DenseSpec


def config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    fields = bert.config_fields(raw)
    fields.update(embedding_size=raw.get("embedding_size", fields["hidden_size"]), has_pooler=False)
    return fields


def summary(config: FastBertConfig) -> DenseSpec:
    """The multiple-choice head: sequence_summary (first token [-> dense H -> H] [-> activation]) then
    classifier H -> 1. Settings outside that are refused by `check_task`."""
    from fastbert.config import ACTIVATIONS
    from fastbert.heads import DenseSpec

    extra = config.extra
    activation = extra.get("summary_activation", "gelu") or None
    if activation is not None:
        activation = ACTIVATIONS.get(activation, activation)
    dense = "sequence_summary.summary" if extra.get("summary_use_proj", True) else None
    return DenseSpec(1, "first", "classifier", hf_dense=dense, activation=activation)


def check_task(config: FastBertConfig, task: str) -> None:
    if task != "multiple-choice":
        return
    from fastbert.config import ACTIVATIONS
    from fastbert.heads import HEAD_ACTIVATIONS

    extra = config.extra
    summary_type = extra.get("summary_type", "first")
    if summary_type != "first":
        raise ValueError(f"ELECTRA multiple choice: summary_type {summary_type!r} is not supported (only 'first'; "
                         "the others read padded positions)")
    if extra.get("summary_use_proj", True) and extra.get("summary_proj_to_labels"):
        raise ValueError("ELECTRA multiple choice: summary_proj_to_labels=True is not supported")
    activation = summary(config).activation
    if activation not in HEAD_ACTIVATIONS + (None,):
        raise ValueError(f"ELECTRA multiple choice: summary_activation {activation!r} is not supported; supported: "
                         f"{sorted(ACTIVATIONS)}, 'tanh'")


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    labels, eps = config.num_labels, config.layer_norm_eps
    return {
        "pretraining": {"discriminator": DenseSpec(1, "tokens", "discriminator_predictions.dense_prediction",
                                                   "discriminator_predictions.dense", config.activation)},
        "masked-lm": {"mlm": MLMSpec(config.embedding_size, "gelu", eps, "generator_predictions.dense",
                                     "generator_predictions.LayerNorm", "generator_lm_head", None)},
        "sequence-classification": {"classifier": DenseSpec(labels, "first", "classifier.out_proj",
                                                            "classifier.dense", "gelu")},
        "token-classification": {"classifier": DenseSpec(labels, "tokens", "classifier")},
        "question-answering": {"qa_outputs": DenseSpec(labels, "tokens", "qa_outputs")},
        "multiple-choice": {"classifier": summary(config)},
    }


ELECTRA = register(dataclasses.replace(
    BERT,
    name="electra",
    model_types=("electra",),
    base_prefix="electra",
    config_fields=config_fields,
    heads=heads,
    check_task=check_task,
))
