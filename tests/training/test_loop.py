"""fastbert.training.loop: the generic loop (schedule, checkpoints written atomically, the latest pointer, exact resume,
refusals). The SIGKILL test of a whole run is in tests/training/test_pretrain.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import time
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


# ------------------------------------------------------------------------------------------------ interrupts
@pytest.fixture(autouse=True)
def python_handles_sigint():
    """The SIGINT handler an interactive run has: a shell starts a background job (CI's, ``pytest ... &``) with
    SIGINT ignored, and Python then installs none, so the interrupt tests' Ctrl-C would be ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _Signalling(_TinyTask):
    """Sends this process ``signum`` (as Ctrl-C or `kill` would) in the given compute calls, and optionally once
    more while a checkpoint is written (in ``save``)."""

    def __init__(self, at_calls: tuple[int, ...], signum: int = signal.SIGINT, in_save: bool = False):
        super().__init__()
        self.at_calls, self.signum, self.in_save = at_calls, signum, in_save

    def compute(self, model, batch) -> StepOutput:
        for _ in range(self.at_calls.count(self.calls + 1)):
            os.kill(os.getpid(), self.signum)  # the handler runs at once, here, in the middle of the step
        return super().compute(model, batch)

    def save(self, directory: Path) -> None:
        super().save(directory)
        if self.in_save and self.calls >= min(self.at_calls):
            os.kill(os.getpid(), self.signum)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / METRICS_FILE).read_text().splitlines()]


def test_ctrl_c_finishes_the_step_writes_a_checkpoint_and_the_resume_is_exact(tmp_path, capfd):
    whole = _model()
    train(whole, _TinyTask(), _args(tmp_path / "a", save_every=0))
    interrupted = _model()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in step 5 of 7, no checkpoint before the end (save_every 0)
        train(interrupted, _Signalling(at_calls=(5,)), _args(tmp_path / "b", save_every=0))
    run = tmp_path / "b" / "run"
    assert [p.name for p in list_checkpoints(run)] == ["checkpoint-0000005"]  # step 5 finished, then saved
    err = capfd.readouterr().err  # (the first line is written to fd 2 from the signal handler)
    assert "interrupted: stopping after the step in progress, with a checkpoint at it" in err
    assert (f"stopped after step 5; the last checkpoint is step 5 ({run / 'checkpoint-0000005'}): rerun with "
            "--resume to continue\n") in err
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4, 5]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    resumed = _model()
    result = train(resumed, _TinyTask(), _args(tmp_path / "b", save_every=0, resume=True))
    assert result.step == 7 and result.steps_run == 2
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert [r["loss"] for r in _records(run)] == [r["loss"] for r in _records(tmp_path / "a" / "run")]


class _Evaluating(_Signalling):
    """Counts its evaluations, at the steps they run (one figure: the step's number)."""

    def __init__(self, at_calls: tuple[int, ...] = ()):
        super().__init__(at_calls)
        self.evaluated: list[int] = []

    def evaluate(self, model) -> dict[str, float]:
        self.evaluated.append(self.calls)
        return {"calls": float(self.calls)}


def test_a_stop_does_not_wait_for_an_evaluation_and_the_resume_makes_it_up(tmp_path):
    """Ctrl-C in a step whose evaluation was due waited for the whole evaluation before its checkpoint (minutes on
    a real held-out set); the curve then has every point an uninterrupted run has."""
    whole = _Evaluating()
    train(_model(), whole, _args(tmp_path / "a", eval_every=2, save_every=0))
    stopped = _Evaluating(at_calls=(4,))
    with pytest.raises(KeyboardInterrupt):  # in step 4, whose evaluation is due
        train(_model(), stopped, _args(tmp_path / "b", eval_every=2, save_every=0))
    assert stopped.evaluated == [0, 2]  # the untrained model's and step 2's, not step 4's
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "run")] == ["checkpoint-0000004"]
    resumed = _Evaluating()
    train(_model(), resumed, _args(tmp_path / "b", eval_every=2, save_every=0, resume=True))
    assert resumed.evaluated == [0, 2, 3]  # step 4's first (before any step of this run), then 6's and the end's

    def evaluations(run: Path) -> list[int]:
        return [r["step"] for r in _records(run) if r.get("eval")]

    assert evaluations(tmp_path / "b" / "run") == evaluations(tmp_path / "a" / "run") == [0, 2, 4, 6, 7]
    resumed_again = _Evaluating()  # the complete run: nothing missed, nothing evaluated again
    train(_model(), resumed_again, _args(tmp_path / "b", eval_every=2, save_every=0, resume=True))
    assert resumed_again.evaluated == []


