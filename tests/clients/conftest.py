"""Fixtures of the client tests: MiniLM's tokenizer, and the real MiniLM encoder as an untouched model and an
optimized copy, bare and under seeded transformers heads. Loaded once per session; nothing is downloaded."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from the installed checkpoint or is built here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import transformers

from tests.helpers import NER_LABELS, NLI_LABELS, minilm_head_model, optimized_copy


@pytest.fixture(scope="session")
def tokenizer(minilm_dir):
    return transformers.AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="session")
def minilm_pair(minilm_dir):
    """(untouched BertModel, optimized copy) of the real all-MiniLM-L6-v2."""
    reference = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    return reference, optimized_copy(reference)


@pytest.fixture(scope="session")
def nli_pair(minilm_dir):
    """MiniLM under BertForSequenceClassification with a seeded 3-way NLI head (an entailment label, so the
    zero-shot pipeline accepts it)."""
    reference = minilm_head_model(minilm_dir, transformers.BertForSequenceClassification, seed=11,
                                  id2label=NLI_LABELS, label2id={v: k for k, v in NLI_LABELS.items()})
    return reference, optimized_copy(reference)


@pytest.fixture(scope="session")
def ner_pair(minilm_dir):
    """MiniLM under BertForTokenClassification with a seeded BIO head."""
    reference = minilm_head_model(minilm_dir, transformers.BertForTokenClassification, seed=12,
                                  id2label=NER_LABELS, label2id={v: k for k, v in NER_LABELS.items()})
    return reference, optimized_copy(reference)


@pytest.fixture(scope="session")
def mlm_pair(minilm_dir):
    """MiniLM under BertForMaskedLM: a seeded prediction transform, decoder tied to the real word embeddings."""
    reference = minilm_head_model(minilm_dir, transformers.BertForMaskedLM, seed=13)
    return reference, optimized_copy(reference)
