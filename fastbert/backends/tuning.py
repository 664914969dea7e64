"""``auto`` by measurement: time each backend that can run an op call, keep the fastest, remember it.

A choice is made per *shape class* (`shape_class`): the op, the dtypes, grad mode, the threads torch uses on CPU,
and the arguments' sizes with every size that follows the batch (the rows of the activations, which share the first
one's, integer tensors such as cu_seqlens and masks, integers such as max_seqlen) rounded up to a power of four;
weights, feature widths and strings (the activation) stay exact, dropout counts as on or off (its seed not at
all). All layers of a model share one class per op site, so a model measures each op a few times on its first
batch and never again.

Measuring (`measure`) calls each candidate once to warm up (Triton compiles there), then up to `ROUNDS`
interleaved rounds (at least `MIN_ROUNDS`, more while the next one is expected to end within `BUDGET_S`). With one
CPU thread the clock is the thread's CPU time, which other processes do not inflate, and each candidate's median
round counts; otherwise the wall clock and the fastest round (load only ever adds time). The static order's choice
stays unless another is `MARGIN` faster.
Calls made for a CUDA graph (inside `for_replay`: `fastbert.cuda_graphs` warms up and captures there) have a class
of their own (``replayed``) and, on CUDA, are timed by the GPU alone: a replay pays no host time, so a backend that
launches less must not win on launches. Each timed call is queued behind `torch.cuda._sleep`, so that its launches
are all queued before the GPU reaches them, and CUDA events around it give its GPU time (the fastest round).
It forks the RNG (CPU and the tensors' CUDA devices) so dropout draws are what they would have been, never writes
the inputs, and under autograd times forward + backward with a fixed gradient on detached copies of the inputs, so
no ``.grad`` appears on the caller's tensors. It never runs while torch.compile traces, while a CUDA graph is
captured, or on tensor subclasses (fake tensors): the caller uses a known choice or the static order.

Choices persist in one JSON file per environment key (`environment_key`: the device's name, the CUDA runtime and
driver or the CPU model and its vector flags, the torch, triton and fastbert versions, and a digest of fastbert's
compiled and Triton kernels) under `cache_dir` (``FASTBERT_CACHE_DIR``, default ``~/.cache/fastbert``; the files
are in its ``tuning/``). A file is rewritten atomically (`fastbert.files.write_atomic`) after merging, under an
exclusive lock, what other processes wrote; one that cannot be read or parsed is ignored with one warning.
``FASTBERT_TUNE=0`` turns measuring off.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import importlib.util
import json
import os
import re
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from fastbert.cpu import cpu_flags, cpu_info
from fastbert.files import write_atomic

ROUNDS = 15  # timed rounds per candidate after the warm-up call, while within BUDGET_S
MIN_ROUNDS = 3  # at least, whatever the time: a round can land on a moment the machine is busy
BUDGET_S = 0.25  # per shape class: a first use costs a fraction of a second per op
# Another backend replaces the static order's choice only when it is more than this much faster: kernels that share
# their GEMM differ by a few percent, less than rounds scatter on a busy machine, and a flip on noise would stick.
MARGIN = 0.05
FILE_SCHEMA = "fastbert-tuning/1"
_OFF = ("0", "false", "no", "off")
_enabled = os.environ.get("FASTBERT_TUNE", "1").strip().lower() not in _OFF
_LOCK = threading.Lock()
_REPLAY = threading.local()  # .depth > 0: the calls are made for a CUDA graph (`for_replay`)
# GPU cycles queued ahead of a timed call on replay (about 1 ms at H100/H200 clocks): longer than the host needs to
# launch one op, so the events around it see the GPU's time alone
SLEEP_CYCLES = 2_000_000
_STORE: dict[Path, dict[str, Entry]] = {}  # file -> shape class -> entry: the process's table
_WARNED: set[Path] = set()


@dataclass
class Entry:
    """One measured choice: the backend, each candidate's fastest round in ms, rounds, the clock, when (UTC)."""

    choice: str
    times_ms: dict[str, float]
    rounds: int
    clock: str = "wall"  # or "thread cpu" (`measure`)
    measured: str = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))

    def to_json(self) -> dict:
        return {"choice": self.choice, "times_ms": self.times_ms, "rounds": self.rounds, "clock": self.clock,
                "measured": self.measured}


def enabled() -> bool:
    """Whether ``auto`` measures (``FASTBERT_TUNE``, read at import; `set_enabled` changes it)."""
    return _enabled


