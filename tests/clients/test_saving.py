"""An optimized model saves and reloads exactly by every common path (transformers, torch, safetensors,
accelerate, the Trainer, PEFT), untrained and after training steps: each reloaded tensor equals the saved model's
(`torch.equal`) and the reloaded model, run by transformers, gives the saved model's outputs. Before fastbert kept
its packed Q/K/V in storage of its own, savers that keep one name per storage dropped K and V or refused."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

import fastbert
from tests.helpers import optimize_inputs, tiny_model

FAMILY, HEAD = "bert", "ForTokenClassification"  # no tied weights: save_file(state_dict) takes it as it is
TIED_HEADS = {"bert": "ForMaskedLM", "roberta": "ForMaskedLM", "distilbert": "ForMaskedLM", "albert": "ForMaskedLM",
              "electra": "ForMaskedLM", "modernbert": "ForMaskedLM"}


def trained(model: torch.nn.Module, family: str, head: str, steps: int) -> torch.nn.Module:
    """``model`` after ``steps`` AdamW steps on fastbert's path (its parameters moved in place), in eval mode."""
    inputs = optimize_inputs(family, head, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        model(**inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def optimized_model(family: str, head: str, steps: int) -> torch.nn.Module:
    model = fastbert.optimize(tiny_model(family, head))
    with torch.no_grad():  # build fastbert's encoder (and its packed copies) as a user's first call does
        model(**optimize_inputs(family, head, model))
    return trained(model, family, head, steps) if steps else model


def fresh(family: str, head: str) -> torch.nn.Module:
    """An untouched model of the same shape with other values (seeded differently), to load into."""
    torch.manual_seed(123)
    config = tiny_model(family, head).config
    return getattr(transformers, type(tiny_model(family, head)).__name__)(config).eval()


def from_pretrained(family: str, head: str, directory: Path) -> torch.nn.Module:
    cls = type(tiny_model(family, head))
    return cls.from_pretrained(directory, attn_implementation="eager").eval()


def assert_same_model(saved: torch.nn.Module, loaded: torch.nn.Module, family: str, head: str) -> None:
    """Every tensor equal, and the loaded model (transformers' code) gives the saved one's outputs."""
    expected, got = saved.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(expected)
    different = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert different == [], f"tensors changed by the round trip: {different}"
    inputs = optimize_inputs(family, head, saved)
    with torch.no_grad():
        want, have = saved(**inputs).logits, loaded(**inputs).logits
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(have[keep], want[keep], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ save paths: (save, load) over one directory
def save_pretrained(model, directory: Path) -> torch.nn.Module:
    model.save_pretrained(directory)
    return from_pretrained(FAMILY, HEAD, directory)


def save_pretrained_bin(model, directory: Path) -> torch.nn.Module:
    """A pytorch_model.bin checkpoint (transformers 5 writes safetensors even with safe_serialization=False)."""
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    return from_pretrained(FAMILY, HEAD, directory)


def torch_save_state_dict(model, directory: Path) -> torch.nn.Module:
    torch.save(model.state_dict(), directory / "state.pt")
    loaded = fresh(FAMILY, HEAD)
    loaded.load_state_dict(torch.load(directory / "state.pt"))
    return loaded


def torch_save_model(model, directory: Path) -> torch.nn.Module:
    torch.save(model, directory / "model.pt")
    return torch.load(directory / "model.pt", weights_only=False)  # (still optimized: the state travels)


def safetensors_save_model(model, directory: Path) -> torch.nn.Module:
    safetensors.torch.save_model(model, directory / "model.safetensors")
    loaded = fresh(FAMILY, HEAD)
    missing, unexpected = safetensors.torch.load_model(loaded, directory / "model.safetensors")
    assert (missing, unexpected) == ([], []) or (set(missing), set(unexpected)) == (set(), set())
    return loaded


def safetensors_save_file(model, directory: Path) -> torch.nn.Module:
    safetensors.torch.save_file(model.state_dict(), directory / "model.safetensors")
    loaded = fresh(FAMILY, HEAD)
    loaded.load_state_dict(safetensors.torch.load_file(directory / "model.safetensors"))
    return loaded


def accelerate_save_model(model, directory: Path) -> torch.nn.Module:
    import accelerate

    accelerate.Accelerator(cpu=True).save_model(model, directory)
    loaded = fresh(FAMILY, HEAD)
    loaded.load_state_dict(safetensors.torch.load_file(directory / "model.safetensors"))  # strict: none missing
    return loaded


def trainer_save_model(model, directory: Path) -> torch.nn.Module:
    args = transformers.TrainingArguments(output_dir=str(directory / "run"), report_to=[], use_cpu=True,
                                          disable_tqdm=True, save_strategy="no")
    transformers.Trainer(model=model, args=args).save_model(str(directory))
    return from_pretrained(FAMILY, HEAD, directory)


SAVERS: dict[str, Callable[[torch.nn.Module, Path], torch.nn.Module]] = {
    saver.__name__: saver for saver in (save_pretrained, save_pretrained_bin, torch_save_state_dict, torch_save_model,
                                        safetensors_save_model, safetensors_save_file, accelerate_save_model,
                                        trainer_save_model)}


@pytest.mark.parametrize("steps", [0, 3], ids=["untrained", "after-3-steps"])
@pytest.mark.parametrize("saver", list(SAVERS))
def test_every_save_path_round_trips_exactly(saver, steps, tmp_path):
    model = optimized_model(FAMILY, HEAD, steps)
    loaded = SAVERS[saver](model, tmp_path)
    assert_same_model(model, loaded, FAMILY, HEAD)


@pytest.mark.parametrize("family", list(TIED_HEADS))
def test_save_pretrained_round_trips_every_family_with_tied_weights(family, tmp_path):
    head = TIED_HEADS[family]
    model = optimized_model(family, head, steps=2)
    model.save_pretrained(tmp_path)
    assert_same_model(model, from_pretrained(family, head, tmp_path), family, head)


def test_accelerate_keeps_every_tensor_and_says_nothing_removed(tmp_path, caplog):
    """accelerate's only sign of dropped tensors was a log line ("Removed shared tensor ...")."""
    import accelerate

    model = optimized_model(FAMILY, HEAD, steps=0)
    with caplog.at_level(logging.INFO):
        accelerate.Accelerator(cpu=True).save_model(model, tmp_path)
    assert "Removed shared tensor" not in caplog.text
    assert sorted(safetensors.torch.load_file(tmp_path / "model.safetensors")) == sorted(model.state_dict())


@pytest.mark.parametrize("steps", [0, 2], ids=["untrained", "after-2-steps"])
def test_trainer_trains_then_saves_exactly(steps, tmp_path):
    model = optimized_model(FAMILY, HEAD, steps=0).train()
    inputs = optimize_inputs(FAMILY, HEAD, model)
    rows = [{key: value[i] for key, value in inputs.items()} for i in range(len(inputs["input_ids"]))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=steps or 1, report_to=[],
                                          use_cpu=True, disable_tqdm=True, save_strategy="no", learning_rate=0.05,
                                          per_device_train_batch_size=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    if steps:
        trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    model.eval()
    assert_same_model(model, from_pretrained(FAMILY, HEAD, tmp_path / "saved"), FAMILY, HEAD)


def test_peft_adapter_on_an_optimized_base_saves_and_reloads_exactly(tmp_path):
    peft = pytest.importorskip("peft")
    base = optimized_model(FAMILY, HEAD, steps=0)
    config = peft.LoraConfig(r=3, lora_alpha=6, target_modules=["query", "value"], modules_to_save=["classifier"],
                             init_lora_weights=False)
    adapted = peft.get_peft_model(base, config).eval()
    adapted.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(tiny_model(FAMILY, HEAD), tmp_path).eval()
    expected, got = adapted.state_dict(), reloaded.state_dict()
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []
    with torch.no_grad():  # a call through the adapter (fastbert's path: the merged copies of its own)
        adapted(**optimize_inputs(FAMILY, HEAD, base))
    # Plain Linears again (merged through .data, which moves no version counter: the modules fastbert maps
    # changed since its last call, so the next call rebuilds over the merged weights), and it saves whole.
    merged = adapted.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    assert_same_model(merged, from_pretrained(FAMILY, HEAD, tmp_path / "merged"), FAMILY, HEAD)