class _Terminated(KeyboardInterrupt):
    pass


def test_sigterm_is_held_to_the_step_boundary_then_its_own_handler_runs(tmp_path):
    def terminate(signum, frame):
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)  # what the fastbert command installs
    try:
        with pytest.raises(_Terminated):
            train(_model(), _Signalling(at_calls=(3,), signum=signal.SIGTERM), _args(tmp_path, save_every=0))
        assert signal.getsignal(signal.SIGTERM) is terminate
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-0000003"]


def test_a_callers_handler_that_returns_runs_at_the_step_boundary_and_the_run_goes_on(tmp_path, capsys):
    """A handler of the caller's that only sets a flag was turned into a KeyboardInterrupt that stopped the run."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    task = _Evaluating(at_calls=(4,))  # in step 4, whose evaluation is due (eval_every 2)
    try:
        result = train(_model(), task, _args(tmp_path, save_every=0, eval_every=2))
        assert signal.getsignal(signal.SIGINT) is handler and calls == [signal.SIGINT]  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert result.step == 7 and result.steps_run == 7
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["checkpoint-0000004", "checkpoint-0000007"]
    assert [r["step"] for r in _records(tmp_path / "run") if r.get("eval")] == [0, 2, 4, 6, 7]  # none skipped
    err = capsys.readouterr().err
    assert "the SIGINT handler returned: the run goes on" in err and "stopped after" not in err


def test_a_second_interrupt_stops_at_once_and_says_what_is_lost(tmp_path, capsys):
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):  # twice in step 6: at once, after the checkpoint of step 4
        train(_model(), _Signalling(at_calls=(6, 6)), _args(tmp_path))
    assert latest_checkpoint(run).name == "checkpoint-0000004"
    assert (f"stopped after step 5; the last checkpoint is step 4 ({run / 'checkpoint-0000004'}): rerun with "
            "--resume to continue (1 step after it lost)\n") in capsys.readouterr().err

    # the second one while the interrupt's checkpoint is written: no checkpoint, never a half-written one taken
    other = tmp_path / "other"
    with pytest.raises(KeyboardInterrupt):
        train(_model(), _Signalling(at_calls=(3,), in_save=True), _args(other, save_every=0))
    assert latest_checkpoint(other / "run") is None and list_checkpoints(other / "run") == []
    assert any(p.name.startswith(".tmp-checkpoint-0000003") for p in (other / "run").iterdir())
    assert "stopped after step 3 with no checkpoint written: 3 steps lost (a rerun starts over)\n" in \
        capsys.readouterr().err
    result = train(_model(), _TinyTask(), _args(other, save_every=0))  # a new run in the same directory
    assert result.step == 7 and not any(p.name.startswith(".tmp") for p in (other / "run").iterdir())


def test_an_interrupt_before_the_first_step_writes_nothing(tmp_path, capsys):
    class _EarlyInterrupt(_TinyTask):
        def evaluate(self, model):  # the step-0 evaluation of a new run
            os.kill(os.getpid(), signal.SIGINT)
            return {"eval_loss": 1.0}

    with pytest.raises(KeyboardInterrupt):
        train(_model(), _EarlyInterrupt(), _args(tmp_path))
    assert list_checkpoints(tmp_path / "run") == [] and "stopped after" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ max_steps
def _lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in _records(run) if not r.get("eval")}


def test_a_resume_may_extend_max_steps_with_the_new_schedule_from_the_checkpoint_on(tmp_path, capsys):
    short = _model()
    train(short, _TinyTask(), _args(tmp_path / "ext", max_steps=3, warmup_steps=1))
    before = _lrs(tmp_path / "ext" / "run")
    capsys.readouterr()
    extended = _model()
    result = train(extended, _TinyTask(), _args(tmp_path / "ext", max_steps=6, warmup_steps=2, resume=True))
    assert result.step == 6 and result.steps_run == 3
    err = capsys.readouterr().err
    assert ("--max-steps 6 extends the run (its checkpoint's: 3): the learning rate now follows the schedule for 6 "
            "steps (warmup 2 steps (was 1), linear decay to 0 at step 6), 0.00075 at step 4; steps 1-3 had the old "
            "schedule's rates, so the result equals no uninterrupted run") in err
    whole = _model()
    train(whole, _TinyTask(), _args(tmp_path / "whole", max_steps=6, warmup_steps=2))
    lrs, reference = _lrs(tmp_path / "ext" / "run"), _lrs(tmp_path / "whole" / "run")
    assert [lrs[s] for s in (1, 2, 3)] == [before[s] for s in (1, 2, 3)]  # what the 3-step run did stays
    assert [lrs[s] for s in (4, 5, 6)] == pytest.approx([reference[s] for s in (4, 5, 6)])  # then: the new schedule
    assert [lrs[s] for s in (1, 2, 3)] != [reference[s] for s in (1, 2, 3)]
    assert not torch.equal(extended.classifier.weight, whole.classifier.weight)  # so not the 6-step run's weights

    # the extension is itself resumable exactly: interrupted in it, resumed, it ends where the extension ended
    train(_model(), _TinyTask(), _args(tmp_path / "ext2", max_steps=3, warmup_steps=1))
    with pytest.raises(_Interrupt):  # in step 6, after the checkpoint of step 4 (save_every 2)
        train(_model(), _TinyTask(crash_at_call=3), _args(tmp_path / "ext2", max_steps=6, warmup_steps=2,
                                                          resume=True))
    again = _model()
    train(again, _TinyTask(), _args(tmp_path / "ext2", max_steps=6, warmup_steps=2, resume=True))
    for (name, a), b in zip(extended.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_resume_below_the_checkpoints_step_or_with_other_settings_is_refused(tmp_path):
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=4))
    checkpoint = tmp_path / "run" / "checkpoint-0000004"
    with pytest.raises(TrainingError, match=f"^--resume: --max-steps 3 is below the step of the checkpoint "
                                            rf"\({checkpoint}\), 4: a run cannot be cut back"):
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=3, resume=True))
    with pytest.raises(TrainingError, match=r"learning_rate 0.002 \(checkpoint: 0.001\)") as refused:
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=8, learning_rate=2e-3, resume=True))
    assert "max_steps" not in str(refused.value)  # the new max_steps is not among the differences
    with pytest.raises(TrainingError, match="warmup_steps 3 \\(checkpoint: 2\\)"):  # alone: not a new schedule
        train(_model(), _TinyTask(), _args(tmp_path, max_steps=4, warmup_steps=3, resume=True))
    with pytest.raises(_Interrupt):  # stopped in step 3 of a second run, with a checkpoint at step 2
        train(_model(), _TinyTask(crash_at_call=3), _args(tmp_path / "b", max_steps=6))
    with pytest.raises(TrainingError, match="--max-steps 2 is the step of the checkpoint .* which is not the end of "
                                            "its run \\(6 steps\\): nothing would train"):
        train(_model(), _TinyTask(), _args(tmp_path / "b", max_steps=2, resume=True))


def test_a_resume_of_a_complete_run_trains_and_writes_nothing(tmp_path, capsys):
    train(_model(), _TinyTask(), _args(tmp_path, max_steps=4))
    run = tmp_path / "run"
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    result = train(_model(), _TinyTask(), _args(tmp_path, max_steps=4, resume=True))
    assert result.step == 4 and result.steps_run == 0 and result.checkpoint == run / "checkpoint-0000004"
    assert [r["step"] for r in result.records] == [1, 2, 3, 4]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()} == files
    assert "is the end of the run (step 4 of 4): the run is already complete, nothing to train" in \
        capsys.readouterr().err


# --------------------------------------------------------------------------------------------- metrics.jsonl
class _Evaluated(_TinyTask):
    def evaluate(self, model) -> dict[str, float]:
        return {"eval_calls": float(self.calls)}


def test_a_new_run_keeps_no_record_of_a_run_that_stopped_before_its_first_checkpoint(tmp_path):
    with pytest.raises(TrainingError, match="no checkpoint was written"):
        train(_model(), _Evaluated(poison_at_call=2), _args(tmp_path))
    assert [r["step"] for r in _records(tmp_path / "run")] == [0, 1]  # its step-0 evaluation and step 1
    train(_model(), _Evaluated(), _args(tmp_path))
    records = _records(tmp_path / "run")
    assert [r["step"] for r in records] == [0, *range(1, 8), 7]  # this run's only: one step-0 evaluation


class _SignalledAtTheEnd(_TinyTask):
    """Sends this process SIGINT after the final checkpoint: after the last step's all-reduce (rank 0 only)."""

    def on_checkpoint(self, output_dir: Path, records: list[dict], final: bool) -> None:
        super().on_checkpoint(output_dir, records, final)
        if final:
            os.kill(os.getpid(), signal.SIGINT)