def read_environment() -> None:
    """Read ``FASTBERT_TUNE`` again (``0``, ``false``, ``no``, ``off``: measuring off)."""
    set_enabled(os.environ.get("FASTBERT_TUNE", "1").strip().lower() not in _OFF)


def set_enabled(value: bool) -> None:
    global _enabled
    _enabled = bool(value)


def cache_dir() -> Path:
    """The cache directory: ``FASTBERT_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastbert``, else ``~/.cache/fastbert``;
    the tuning files are in its ``tuning/``."""
    named = os.environ.get("FASTBERT_CACHE_DIR")
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastbert"


def tuning_dir() -> Path:
    return cache_dir() / "tuning"


# ------------------------------------------------------------------------------------------------ shape classes
def bucket(n: int) -> int:
    """The next power of four >= n (0 for 0). Coarse on purpose: a server sees token counts, sequence counts and
    longest lengths in every combination, and each new class costs a measurement (159 classes at powers of two
    made a loaded 2-core VM's serve benchmark measure for over a minute); which backend is fastest changes slowly
    with size."""
    if n <= 0:
        return 0
    return 1 << (2 * (((int(n) - 1).bit_length() + 1) // 2))


def _describe(value, is_dropout: bool, rows: int | None = None) -> str:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dim() >= 2 and value.shape[0] == rows:  # activations: rows vary
            return "x".join([*(str(bucket(d)) for d in value.shape[:-1]), str(value.shape[-1])])
        if value.is_floating_point():  # weights, biases, tables
            return "x".join(str(d) for d in value.shape)
        return "i" + "x".join(str(bucket(d)) for d in value.shape)
    if value is None:
        return "-"
    if is_dropout:
        return "dropout" if value > 0 else "no-dropout"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"~{bucket(value)}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe(v, False) for v in value) + "]"
    return "."  # other floats (eps, scale) do not change which kernel is fast


@contextlib.contextmanager
def for_replay() -> Iterator[None]:
    """Within the block (this thread), the ops' calls are made for a CUDA graph that will replay them: their
    choices are measured by GPU time alone, in shape classes of their own (the module's doc)."""
    _REPLAY.depth = getattr(_REPLAY, "depth", 0) + 1
    try:
        yield
    finally:
        _REPLAY.depth -= 1


def replaying() -> bool:
    """Whether this thread is inside `for_replay`."""
    return getattr(_REPLAY, "depth", 0) > 0


def under_autograd(tensors: list[torch.Tensor]) -> bool:
    """Whether a call on these tensors is recorded for autograd: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def shape_class(args: tuple, kwargs: dict, dropout_index: int | None) -> str:
    """The class of a call: ``<dtype> <grad|no-grad> [t<threads>] [replayed] <argument sizes>`` (the module's
    doc)."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    floats = [t for t in tensors if t.is_floating_point()]
    dtype = str(floats[0].dtype).removeprefix("torch.") if floats else "-"
    grad = under_autograd(tensors)
    device = tensors[0].device.type if tensors else "cpu"
    threads = f" t{torch.get_num_threads()}" if device == "cpu" else ""
    # The argument after dropout_p is its seed, different at every step: not part of the class.
    seed = None if dropout_index is None else dropout_index + 1
    rows = floats[0].shape[0] if floats and floats[0].dim() else None  # the first activation's rows
    parts = ["." if i == seed else _describe(v, i == dropout_index, rows) for i, v in enumerate(args)]
    parts += [f"{k}={'.' if k == 'dropout_seed' else _describe(v, k == 'dropout_p', rows)}"
              for k, v in sorted(kwargs.items())]
    replayed = " replayed" if replaying() else ""
    return f"{dtype} {'grad' if grad else 'no-grad'}{threads}{replayed} " + ",".join(parts)


# -------------------------------------------------------------------------------------------- environment key
def _cpu() -> str:
    return f"{cpu_info()[0]} [{' '.join(cpu_flags())}]"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def kernels_digest() -> str:
    """A digest of the kernels this process runs: the C++ extension's binary and the Triton kernels' sources. An
    editable checkout keeps its version while its kernels change, and a choice timed against an older kernel would
    otherwise stay."""
    digest = hashlib.sha256()
    extension = importlib.util.find_spec("fastbert._C")
    triton_kernels = importlib.util.find_spec("fastbert.kernels")
    files = [Path(extension.origin)] if extension is not None and extension.origin else []
    for folder in (triton_kernels.submodule_search_locations or []) if triton_kernels is not None else []:
        files += sorted(Path(folder).glob("*.py"))
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def environment_key(device: torch.device) -> dict[str, str | None]:
    """What a measurement depends on besides the call: the device, its driver or CPU, the library versions and
    fastbert's kernels (`kernels_digest`)."""
    key = {"device": device.type, "torch": torch.__version__, "triton": _version("triton"),
           "fastbert": _version("fastbert"), "kernels": kernels_digest()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        key.update(name=torch.cuda.get_device_name(index), cuda_runtime=torch.version.cuda,
                   cuda_driver=str(driver()) if driver is not None else None)
    else:
        key.update(name=_cpu())
    return key


_KEY_FILES: dict[tuple, tuple[Path, dict]] = {}
_epoch = 0  # moves on whenever the process's table is dropped (`forget`)


def state() -> tuple:
    """What the choices the process holds depend on besides the call: the cache's location (the variables that
    name it) and the table's epoch. Cheap: read on every measured dispatch."""
    return _epoch, os.environ.get("FASTBERT_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME")


def key_file(device: torch.device) -> tuple[Path, dict]:
    """(the JSON file of ``device``'s environment key under `tuning_dir`, the key)."""
    where = (device.type, device.index, state())
    found = _KEY_FILES.get(where)
    if found is None:
        key = environment_key(device)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        name = str(key["name"]).split(" [")[0]  # the CPU's name without its flags
        slug = re.sub(r"[^a-z0-9]+", "-", f"{device.type} {name}".lower()).strip("-")[:40]
        found = _KEY_FILES[where] = (tuning_dir() / f"{slug}-{digest}.json", key)
    return found


# ------------------------------------------------------------------------------------------------------ storage
def _warn_once(path: Path, why: str) -> None:
    if path not in _WARNED:
        _WARNED.add(path)
        warnings.warn(f"fastbert: tuning cache {path} ignored ({why}); measuring again", stacklevel=5)


def _read(path: Path) -> dict[str, Entry]:
    """The entries of one file ({} when absent; a file that cannot be read or parsed warns once)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return {cls: Entry(**value) for cls, value in raw["entries"].items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _warn_once(path, f"{type(err).__name__}: {err}")
        return {}


def entries(device: torch.device) -> dict[str, Entry]:
    """The process's table for ``device`` (read from disk on first use)."""
    path, _ = key_file(device)
    with _LOCK:
        table = _STORE.get(path)
        if table is None:
            table = _STORE[path] = _read(path)
        return table


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock between processes on ``path``'s file (fcntl where there is one)."""
    try:
        import fcntl
    except ImportError:  # no fcntl (Windows): the atomic rename still keeps each file whole
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record(device: torch.device, cls: str, entry: Entry) -> None:
    """Keep ``entry`` for ``cls`` in the process's table and in the device's file (merged with what is on disk:
    another process may have written since; a directory that cannot be written warns once and is skipped)."""
    path, key = key_file(device)
    with _LOCK:
        _STORE.setdefault(path, {})[cls] = entry
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _file_lock(path):
                merged = {**_read(path), **_STORE[path]}
                _STORE[path].update(merged)
                document = {"schema": FILE_SCHEMA, "key": key,
                            "entries": {c: e.to_json() for c, e in sorted(merged.items())}}
                write_atomic(path, json.dumps(document, indent=1, sort_keys=True) + "\n")
        except OSError as err:
            _warn_once(path, f"cannot write: {err}")


def forget() -> None:
    """Drop the process's table (the files stay): the next lookup reads them again."""
    global _epoch
    with _LOCK:
        _STORE.clear()
        _KEY_FILES.clear()
        _epoch += 1


def clear() -> list[Path]:
    """Remove every tuning file under `tuning_dir` (and the process's table); returns the files removed."""
    forget()
    directory = tuning_dir()
    removed = []
    for path in sorted(directory.glob("*.json*")) if directory.is_dir() else []:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            if path.suffix == ".json":
                removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------------------- measuring
def can_measure(tensors: list[torch.Tensor]) -> bool:
    """Whether timing runs may happen now: not while torch.compile traces or torch.jit traces, not during CUDA
    graph capture, only on plain tensors."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        return False
    return True


def _outputs(out) -> list[torch.Tensor]:
    items = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in items if isinstance(o, torch.Tensor) and o.requires_grad]


def _prepare(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Under autograd: the arguments with every tensor that requires grad replaced by a detached leaf (same
    storage, never written) that requires grad; those leaves."""
    if not torch.is_grad_enabled():
        return args, kwargs, []
    leaves: list[torch.Tensor] = []

    def swap(value):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            leaves.append(value.detach().requires_grad_(True))
            return leaves[-1]
        return value

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}, leaves


def _gpu_call(fn: Callable, args: tuple, kwargs: dict) -> float:
    """GPU ms of one call: queued behind a sleep (so the host has launched it all before the GPU starts it),
    between CUDA events on the current stream. When the GPU reached the start event before the host had launched
    everything (the sleep was too short: host time would be in the figure), again with a sleep four times longer,
    at most three times."""
    cycles = SLEEP_CYCLES
    while True:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn(*args, **kwargs)
        caught_up = start.query()  # the GPU is already past the sleep while the host is still here
        end.record()
        end.synchronize()
        if not caught_up or cycles >= 64 * SLEEP_CYCLES:
            return start.elapsed_time(end)
        cycles *= 4


def _call(fn: Callable, args: tuple, kwargs: dict, leaves: list[torch.Tensor], sync: Callable[[], None],
          clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    out = fn(*args, **kwargs)
    outputs = _outputs(out) if leaves else []
    if outputs:
        torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs], allow_unused=True)
    sync()
    return (clock() - start) * 1e3


