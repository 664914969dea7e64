"""Shared pieces of the client tests: texts, seeded models, and the check that fastbert's path really ran.

Every client test runs one client twice, on an untouched transformers model and on an optimized copy of it, and
compares what the client returns. `run_both` also counts the encoder forwards the untouched model made and asserts
that fastbert's encoder ran on every one of them in the optimized run, so a silent fallback to transformers' own
code (transformers compared with itself) fails the test.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import transformers
from transformers import PreTrainedModel

import fastbert
from fastbert.bench.recording import backends_used, record_backends
from tests.hf_tiny import ARCHITECTURE_OPS, fused_ops, tiny_model

TOL = 1e-5  # max |actual - expected| / max |expected| over one output (hidden states, scores, logits)

# Short English texts of varied lengths, one of them a single word: padded batches of mixed lengths.
TEXTS = [
    "Hello",
    "The cat sat quietly on the warm windowsill.",
    "How do I reset my password if I no longer have access to my email?",
    "Mount Everest is 8,849 metres high.",
    "Heavy rain is expected across the north of the country this weekend.",
    "Why do leaves change colour in autumn?",
]
PAIRS = [
    {"text": "A man is playing a guitar.", "text_pair": "Someone is making music."},
    {"text": "The weather is lovely today.", "text_pair": "It is raining heavily."},
    {"text": "Hi", "text_pair": "Hello there, how are you doing this fine morning?"},
    {"text": "The bank raised interest rates on Wednesday.", "text_pair": "Rates went up."},
    {"text": "She plays the piano.", "text_pair": "She"},
]
NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}

# How a pipeline is fed: one text per forward, or a list in batches of 4 (padded, mixed lengths).
BATCHING = {"batch1": 1, "batch4": 4}

OTHER_FAMILIES = ("roberta", "distilbert", "albert", "electra", "modernbert")
# The inputs each family's own tokenizer returns (RoBERTa's and DistilBERT's give no token_type_ids).
FAMILY_INPUT_NAMES = {
    "roberta": ["input_ids", "attention_mask"],
    "distilbert": ["input_ids", "attention_mask"],
    "albert": ["input_ids", "token_type_ids", "attention_mask"],
    "electra": ["input_ids", "token_type_ids", "attention_mask"],
    "modernbert": ["input_ids", "attention_mask"],
}


# ---------------------------------------------------------------------------------------------------- models
def optimized_copy(reference: torch.nn.Module) -> torch.nn.Module:
    """An optimized deep copy of an untouched model (the reference stays transformers' own code)."""
    return fastbert.optimize(copy.deepcopy(reference))


def seed_parameters(module: torch.nn.Module, seed: int, gain: float = 1.0, skip: Sequence[torch.Tensor] = ()) -> None:
    """Overwrite a freshly initialised head with seeded values large enough to give well separated scores:
    matrices N(0, gain^2 / fan_in), LayerNorm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    skip_ids = {id(t) for t in skip}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if id(param) in skip_ids:
                continue
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise * gain / math.sqrt(param.shape[-1]))
            elif "LayerNorm" in name or "layer_norm" in name:
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def quiet_from_pretrained(cls: type, path: str, **kwargs) -> PreTrainedModel:
    """cls.from_pretrained without transformers' load report (the heads are missing from the checkpoint on
    purpose: `seed_parameters` fills them)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, **kwargs).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


def minilm_head_model(path: str, cls: type, seed: int, gain: float = 3.0, **config) -> PreTrainedModel:
    """The real MiniLM encoder under a transformers head class whose head weights are seeded."""
    model = quiet_from_pretrained(cls, path, **config)
    encoder = model.base_model
    heads = [m for name, m in model.named_children() if m is not encoder]
    tied = [model.get_input_embeddings().weight]  # an MLM decoder is tied to the word embeddings: keep them
    for index, head in enumerate(heads):
        seed_parameters(head, seed + index, gain=gain, skip=tied)
    return model


def tiny_family_model(family: str, head: str, vocab_size: int) -> PreTrainedModel:
    """A seeded tiny model of `family` that MiniLM's tokenizer can feed (same vocabulary size, pad id 0)."""
    return tiny_model(family, head, vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=64)


# ------------------------------------------------------------------------------------------ fast-path check
def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers base (encoder) model inside `model` (a head model or a SentenceTransformer)."""
    bases = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.base_model is m]
    assert len(bases) == 1, f"expected one transformers encoder in {type(model).__name__}, found {len(bases)}"
    return bases[0]


@contextlib.contextmanager
def counting_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the forwards of the encoder of an *untouched* model, however they are called (sentence-transformers
    calls ``auto_model.forward`` directly, which forward hooks do not see): a counting instance attribute over the
    class's forward, removed afterwards."""
    base = base_model(model)
    assert "forward" not in vars(base), "counting_forwards is for untouched models"
    calls: list[int] = []
    original = base.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    base.forward = counted
    try:
        yield calls
    finally:
        del base.forward


def assert_fast_path(seen: dict, forwards: int, ops: Sequence[str] = ARCHITECTURE_OPS["post"]) -> None:
    """fastbert's encoder ran once per encoder forward (its embedding op runs exactly once per forward), with
    every fused op of its layer architecture (``ops``: BERT's by default)."""
    assert forwards > 0, "the client made no encoder forward at all"
    ran = sum(seen.get("embedding_layernorm", {}).values())
    assert ran == forwards, (f"fastbert's encoder ran on {ran} of the {forwards} encoder forwards; the others ran "
                             f"transformers' own code (ops seen: {backends_used(seen)})")
    assert set(seen) == set(ops), f"ops that ran: {backends_used(seen)}"


def run_both(call: Callable[[torch.nn.Module], object], reference: torch.nn.Module, optimized: torch.nn.Module,
             forwards: int | None = None) -> tuple[object, object]:
    """`call(model)` on the untouched model, then on the optimized one; asserts that fastbert took every encoder
    forward of the optimized run (and, given `forwards`, that the client made that many). Returns (expected,
    actual)."""
    with counting_forwards(reference) as calls:
        expected = call(reference)
    if forwards is not None:
        assert len(calls) == forwards, f"the client made {len(calls)} encoder forwards, not {forwards}"
    with record_backends() as seen:
        actual = call(optimized)
    assert_fast_path(seen, len(calls), fused_ops(base_model(reference)))
    return expected, actual


# ---------------------------------------------------------------------------------------------- comparisons
def rel_err(actual, expected, floor: float = 1e-6) -> float:
    """max |actual - expected| / max(max |expected|, floor) over arrays, tensors or nested lists of numbers."""
    actual = np.asarray(actual.cpu() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    expected = np.asarray(expected.cpu() if isinstance(expected, torch.Tensor) else expected, dtype=np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.size == 0:
        return 0.0
    return float(np.abs(actual - expected).max() / max(float(np.abs(expected).max()), floor))


def assert_close(actual, expected, what: str = "", tol: float = TOL) -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def split_records(records: list[dict], numeric: Sequence[str]) -> tuple[list[dict], list[float]]:
    """Pipeline records (dicts) as (their non-numeric fields, their numeric fields in order), to compare the
    first exactly and the second within tolerance."""
    exact = [{k: v for k, v in r.items() if k not in numeric} for r in records]
    values = [float(r[k]) for r in records for k in numeric]
    return exact, values

