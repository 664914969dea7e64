"""A small, generic training loop: what `fastbert pretrain` and `fastbert finetune` share.

What it does (and nothing more):

- AdamW (no weight decay on biases and LayerNorm weights: every parameter with fewer than 2 dimensions) with a
  linear warmup over ``warmup_steps`` then a linear decay to 0 at ``max_steps``; gradient clipping by global norm.
- A progress line on stderr every ``log_every`` steps (redrawn in place on a terminal): step, loss, the task's
  metrics (averaged since the last line), tokens/s, ETA. Every step appends one JSON record to
  ``<output_dir>/metrics.jsonl`` (``{"step", "loss", "lr", "tokens", "elapsed_s", <metrics>}``; an evaluation adds
  a record with ``"eval": true``).
- Checkpoints every ``save_every`` steps and at the end, in HF format: ``model.save_pretrained`` (config.json +
  model.safetensors), the task's extra files (tokenizer), and ``trainer_state.pt`` (step, epoch, position in the
  epoch, optimizer, scheduler, the RNG states of python ``random``, torch and numpy, the run's settings).
  A checkpoint is written into a temporary directory in the same parent, every file fsynced, then renamed to
  ``checkpoint-<step>``; then the file ``latest`` (the name of that directory) is replaced atomically. A kill at
  any moment leaves either the previous checkpoint or the new one, never a half-written one under a name that is
  read: temporary directories (``.tmp-*``) are ignored and removed at the next start.
- ``resume=True`` continues from the latest checkpoint with the same data order and RNG state, so a run killed
  and resumed ends with the same weights as an uninterrupted one (same settings, same thread count). A resume
  whose settings differ from the checkpoint's is refused with the differences named (`TrainingError`), except
  ``max_steps`` (and with it ``warmup_steps``): a resume may give a ``max_steps`` above the checkpoint's step
  (extend a finished run, or shorten an unfinished one); from the checkpoint on, the learning rate is then that of
  the new schedule (`TrainingRun.restore` says so in one line), so the run equals neither an uninterrupted run of
  the old length nor one of the new length (whose earlier steps had other learning rates). A resume of a run that
  is already at its ``max_steps`` trains nothing, writes nothing and says so (`TrainResult.steps_run` is 0).
- Interrupts: during the steps, the first SIGINT (Ctrl-C) or SIGTERM (when Python code handles it, as the
  ``fastbert`` command does) is held until the step in progress ends (an optimizer step is never cut); then a
  checkpoint is written at that step (unless one just was), the line "stopped after step N; the last checkpoint is
  step N (...): rerun with --resume to continue" is written, and the signal's own handler runs (KeyboardInterrupt,
  or the command's ``Terminated``). A second signal meanwhile runs its handler at once: the checkpoint being written
  is left as a temporary directory, never taken for a checkpoint, and the line says how many steps are lost. Under
  DDP the ranks agree on the step: each step's all-reduce of the loss carries every rank's "stop" flag, so all of
  them stop after the first step in which any rank had been signalled (torchrun passes a Ctrl-C on to every rank).
- ``metrics.jsonl`` holds the records of this run only: a new run starts it empty (a run that stopped before its
  first checkpoint leaves nothing behind in it), a resume keeps the records up to the checkpoint's step and drops
  those logged after it, which the resume logs again (the same values: the steps are recomputed exactly).
- DDP-aware: when ``WORLD_SIZE`` > 1, the process group is initialised from the environment (torchrun), the model
  wrapped in ``DistributedDataParallel``, each global batch split across ranks by `TrainingTask.shard`, logged
  losses/metrics averaged over ranks, and only rank 0 writes files (the RNG states of every rank are saved).

The data contract that makes resume exact: `TrainingTask.batches(epoch)` returns a *sequence* of batches whose
content is a deterministic function of the epoch (and the task's own seed), so the loop can restart at
``batches(epoch)[position]`` without replaying anything. Randomness inside a batch (dynamic masking) must be
seeded from (seed, epoch, index), not drawn from a shared generator.

Usage::

    class MyTask(TrainingTask):
        def batches(self, epoch): ...                      # Sequence of dicts of tensors
        def compute(self, model, batch): ...               # StepOutput(loss, {"accuracy": ...}, tokens)
        def settings(self): return {"data": ..., ...}      # what a resume must match
        def save(self, directory): tokenizer.save_pretrained(directory)

    result = train(model, MyTask(), TrainingArguments(output_dir="run", max_steps=1000, resume=True))
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastbert.files import is_temporary, remove_dir, replace_atomic, temporary_path, write_atomic

LATEST = "latest"
STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_PREFIX = "checkpoint-"
# Arguments that do not change the trajectory of a run, so a resume may change them.
_FREE_ARGUMENTS = frozenset({"output_dir", "resume", "save_every", "log_every", "keep_checkpoints", "progress",
                             "eval_every"})
# Arguments that make the learning-rate schedule: a resume may change them when it changes max_steps.
_SCHEDULE_ARGUMENTS = ("max_steps", "warmup_steps")


class TrainingError(Exception):
    """A problem with the run the user asked for (a resume that cannot continue, an output directory in use):
    one line, no traceback."""


@dataclass
class TrainingArguments:
    """The loop's settings. Everything but the output/logging options is recorded in each checkpoint and must be
    equal on resume."""

    output_dir: str
    max_steps: int
    learning_rate: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    save_every: int = 100  # 0: only at the end
    eval_every: int = 0  # 0: only at the end (when the task evaluates at all)
    log_every: int = 10
    keep_checkpoints: int = 2
    resume: bool = False
    progress: bool | None = None  # None: redraw in place on a terminal, else one line per log_every steps

    def check(self) -> None:
        """Raise TrainingError on settings that cannot run (the commands check their options before this, by their
        command-line names; this guards callers from Python). nan and inf are refused: they train to nan."""
        if self.max_steps < 1:
            raise TrainingError(f"max_steps must be >= 1, got {self.max_steps}")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0 and 0 <= self.warmup_steps
                <= self.max_steps):
            raise TrainingError("need a finite learning_rate > 0 and 0 <= warmup_steps <= max_steps")
        if self.save_every < 0 or self.eval_every < 0 or self.log_every < 1 or self.keep_checkpoints < 1:
            raise TrainingError("need save_every >= 0, eval_every >= 0, log_every >= 1, keep_checkpoints >= 1")
        if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise TrainingError("max_grad_norm must be a finite number >= 0 (0: no clipping)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise TrainingError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")

    def trajectory_settings(self) -> dict[str, Any]:
        """The settings a resume must match."""
        return {k: v for k, v in asdict(self).items() if k not in _FREE_ARGUMENTS}


@dataclass
class StepOutput:
    """What `TrainingTask.compute` returns for one batch: the loss to minimise (a scalar tensor with grad), metrics
    to log (floats, e.g. {"mlm_loss": 2.3, "nsp_accuracy": 0.7}) and the number of real (non-padding) tokens."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: int = 0