def _ddp_worker(rank: int, init_file: str, out: str, at_the_end: bool = False) -> None:
    import torch.distributed as dist

    os.environ["WORLD_SIZE"] = "2"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if at_the_end:
            task = _SignalledAtTheEnd() if rank == 0 else _TinyTask()
        else:
            task = _Signalling(at_calls=(3,)) if rank == 1 else _TinyTask()  # only rank 1 is signalled, in step 3
        try:
            train(_model(), task, TrainingArguments(output_dir=out, max_steps=7, learning_rate=1e-3, save_every=0,
                                                    progress=False))
            Path(out, f"rank{rank}").write_text("finished")
        except KeyboardInterrupt:
            Path(out, f"rank{rank}").write_text("interrupted")
    finally:
        dist.destroy_process_group()


def _run_two_ranks(*args: object, timeout: float = 300) -> None:
    """`_ddp_worker` on two ranks; a failure, not a hang, when they do not finish in ``timeout`` seconds (ranks
    that disagree on the step to stop at wait for each other for ever)."""
    import torch.multiprocessing as mp

    context = mp.spawn(_ddp_worker, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish in {timeout:.0f} s")


@pytest.mark.slow  # two processes importing transformers
def test_ddp_ranks_agree_on_the_step_to_stop_at(tmp_path):
    out = tmp_path / "run"
    _run_two_ranks(str(tmp_path / "init"), str(out))
    assert (out / "rank0").read_text() == (out / "rank1").read_text() == "interrupted"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-0000003"]
    assert [r["step"] for r in _records(out)] == [1, 2, 3]


@pytest.mark.slow  # two processes importing transformers
def test_ddp_a_signal_after_the_last_steps_all_reduce_is_delivered(tmp_path):
    """Under DDP the held signal was read only from the step's all-reduce: one after the last step's was dropped
    (the run said it stops, then returned as finished)."""
    out = tmp_path / "run"
    _run_two_ranks(str(tmp_path / "init"), str(out), True)
    assert (out / "rank0").read_text() == "interrupted" and (out / "rank1").read_text() == "finished"
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-0000007"]