def measure(candidates: dict[str, Callable], args: tuple, kwargs: dict, budget_s: float = BUDGET_S,
            warm_up: bool = True) -> tuple[dict[str, float], int, str]:
    """Time each candidate on the call (see the module's doc): ({backend: ms}, rounds, clock): the median round by
    the thread's CPU time, else the fastest round by the wall clock or the GPU's. ``budget_s``: a round starts
    while it is expected (by the last round's time) to end within it (`MIN_ROUNDS` at least); ``warm_up=False``
    when the caller has called each candidate already.

    The clock: on CPU with one intra-op thread, the calling thread's CPU time (every kernel then runs on that
    thread, and time spent descheduled by other processes does not count: the choice holds on a busy machine);
    on CUDA for a graph (`for_replay`, no autograd), the GPU's time alone (`_gpu_call`); otherwise wall time
    (several threads, or CUDA, synchronized around each call)."""
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    cuda = sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                   for t in tensors if t.is_cuda})
    sync = (lambda: [torch.cuda.synchronize(i) for i in cuda]) if cuda else (lambda: None)
    thread_clock = not cuda and torch.get_num_threads() == 1
    clock = time.thread_time if thread_clock else time.perf_counter
    args, kwargs, leaves = _prepare(args, kwargs)
    gpu_clock = bool(cuda) and not leaves and replaying() and hasattr(torch.cuda, "_sleep")

    def timed(fn: Callable) -> float:
        return _gpu_call(fn, args, kwargs) if gpu_clock else _call(fn, args, kwargs, leaves, sync, clock)

    times: dict[str, list[float]] = {name: [] for name in candidates}
    with torch.random.fork_rng(devices=cuda):
        sync()
        for fn in candidates.values() if warm_up else ():
            _call(fn, args, kwargs, leaves, sync)
        start = time.perf_counter()
        rounds, last_round_s = 0, 0.0
        # a round starts only if it is expected to end within the budget (MIN_ROUNDS whatever it costs)
        while rounds < ROUNDS and (rounds < MIN_ROUNDS or time.perf_counter() - start + last_round_s <= budget_s):
            names = list(candidates)
            names = names[rounds % len(names):] + names[:rounds % len(names)]  # rotated order
            round_start = time.perf_counter()
            for name in names:
                times[name].append(timed(candidates[name]))
            last_round_s = time.perf_counter() - round_start
            rounds += 1
    # CPU time scatters both ways (caches shared with other processes): the median; wall time only gains from the
    # load: the fastest round.
    summary = statistics.median if thread_clock else min
    clock_name = "gpu" if gpu_clock else "thread cpu" if thread_clock else "wall"
    return {name: summary(values) for name, values in times.items()}, rounds, clock_name


def pick(times: dict[str, float], preferred: str | None = None, margin: float = MARGIN) -> str:
    """The fastest candidate, except that ``preferred`` (the static order's choice) stays unless another is more
    than ``margin`` faster."""
    fastest = min(times, key=lambda name: (times[name], list(times).index(name)))
    if preferred in times and times[preferred] <= times[fastest] * (1 + margin):
        return preferred
    return fastest