class TrainingTask:
    """What a training run is about: its data and its loss. Subclass and override `batches` and `compute`; the rest
    has defaults."""

    def batches(self, epoch: int) -> Sequence[Any]:
        """The batches of ``epoch`` in order: a sequence (len, indexing) whose items are a deterministic function of
        (epoch, index) and the task's seed, so a resume restarts at ``batches(epoch)[position]``."""
        raise NotImplementedError

    def compute(self, model: nn.Module, batch: Any) -> StepOutput:
        """Forward one batch (already on the model's device) through ``model`` (the DDP wrapper under DDP)."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """JSON-able settings of the task (data, objective, model config) that a resume must match."""
        return {}

    def save(self, directory: Path) -> None:
        """Write the task's files beside the model in a checkpoint (e.g. ``tokenizer.save_pretrained``)."""

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics (called in eval mode under no_grad, on rank 0 only); {} when the task has none."""
        return {}

    def on_checkpoint(self, output_dir: Path, records: list[dict[str, Any]], final: bool) -> None:
        """Called on rank 0 after each checkpoint (and ``final`` after the last) with every metrics record so far
        (e.g. to draw the loss curve)."""

    def shard(self, batch: Any, rank: int, world_size: int) -> Any:
        """This rank's part of a global batch under DDP: by default each tensor of a dict split along dim 0."""
        if not isinstance(batch, dict):
            raise TypeError("the default TrainingTask.shard splits dict batches; override shard for other types")
        return {k: v.tensor_split(world_size)[rank] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@dataclass
class TrainResult:
    """The end of a run: the last step, the checkpoint written at it, every metrics record, and how many steps this
    call trained (0: a resume of a run that was already complete)."""

    step: int
    checkpoint: Path | None
    records: list[dict[str, Any]]
    steps_run: int = 0


# ---------------------------------------------------------------------------------------------- checkpoints
def _checkpoint_step(path: Path) -> int | None:
    if not path.name.startswith(CHECKPOINT_PREFIX):
        return None
    try:
        return int(path.name[len(CHECKPOINT_PREFIX):])
    except ValueError:
        return None


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary directories are never listed)."""
    directory = Path(output_dir)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and _checkpoint_step(p) is not None
             and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: _checkpoint_step(p) or 0)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names; if the pointer is missing or stale (a kill between the rename
    and the pointer's update), the complete checkpoint with the highest step; None when there is none."""
    directory = Path(output_dir)
    pointer = directory / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        candidate = directory / name
        if name and "/" not in name and (candidate / STATE_FILE).is_file():
            newest = list_checkpoints(directory)
            # A rename that happened after the pointer was last replaced is newer and complete.
            if newest and (_checkpoint_step(newest[-1]) or 0) > (_checkpoint_step(candidate) or 0):
                return newest[-1]
            return candidate
    found = list_checkpoints(directory)
    return found[-1] if found else None


