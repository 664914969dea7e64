"""fastbert.optimize keeps every parameter of the model in storage of its own: savers that keep one name per
storage (accelerate, safetensors, transformers' tied-weight handling) see exactly the tensors the untouched model
has. Save round trips through those libraries are in tests/clients/test_saving.py."""

from __future__ import annotations

import collections
import re

import pytest
import torch

import fastbert
from tests.helpers import HEADS, optimize_inputs, tiny_model

CASES = [(family, head) for family, heads in HEADS.items() for head in heads]
IDS = [f"{family}-{head}" for family, head in CASES]


def storage_groups(named: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names of the tensors that share one storage, for each storage more than one of them uses."""
    by_storage = collections.defaultdict(list)
    for name, tensor in named.items():
        by_storage[(tensor.device, tensor.untyped_storage().data_ptr())].append(name)
    return sorted(sorted(names) for names in by_storage.values() if len(names) > 1)


def optimized_and_run(family: str, head: str) -> torch.nn.Module:
    """An optimized tiny model after one forward (so that fastbert's encoder is built and has run)."""
    model = fastbert.optimize(tiny_model(family, head))
    with torch.no_grad():
        model(**optimize_inputs(family, head, model))
    return model


@pytest.mark.parametrize(("family", "head"), CASES, ids=IDS)
def test_optimize_shares_no_storage_the_untouched_model_does_not(family, head):
    """Only transformers' own ties (an MLM decoder and the word embeddings) share storage, as before optimize."""
    expected = storage_groups(tiny_model(family, head).state_dict())
    model = optimized_and_run(family, head)
    assert storage_groups(model.state_dict()) == expected
    assert storage_groups(dict(model.named_parameters())) == []  # (named_parameters lists a tied one once)


def tied_weight_patterns(model: torch.nn.Module) -> list[str]:
    """Every module's ``_tied_weights_keys`` under its path, as transformers' test of them collects them."""
    patterns = []
    for name, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or {}
        patterns += [f"{name}.{key}" if name else key for key in tied]
    return patterns


def undeclared_ties(model: torch.nn.Module) -> list[list[str]]:
    """transformers' test_tied_weights_keys: state_dict entries sharing a storage, less those the model declares as
    tied, must leave at most one name per storage (else saving drops or refuses the others)."""
    patterns = tied_weight_patterns(model)
    undeclared = []
    for names in storage_groups(model.state_dict()):
        left = [name for name in names if not any(re.search(pattern, name) for pattern in patterns)]
        if len(left) > 1:
            undeclared.append(left)
    return undeclared


@pytest.mark.parametrize(("family", "head"), CASES, ids=IDS)
def test_transformers_tied_weights_keys_check_passes_after_optimize(family, head):
    torch.manual_seed(0)
    model = optimized_and_run(family, head)
    assert undeclared_ties(model) == []


@pytest.mark.parametrize("implementation", ["fused", "foreach", "for-loop"])
def test_the_packed_copy_follows_optimizer_steps_into_the_next_no_grad_call(implementation):
    """Under autograd the layers read the model's Q/K/V; the next no-grad call sees what the optimizer wrote, even
    where it moves no version counter (fused AdamW: the HF Trainer's default)."""
    family, head = "bert", "ForTokenClassification"
    model = fastbert.optimize(tiny_model(family, head)).train()
    reference = tiny_model(family, head)
    inputs = optimize_inputs(family, head, model)
    with torch.no_grad():  # the packed copy is built and read once before the steps
        model(**inputs)
    options = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **options[implementation])
    for _ in range(2):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    reference.load_state_dict(model.state_dict())
    model.eval()
    with torch.no_grad():
        got, expected = model(**inputs).logits, reference(**inputs).logits
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5)


def _packs(model: torch.nn.Module) -> list[torch.Tensor]:
    return [pack.tensor for pack in model.base_model.__dict__["_fastbert"].build.packs]


def test_another_models_optimizer_step_leaves_the_packed_copy_alone():
    """A distillation teacher beside a training student: the student's steps are not writes to the teacher."""
    family, head = "bert", "ForTokenClassification"
    teacher = fastbert.optimize(tiny_model(family, head))
    student = tiny_model(family, head).train()
    inputs = optimize_inputs(family, head, teacher)
    with torch.no_grad():
        teacher(**inputs)
    versions = [t._version for t in _packs(teacher)]
    optimizer = torch.optim.AdamW(student.parameters(), lr=0.05, fused=True)
    student(**inputs).loss.backward()
    optimizer.step()
    with torch.no_grad():
        teacher(**inputs)
    assert [t._version for t in _packs(teacher)] == versions  # not copied again


def test_inference_mode_weights_are_compared_not_copied_on_every_call():
    """Weights made under inference_mode have no version counter: each call compares the packed copy with them
    and copies only where they differ (a copy would move its counter, and onednn would pack it again)."""
    family, head = "bert", "Model"
    with torch.inference_mode():
        model = fastbert.optimize(tiny_model(family, head))
        inputs = optimize_inputs(family, head, model)
        model(**inputs)
        versions = [t._version for t in _packs(model)]
        model(**inputs)
        assert [t._version for t in _packs(model)] == versions
        first_query = model.encoder.layer[0].attention.self.query.weight
        first_query.mul_(2.0)  # an inference-mode write: no counter to see it
        again = model(**inputs).last_hidden_state
    reference = tiny_model(family, head)
    with torch.no_grad():
        reference.encoder.layer[0].attention.self.query.weight.mul_(2.0)
        expected = reference(**inputs).last_hidden_state
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(again[keep], expected[keep], rtol=1e-5, atol=1e-5)
