"""fastbert.training.loop: the generic loop (schedule, checkpoints written atomically, the latest pointer, exact resume,
refusals). The SIGKILL test of a whole run is in tests/training/test_pretrain.py."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastbert.training.loop import (  # noqa: E402
    LATEST,
    METRICS_FILE,
    STATE_FILE,
    StepOutput,
    TrainingArguments,
    TrainingError,
    TrainingTask,
    build_optimizer,
    latest_checkpoint,
    list_checkpoints,
    train,
)

VOCAB, SEQ, BATCH = 50, 12, 4


class _Interrupt(Exception):
    pass


class _TinyTask(TrainingTask):
    """Random token sequences labelled by whether token 5 occurs: learnable, deterministic per (epoch, index)."""

    def __init__(self, seed: int = 0, crash_at_call: int | None = None, crash: type[BaseException] = _Interrupt,
                 poison_at_call: int | None = None, poison: str = "loss"):
        self.seed, self.crash_at_call, self.crash, self.calls = seed, crash_at_call, crash, 0
        self.poison_at_call, self.poison = poison_at_call, poison  # "loss": a nan loss; "grads": nan gradients

    def batches(self, epoch: int):
        task = self

        class _Epoch:
            def __len__(self) -> int:
                return 3

            def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
                if not 0 <= index < 3:
                    raise IndexError(index)
                gen = torch.Generator().manual_seed(task.seed * 1000 + epoch * 10 + index)
                ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
                return {"input_ids": ids, "labels": (ids == 5).any(dim=1).long()}

        return _Epoch()

    def compute(self, model, batch) -> StepOutput:
        self.calls += 1
        if self.crash_at_call is not None and self.calls == self.crash_at_call:
            raise self.crash
        out = model(**batch)
        accuracy = float((out.logits.argmax(-1) == batch["labels"]).float().mean())
        loss = out.loss
        if self.calls == self.poison_at_call:
            # a nan loss, or a finite loss (0 is added) whose gradient is nan: 0 * d sqrt(u)/du at u = 0
            weight = model.classifier.weight
            loss = loss * math.nan if self.poison == "loss" else loss + 0.0 * torch.sqrt(weight.sum() * 0.0)
        return StepOutput(loss, {"accuracy": accuracy}, int(batch["input_ids"].numel()))

    def settings(self) -> dict:
        return {"seed": self.seed}

    def save(self, directory: Path) -> None:
        (directory / "task.txt").write_text("tiny")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=SEQ, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def _args(tmp_path: Path, **changes) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path / "run"), max_steps=7, learning_rate=1e-3, warmup_steps=2, save_every=2,
                log_every=3, seed=3, progress=False)
    return TrainingArguments(**{**base, **changes})


def test_schedule_warmup_then_linear_decay():
    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir="unused", max_steps=10, learning_rate=1.0, warmup_steps=4)
    optimizer, scheduler = build_optimizer(model, args)
    rates = []
    for _ in range(10):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6])
    decays = [group["weight_decay"] for group in optimizer.param_groups]
    assert [len(g["params"]) for g in optimizer.param_groups] == [1, 1] and decays == [args.weight_decay, 0.0]


def test_run_writes_checkpoints_pointer_and_metrics(tmp_path, capsys):
    result = train(_model(), _TinyTask(), _args(tmp_path))
    run = tmp_path / "run"
    assert result.step == 7 and result.checkpoint == run / "checkpoint-0000007"
    # keep_checkpoints=2: steps 6 and 7 remain; the pointer names the last
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-0000006", "checkpoint-0000007"]
    assert (run / LATEST).read_text().strip() == "checkpoint-0000007"
    files = {p.name for p in result.checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", STATE_FILE, "task.txt"} <= files
    records = [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert all({"loss", "accuracy", "lr", "tokens", "elapsed_s"} <= set(r) for r in records)
    assert records[0]["tokens"] == BATCH * SEQ
    err = capsys.readouterr().err
    assert "step 3/7" in err and "tokens/s" in err and "ETA" in err
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(result.checkpoint)
    assert loaded.config.num_labels == 2
    assert not any(p.name.startswith(".tmp") for p in run.iterdir())


def test_temporary_directory_and_stale_pointer(tmp_path):
    run = tmp_path / "run"
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=4))
    # a half-written checkpoint (what a kill during a save leaves) is never taken for the latest one ...
    half = run / ".tmp-checkpoint-0000009.123"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"garbage")
    assert latest_checkpoint(run) == run / "checkpoint-0000004"
    # ... nor is a directory without trainer_state.pt under a checkpoint name
    (run / "checkpoint-0000008").mkdir()
    assert latest_checkpoint(run) == run / "checkpoint-0000004"
    # a rename that happened after the pointer was written (kill between the two) is found
    shutil.copytree(run / "checkpoint-0000004", run / "checkpoint-0000005")
    assert latest_checkpoint(run) == run / "checkpoint-0000005"
    os.remove(run / LATEST)
    assert latest_checkpoint(run) == run / "checkpoint-0000005"
    shutil.rmtree(run / "checkpoint-0000005")
    shutil.rmtree(run / "checkpoint-0000008")
    # the next start removes the temporary directory
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=4, resume=True))
    assert not half.exists()


def test_resume_after_interruption_equals_uninterrupted(tmp_path):
    whole = _model()
    train(whole, _TinyTask(), _args(tmp_path / "a"))
    interrupted = _model()
    with pytest.raises(_Interrupt):  # stops in step 6, after the checkpoint at step 4 (save_every=2)
        train(interrupted, _TinyTask(crash_at_call=6), _args(tmp_path / "b"))
    assert latest_checkpoint(tmp_path / "b" / "run").name == "checkpoint-0000004"
    resumed = _model()
    train(resumed, _TinyTask(), _args(tmp_path / "b", resume=True))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    records = [json.loads(line) for line in (tmp_path / "b" / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 8))  # step 5, logged before the kill, is not duplicated
    reference = [json.loads(line) for line in (tmp_path / "a" / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]


def test_refusals(tmp_path):
    with pytest.raises(TrainingError, match="holds no checkpoint"):
        train(_model(), _TinyTask(), _args(tmp_path, resume=True))
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=2))
    with pytest.raises(TrainingError, match="already holds a run"):
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=2))
    with pytest.raises(TrainingError, match=r"learning_rate.*checkpoint"):
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=2, learning_rate=2e-3, resume=True))
    with pytest.raises(TrainingError, match="seed"):
        train(_model(), _TinyTask(seed=1), _args(tmp_path, max_steps=2, resume=True))
    with pytest.raises(TrainingError, match="max_steps"):
        TrainingArguments(output_dir="x", max_steps=0).check()


def _all_finite(checkpoint: Path) -> bool:
    from safetensors.torch import load_file

    return all(bool(t.isfinite().all()) for t in load_file(checkpoint / "model.safetensors").values())


@pytest.mark.parametrize("poison, message", [
    ("loss", "the training loss is nan at step 5: the run diverged"),
    ("grads", "the weights are not finite after step 6: the run diverged"),  # a finite loss, nan weights at a save
])
def test_a_run_that_diverges_stops_without_saving_non_finite_weights(tmp_path, poison, message):
    run = tmp_path / "run"
    poisoned = _TinyTask(poison_at_call=5 if poison == "loss" else 6, poison=poison)
    with pytest.raises(TrainingError, match=f"{message}.*its last checkpoint, checkpoint-0000004, is kept"):
        train(_model(), poisoned, _args(tmp_path))
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-0000002", "checkpoint-0000004"]
    assert all(_all_finite(p) for p in list_checkpoints(run))
    # the last good checkpoint still resumes
    result = train(_model(), _TinyTask(), _args(tmp_path, resume=True))
    assert result.step == 7 and _all_finite(result.checkpoint)


def test_non_finite_settings_are_refused():
    for bad in ({"learning_rate": math.nan}, {"learning_rate": math.inf}, {"max_grad_norm": math.nan},
                {"weight_decay": -1.0}, {"weight_decay": math.nan}):
        with pytest.raises(TrainingError):
            TrainingArguments(output_dir="x", max_steps=1, **bad).check()


@pytest.mark.parametrize("name, message", [("model.safetensors", "is not a readable safetensors file"),
                                           (STATE_FILE, "is not a readable trainer state")])
def test_a_truncated_checkpoint_is_named_on_resume(tmp_path, name, message):
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=4))
    broken = tmp_path / "run" / "checkpoint-0000004" / name
    broken.write_bytes(broken.read_bytes()[:100])  # what a full disk can leave
    with pytest.raises(TrainingError, match=f"^--resume: {broken} {message}"):
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=4, resume=True))


def test_an_interrupted_run_says_how_to_resume(tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):  # in step 6, after the checkpoint at step 4
        train(_model(), _TinyTask(crash_at_call=6, crash=KeyboardInterrupt), _args(tmp_path))
    checkpoint = tmp_path / "run" / "checkpoint-0000004"
    assert (f"stopped after step 5; the last checkpoint is step 4 ({checkpoint}): rerun with --resume to continue"
            in capsys.readouterr().err)
    with pytest.raises(KeyboardInterrupt):  # before the first checkpoint: nothing to resume, nothing said
        train(_model(), _TinyTask(crash_at_call=1, crash=KeyboardInterrupt), _args(tmp_path / "early"))
    assert "--resume" not in capsys.readouterr().err
