"""The family registry (`fastbert.families`): every model type has exactly one family, each family is complete
(config fields, key map, heads), and the registry refuses what it cannot run."""

from __future__ import annotations

import dataclasses

import pytest

from fastbert import families
from fastbert.config import FastBertConfig
from fastbert.heads import supported_tasks
from fastbert.loading import encoder_key_map
from tests.helpers import FAMILIES as TINY_FAMILIES
from tests.helpers import tiny_model


def test_registry_covers_the_tested_model_types():
    assert set(families.model_types()) == set(TINY_FAMILIES)
    assert families.get("xlm-roberta") is families.get("roberta")


def test_unknown_model_type_lists_the_supported_ones():
    with pytest.raises(ValueError, match="'gpt2' is not supported.*'distilbert'"):
        families.get("gpt2")
    with pytest.raises(ValueError, match="not supported"):
        FastBertConfig.from_hf_dict({"model_type": "gpt2", "vocab_size": 10})


def test_a_model_type_has_one_family():
    bert = families.get("bert")
    with pytest.raises(ValueError, match="already registered"):
        families.register(dataclasses.replace(bert, name="other"))
    with pytest.raises(ValueError, match="names no module"):
        families.register(dataclasses.replace(bert, name="partial", model_types=("partial",),
                                              layer_params={"q": "query"}))
    assert "partial" not in families.model_types()


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_each_familys_key_map_names_exactly_the_encoder_of_the_transformers_model(model_type):
    model = tiny_model(model_type)
    config = FastBertConfig.from_hf_dict(model.config.to_dict())
    assert supported_tasks(config)
    keys = [key for _, theirs in encoder_key_map(config) for key in theirs]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(dict(model.named_parameters())), "key map and transformers' parameters differ"
