"""RoBERTa, XLM-RoBERTa and CamemBERT: BERT's encoder with positions that start after the padding index, and
RoBERTa's own LM and classification heads."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fastbert.families import register
from fastbert.families.bert import BERT

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.families import HeadTable


def heads(config: FastBertConfig) -> HeadTable:
    from fastbert.heads import DenseSpec, MLMSpec

    labels, eps = config.num_labels, config.layer_norm_eps
    return {  # RobertaLMHead and RobertaClassificationHead hard-code exact GELU and tanh
        "masked-lm": {"mlm": MLMSpec(config.hidden_size, "gelu", eps, "lm_head.dense", "lm_head.layer_norm",
                                     "lm_head.decoder", "lm_head.bias")},
        "sequence-classification": {"classifier": DenseSpec(labels, "first", "classifier.out_proj",
                                                            "classifier.dense", "tanh")},
        "token-classification": {"classifier": DenseSpec(labels, "tokens", "classifier")},
        "question-answering": {"qa_outputs": DenseSpec(labels, "tokens", "qa_outputs")},
        "multiple-choice": {"classifier": DenseSpec(1, "pooler", "classifier")},
    }


ROBERTA = register(dataclasses.replace(
    BERT,
    name="roberta",
    model_types=("roberta", "xlm-roberta", "camembert"),
    base_prefix="roberta",
    offset_positions=True,
    heads=heads,
))