def _clean_temporaries(output_dir: Path) -> None:
    for path in output_dir.iterdir():
        if is_temporary(path):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _state_dict_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, each its own contiguous copy (safetensors refuses tensors that share storage; an
    optimized model has none, but a model edited by hand may). Tied weights are kept once by save_pretrained."""
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


# ------------------------------------------------------------------------------------------------ schedule
def build_optimizer(model: nn.Module, args: TrainingArguments) -> tuple[torch.optim.Optimizer,
                                                                       torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without weight decay on 1-D parameters (biases, LayerNorm), linear warmup then linear decay to 0."""
    seen: set[int] = set()
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() already yields a tied tensor once
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon)
    warmup, total = args.warmup_steps, args.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------------------------------- DDP
@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    started_here: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def mean(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return values
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return (tensor / self.world_size).tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        found: list[Any] = [None] * self.world_size
        dist.all_gather_object(found, obj)
        return found

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _init_distributed(device: torch.device) -> _Dist:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return _Dist()
    import torch.distributed as dist

    started = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        started = True
    return _Dist(dist.get_rank(), dist.get_world_size(), started)


# -------------------------------------------------------------------------------------------------- logging
def _format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class _Progress:
    def __init__(self, max_steps: int, in_place: bool):
        self.max_steps, self.in_place = max_steps, in_place
        self.window: list[dict[str, Any]] = []
        self.window_started = time.perf_counter()
        self.run_started = time.perf_counter()
        self.steps_this_run = 0

    def add(self, record: dict[str, Any]) -> None:
        self.window.append(record)
        self.steps_this_run += 1

    def line(self, step: int) -> str:
        now = time.perf_counter()
        keys = [k for k in self.window[-1] if k not in ("step", "lr", "tokens", "elapsed_s", "epoch")]
        means = {k: sum(r[k] for r in self.window if k in r) / sum(1 for r in self.window if k in r) for k in keys}
        tokens = sum(r["tokens"] for r in self.window)
        rate = tokens / max(now - self.window_started, 1e-9)
        per_step = (now - self.run_started) / max(self.steps_this_run, 1)
        shown = " ".join(f"{k} {v:.4g}" for k, v in means.items())
        lr = self.window[-1]["lr"]
        self.window, self.window_started = [], now
        return (f"step {step}/{self.max_steps} {shown} lr {lr:.3g} {rate:,.0f} tokens/s "
                f"ETA {_format_eta(per_step * (self.max_steps - step))}")

    def show(self, text: str) -> None:
        if self.in_place:
            sys.stderr.write("\r\x1b[2K" + text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.in_place:
            sys.stderr.write("\n")
            sys.stderr.flush()


def read_metrics(path: str | os.PathLike, up_to_step: int | None = None) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (a line cut by a kill is dropped), optionally those with step <= up_to_step."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and (up_to_step is None or record.get("step", 0) <= up_to_step):
                    records.append(record)
    except FileNotFoundError:
        pass
    return records


# ----------------------------------------------------------------------------------------------- interrupts
class _StopRequests:
    """SIGINT and SIGTERM while the steps run (a context manager): the first is held (``requested``) until the loop
    reaches a step boundary and calls `deliver`; a second one runs its own handler at once. Only signals that Python
    code handles are held (SIGINT's KeyboardInterrupt, the ``fastbert`` command's SIGTERM), and only in the main
    thread (where Python runs handlers); the handlers found are put back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, announce: bool, in_place: bool):
        self.announce, self.in_place = announce, in_place
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> _StopRequests:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                handler = signal.getsignal(signum)
                if callable(handler):
                    self.previous[signum] = handler
                    signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second: stop at once
            self.previous[signum](signum, frame)
            return
        self.signum = signum
        if self.announce:  # os.write: a handler can run inside a sys.stderr.write, which must not be re-entered
            text = ("interrupted: stopping after the step in progress, with a checkpoint at it (interrupt again to "
                    "stop at once, without it)\n")
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), (("\n" if self.in_place else "") + text).encode())

    def deliver(self) -> None:
        """Run the held signal's own handler: Python's and the command's raise (KeyboardInterrupt, Terminated); a
        caller's own may return, as it would have without the hold (the next signal is held again)."""
        signum, self.signum = self.signum, None
        assert signum is not None
        self.previous[signum](signum, None)
        if self.announce:
            sys.stderr.write(f"the {signal.Signals(signum).name} handler returned: the run goes on\n")


# ---------------------------------------------------------------------------------------------------- train
def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _steps(count: int) -> str:
    return f"{count} step{'s' if count != 1 else ''}"


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _describe_differences(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """'training.learning_rate 0.001 (checkpoint: 0.0005); ...' for each setting that differs."""
    saved, current = _flatten(saved), _flatten(current)
    keys = sorted(set(saved) | set(current))
    parts = [f"{k} {current.get(k, '(unset)')!r} (checkpoint: {saved.get(k, '(unset)')!r})"
             for k in keys if saved.get(k) != current.get(k)]
    return "; ".join(parts)


def _jsonable(settings: dict[str, Any]) -> dict[str, Any]:
    """Round-trip through JSON so tuples/lists and the like compare equal after a save."""
    return json.loads(json.dumps(settings, sort_keys=True, default=str))


def train(model: nn.Module, task: TrainingTask, args: TrainingArguments) -> TrainResult:
    """Train ``model`` on ``task`` for ``args.max_steps`` optimizer steps (see the module docstring).

    The model must be on its device already; batches are moved there. A fresh run seeds python/torch/numpy with
    ``args.seed`` (seed before building the model as well, for a reproducible initialisation); a resumed run
    restores the weights, optimizer, scheduler, RNG states and data position of the latest checkpoint.
    Raises TrainingError when the output directory already holds a run and ``resume`` is False, when a resume
    has nothing to resume or different settings, and when the loss or the weights stop being finite (nothing
    non-finite is saved; earlier checkpoints stay).
    """
    return TrainingRun(model, task, args).run()


class TrainingRun:
    """One run of `train`: set up (output directory, optimizer, fresh seeds or the resumed state, metrics log,
    DDP wrapper, progress line), then steps, with evaluations and checkpoints on their schedule."""

    def __init__(self, model: nn.Module, task: TrainingTask, args: TrainingArguments):
        args.check()
        self.model, self.task, self.args = model, task, args
        self.output_dir = Path(args.output_dir)
        self.device = next(model.parameters()).device
        self.dist = _init_distributed(self.device)
        self.settings = _jsonable({"training": args.trajectory_settings(), "task": task.settings(),
                                   "world_size": self.dist.world_size})
        self.step, self.epoch, self.position = 0, 0, 0
        self.first_step = 0  # the step this call started from
        self.saved_step: int | None = None  # the step of the last checkpoint written or restored
        self.complete = False  # a resume of a run already at max_steps: nothing to train, nothing to write
        self.schedule_note = ""  # a resume with another max_steps: what changed (`reschedule`)
        self.records: list[dict[str, Any]] = []
        self.log = None
        self.progress: _Progress | None = None
        self.stops = _StopRequests(False, False)
        self.stop_agreed = False  # under DDP: some rank had been signalled before this step's all-reduce
        self.told = False

    def run(self) -> TrainResult:
        """Set up, train to ``max_steps`` and close the metrics log and the progress line (and the process group
        when this run started it)."""
        checkpoint = self.find_checkpoint()
        self.optimizer, self.scheduler = build_optimizer(self.model, self.args)
        if checkpoint is not None:
            self.restore(checkpoint)
        else:
            _seed_everything(self.args.seed + self.dist.rank)
        self.open_metrics()
        self.train_model = self.wrap_model()
        self.progress = self.start_progress(checkpoint)
        try:
            with self.stops:
                result = self.train_steps(checkpoint)
                # leave together: a rank that tears the group down while another is still on its last files (rank
                # 0's checkpoint hook) can leave one of them waiting in the teardown (seen under torchrun, 1 in ~20)
                self.dist.barrier()
                if self.stops.requested:  # (DDP: signalled after the last step's all-reduce; the run is complete)
                    self.stop()
            return result
        except KeyboardInterrupt:
            self.tell_how_to_resume()
            raise
        finally:
            self.close()

    def tell_how_to_resume(self) -> None:
        """On rank 0, after an interrupt (Ctrl-C, SIGTERM): the step reached, the checkpoint a --resume continues
        from, and how many steps are lost when that checkpoint is older than the step (or there is none)."""
        if not self.dist.main or self.told:
            return
        self.told = True
        last = latest_checkpoint(self.output_dir)
        if last is None and self.step == 0:
            return  # nothing trained, nothing lost
        if self.progress is not None:
            self.progress.close()  # the line goes below an in-place progress line, not over it
            self.progress = None
        if last is None:
            sys.stderr.write(f"stopped after step {self.step} with no checkpoint written: {_steps(self.step)} lost "
                             "(a rerun starts over)\n")
            return
        saved = _checkpoint_step(last) or 0
        lost = f" ({_steps(self.step - saved)} after it lost)" if self.step > saved else ""
        sys.stderr.write(f"stopped after step {self.step}; the last checkpoint is step {saved} ({last}): rerun with "
                         f"--resume to continue{lost}\n")

    def find_checkpoint(self) -> Path | None:
        """The checkpoint to resume from (None for a fresh run); TrainingError when that does not fit ``resume``.
        Leftovers of an interrupted write are removed first."""
        if self.dist.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            _clean_temporaries(self.output_dir)
        self.dist.barrier()
        existing = latest_checkpoint(self.output_dir)
        if self.args.resume:
            if existing is None:
                raise TrainingError(f"--resume: {self.output_dir} holds no checkpoint to resume from")
            return existing
        if existing is not None:
            raise TrainingError(f"{self.output_dir} already holds a run (latest checkpoint {existing.name}); continue "
                                "it with --resume or choose another output directory")
        return None

    def restore(self, checkpoint: Path) -> None:
        """Weights, optimizer, scheduler, position and this rank's RNG states of ``checkpoint``, whose settings must
        be the run's, but for a new ``max_steps`` (and the ``warmup_steps`` that come with it): the schedule is then
        the new one from the checkpoint's step on (`reschedule`)."""
        state = _read_state(checkpoint / STATE_FILE)
        saved, step = state["settings"], state["step"]
        old = {k: saved.get("training", {}).get(k) for k in _SCHEDULE_ARGUMENTS}
        new = {k: self.settings["training"][k] for k in _SCHEDULE_ARGUMENTS}
        rescheduled = old["max_steps"] != new["max_steps"]
        if rescheduled:
            if new["max_steps"] < step:
                raise TrainingError(f"--resume: --max-steps {new['max_steps']} is below the step of the checkpoint "
                                    f"({checkpoint}), {step}: a run cannot be cut back; give a larger --max-steps")
            if new["max_steps"] == step:
                raise TrainingError(f"--resume: --max-steps {new['max_steps']} is the step of the checkpoint "
                                    f"({checkpoint}), which is not the end of its run ({old['max_steps']} steps): "
                                    "nothing would train; give a larger --max-steps")
            saved = {**saved, "training": {**saved["training"], **new}}  # compare the rest
        if saved != self.settings:
            raise TrainingError(f"--resume: the settings differ from the checkpoint's ({checkpoint}): "
                                f"{_describe_differences(saved, self.settings)}; resume with the same "
                                "settings or start a new output directory")
        _load_weights(self.model, checkpoint)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.position = step, state["epoch"], state["position"]
        self.first_step = self.saved_step = step
        self.complete = step == self.args.max_steps
        _set_rng_state(state["rng"][self.dist.rank])
        if rescheduled:
            self.reschedule(old["max_steps"], old["warmup_steps"])

    def reschedule(self, old_max_steps: int, old_warmup: int | None) -> None:
        """After a resume with another max_steps: the learning rate of the next step from the new schedule (the
        optimizer's state holds the old schedule's), and one line on rank 0 saying what changed."""
        for group, base, factor in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                       self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * factor(self.scheduler.last_epoch)
        args, verb = self.args, "extends" if self.args.max_steps > old_max_steps else "shortens"
        warmup = (f"warmup {args.warmup_steps} steps (was {old_warmup})" if old_warmup != args.warmup_steps
                  else f"warmup {args.warmup_steps} steps")
        self.schedule_note = (
            f"--max-steps {args.max_steps} {verb} the run (its checkpoint's: {old_max_steps}): the learning rate now "
            f"follows the schedule for {args.max_steps} steps ({warmup}, linear decay to 0 at step {args.max_steps}),"
            f" {self.optimizer.param_groups[0]['lr']:.3g} at step {self.step + 1}; steps 1-{self.step} had the old "
            "schedule's rates, so the result equals no uninterrupted run")

    def open_metrics(self) -> None:
        """On rank 0: the metrics records of this run, and the file opened for appending. A new run starts an empty
        file (another run's records, one that stopped before its first checkpoint, are not kept); a resume keeps the
        records up to the checkpoint's step (what a stopped run logged after it is dropped: the resume logs those
        steps again); a complete run's file is only read."""
        if not self.dist.main:
            return
        self.records = read_metrics(self.output_dir / METRICS_FILE, up_to_step=self.step) if self.step else []
        if self.complete:
            return
        write_atomic(self.output_dir / METRICS_FILE, "".join(json.dumps(r) + "\n" for r in self.records).encode())
        self.log = open(self.output_dir / METRICS_FILE, "a", encoding="utf-8")

    def wrap_model(self) -> nn.Module:
        """The model the steps call: the model itself, or its DistributedDataParallel wrapper under DDP."""
        if self.dist.world_size <= 1:
            return self.model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)

    def start_progress(self, checkpoint: Path | None) -> _Progress:
        """The progress line (rank 0 only draws it in place), opened with where a resume starts."""
        in_place = self.args.progress if self.args.progress is not None else sys.stderr.isatty()
        progress = _Progress(self.args.max_steps, in_place and self.dist.main)
        self.stops = _StopRequests(self.dist.main, in_place)
        timed = [r["elapsed_s"] for r in self.records if "elapsed_s" in r]  # (the last record can be an eval's)
        self.elapsed_before = timed[-1] if timed else 0.0
        self.started = time.perf_counter()
        if checkpoint is not None and self.dist.main:
            if self.complete:
                progress.show(f"{checkpoint} is the end of the run (step {self.step} of {self.args.max_steps}): the "
                              "run is already complete, nothing to train")
            else:
                progress.show(f"resuming from {checkpoint} at step {self.step} (epoch {self.epoch}, batch "
                              f"{self.position})")
            if self.schedule_note:
                sys.stderr.write("\n" if in_place else "")
                progress.show(self.schedule_note)
            if in_place:
                sys.stderr.write("\n")
        return progress

    def train_steps(self, checkpoint: Path | None) -> TrainResult:
        """Steps from the current position to ``max_steps`` (an evaluation of the untrained model first on a fresh
        run); returns the result with the last checkpoint."""
        if checkpoint is None or self.evaluation_missed():
            self.evaluate()  # the untrained model's held-out figures (the curve's starting point), or a missed one
        self.model.train()
        batches = self.task.batches(self.epoch)
        if len(batches) == 0:
            raise TrainingError("the task has no batches (too little data for one batch?)")
        last_saved = checkpoint if checkpoint is not None and self.step == self.args.max_steps else None
        while True:
            if self.stop_requested():  # at a step boundary: checkpoint, then the interrupt
                self.stop()
            if self.step >= self.args.max_steps:
                break
            if self.position >= len(batches):
                self.epoch, self.position = self.epoch + 1, 0
                batches = self.task.batches(self.epoch)
            out, values, lr = self.train_step(batches[self.position])
            self.record_step(out, values, lr)
            last_saved = self.after_step() or last_saved
        return TrainResult(self.step, last_saved or checkpoint, self.records, self.step - self.first_step)

    def stop_requested(self) -> bool:
        """Whether to stop at this step boundary: this process was signalled, or under DDP, some rank had been
        before this step's all-reduce (all ranks see the same flags, so they stop at the same step)."""
        return self.stop_agreed if self.dist.world_size > 1 else self.stops.requested

    def stop(self) -> None:
        """Stop at this step boundary: a checkpoint at this step (every rank takes part; none when one was just
        written or restored here), then the held signal's handler, which raises (`run` then says how to resume).
        A caller's handler that returns lets a single process go on; under DDP all ranks stop, as they agreed."""
        if self.saved_step != self.step and self.step > 0:  # (a new run stopped before its first step: no steps)
            self.save(final=False)
        if self.stops.requested:
            self.stops.deliver()
            if self.dist.world_size == 1:  # the handler returned: the run goes on, with the evaluation it skipped
                if self.evaluation_missed():
                    self.evaluate()
                return
        raise KeyboardInterrupt  # another rank was signalled, this one was not (yet)

    def train_step(self, batch: Any) -> tuple[StepOutput, list[float], float]:
        """Forward, backward, clipping and one optimizer and scheduler step on one global batch (this rank's shard
        under DDP); returns the task's output, its loss, metrics and tokens averaged over the ranks, and the learning
        rate the step used. TrainingError, before the update, when the loss is not finite."""
        if self.dist.world_size > 1:
            batch = self.task.shard(batch, self.dist.rank, self.dist.world_size)
        batch = _to_device(batch, self.device)
        out = self.task.compute(self.train_model, batch)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        # averaged before the update: every rank sees the same loss, so all of them stop at the same step
        # (the last value: whether this rank has a stop request, so that all ranks agree on the step to stop at)
        *values, stops = self.dist.mean([float(out.loss.detach()), *(float(v) for v in out.metrics.values()),
                                         float(out.tokens), float(self.stops.requested)])
        self.stop_agreed = stops > 0
        if not math.isfinite(values[0]):
            raise TrainingError(self.divergence(f"the training loss is {values[0]} at step {self.step + 1}"))
        if self.args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses (set by the scheduler or `reschedule`)
        self.optimizer.step()
        self.scheduler.step()
        self.step, self.position = self.step + 1, self.position + 1
        return out, values, lr

    def divergence(self, what: str) -> str:
        """The error of a run stopped by a non-finite loss or weights: ``what``, the likely cause, what is kept."""
        last = latest_checkpoint(self.output_dir)
        kept = f"its last checkpoint, {last.name}, is kept" if last is not None else "no checkpoint was written"
        return (f"{what}: the run diverged (try a lower --learning-rate or milder loss settings); nothing non-finite "
                f"was saved, {kept}")

    def record_step(self, out: StepOutput, values: list[float], lr: float) -> None:
        """The step's loss, metrics and tokens (``values``: averaged over ranks) as a metrics record and, on its
        schedule, a progress line."""
        names = list(out.metrics)
        if not self.dist.main:
            return
        record = {"step": self.step, "epoch": self.epoch, "loss": values[0],
                  **dict(zip(names, values[1:-1], strict=True)), "lr": lr,
                  "tokens": int(round(values[-1] * self.dist.world_size)),
                  "elapsed_s": round(self.elapsed_before + time.perf_counter() - self.started, 3)}
        self.write_record(record)
        self.progress.add(record)
        if self.step % self.args.log_every == 0 or self.step == self.args.max_steps:
            self.progress.show(self.progress.line(self.step))

    def after_step(self) -> Path | None:
        """The evaluations and checkpoints due after this step; the final checkpoint's path after the last step."""
        if self.evaluation_due() and not self.stop_requested():  # a stop: evaluated at the resume instead
            self.evaluate()
        args = self.args
        if self.step == args.max_steps:
            self.evaluate()
            return self.save(final=True)
        if args.save_every and self.step % args.save_every == 0:
            self.save(final=False)
        return None

    def evaluation_due(self) -> bool:
        """Whether --eval-every evaluates after this step (the last step's evaluation is the final one's)."""
        every = self.args.eval_every
        return bool(every) and self.step % every == 0 and self.step != self.args.max_steps

    def evaluation_missed(self) -> bool:
        """Whether a resume starts at a step whose evaluation was due and is not recorded: a stop requested in that
        step skipped it, so that the checkpoint came without waiting for it."""
        return self.evaluation_due() and not any(r.get("eval") and r["step"] == self.step for r in self.records)

    def evaluate(self) -> None:
        """On rank 0: the task's held-out metrics in eval mode, recorded and shown; the RNG states are put back, so
        an evaluation does not change the training trajectory."""
        if not self.dist.main:
            return
        rng = _rng_state()
        self.model.eval()
        with torch.no_grad():
            found = self.task.evaluate(self.model)
        self.model.train()
        _set_rng_state(rng)
        if found:
            self.write_record({"step": self.step, "eval": True, **{k: float(v) for k, v in found.items()}})
            self.progress.show(f"eval at step {self.step}: " + " ".join(f"{k} {v:.4g}" for k, v in found.items()))

    def write_record(self, record: dict[str, Any]) -> None:
        """Keep a metrics record and append it to metrics.jsonl (rank 0)."""
        self.records.append(record)
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def save(self, final: bool) -> Path:
        """A checkpoint at the current step (every rank takes part), then the task's hook on rank 0. TrainingError
        instead when a weight is not finite (a finite loss can still give non-finite gradients)."""
        if not torch.stack([p.detach().isfinite().all() for p in self.model.parameters()]).all():
            raise TrainingError(self.divergence(f"the weights are not finite after step {self.step}"))
        path = _save_checkpoint(self.model, self.task, self.optimizer, self.scheduler, self.output_dir, self.step,
                                self.epoch, self.position, self.settings, self.args.keep_checkpoints, self.dist)
        self.saved_step = self.step
        if self.dist.main:
            self.task.on_checkpoint(self.output_dir, self.records, final)
        return path

    def close(self) -> None:
        """End the progress line, close the metrics log, and leave the process group if this run joined it."""
        if self.progress is not None:
            self.progress.close()
        if self.log is not None:
            self.log.close()
        if self.dist.started_here:
            import torch.distributed as tdist

            tdist.destroy_process_group()


def _load_weights(model: nn.Module, checkpoint: Path) -> None:
    """Copy a checkpoint's model.safetensors into ``model`` in place (keeps fastbert.optimize's views valid). Keys
    absent from the file must be tied to a key that is present (save_pretrained writes a tied tensor once)."""
    from fastbert.loading import CheckpointError, read_state_dict

    try:
        saved = read_state_dict(checkpoint)
    except CheckpointError as err:  # a file cut short (a full disk), say: one line naming it
        raise TrainingError(f"--resume: {err}") from err
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    storages = {own[k].untyped_storage().data_ptr() for k in saved if k in own}
    untied = [k for k in missing if own[k].untyped_storage().data_ptr() not in storages]
    if unexpected or untied:
        raise TrainingError(f"--resume: {checkpoint}/model.safetensors does not fit the model: missing {untied[:5]}, "
                            f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, tensor in saved.items():
            own[key].copy_(tensor)


def _read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer state; TrainingError naming the file when it cannot be read."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:  # missing, empty, cut short
        reason = (str(err).splitlines() or [type(err).__name__])[0].split(". ")[0][:200]  # torch's first sentence
        raise TrainingError(f"--resume: {path} is not a readable trainer state: {reason}") from err


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No 'Writing model shards' bar from save_pretrained in the middle of the progress line."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _save_checkpoint(model: nn.Module, task: TrainingTask, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, output_dir: Path, step: int, epoch: int,
                     position: int, settings: dict[str, Any], keep: int, dist: _Dist) -> Path:
    rng = dist.gather(_rng_state())
    final = output_dir / f"{CHECKPOINT_PREFIX}{step:07d}"
    if dist.main:
        tmp = temporary_path(final)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with _quiet_transformers():
            model.save_pretrained(tmp, state_dict=_state_dict_to_save(model))
        task.save(tmp)
        torch.save({"step": step, "epoch": epoch, "position": position, "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": rng, "settings": settings,
                    "torch_version": torch.__version__}, tmp / STATE_FILE)
        replace_atomic(tmp, final)  # over the same step written before, when a resume ended where it started
        write_atomic(output_dir / LATEST, (final.name + "\n").encode())
        for old in list_checkpoints(output_dir)[:-keep]:
            remove_dir(old)
    dist.barrier()
    return final


def keep_final_model(checkpoint: str | os.PathLike, output_dir: str) -> str:
    """Copy the last checkpoint (without the trainer state) to ``<output_dir>/model``, replacing it atomically;
    returns that path."""
    model_out = os.path.join(output_dir, "model")
    written = temporary_path(model_out)
    if os.path.exists(written):
        shutil.rmtree(written)
    shutil.copytree(checkpoint, written, ignore=shutil.ignore_patterns(STATE_FILE))
    replace_atomic(written, model_out)
    return model_out
