"""One dispatch for every fused op: backends ``eager`` | ``triton`` | ``cpp`` | ``vendor`` | ``onednn``.

Each backend registers, per op, an implementation and a ``supports`` check that returns ``None`` when it can run
the given inputs and otherwise the reason it cannot. ``backend="auto"`` takes, among the backends of the inputs'
device whose check passes, the fastest measured (below) or, with measuring off, the first of a preference list; a
forced backend whose check fails raises :class:`BackendUnavailable` carrying that reason. The env var
``FASTBERT_BACKEND`` forces a backend wherever ``"auto"`` was asked for; it is read once, when fastbert is imported
(`read_environment` reads it again).

``auto`` measures (`fastbert.backends.tuning`): on the first call of an op in a shape class, every backend of the
device's order that can run the call is timed on it and the fastest is kept, in the process and in a file of the
tuning cache (``FASTBERT_CACHE_DIR``), so later processes on the same machine and versions measure nothing. The
preference lists below are only the fallback: with measuring off (``FASTBERT_TUNE=0``, `set_measuring`), while
torch.compile traces, and where timing cannot run (CUDA graph capture, fake tensors) without a cached choice.

`dispatch` chooses at every call (the functional entries in `fastbert.ops` use it); a model resolves an
`OpTable` once per (device, dtype, grad mode, backend request) and calls the implementations directly.

Layout: this module is the dispatcher; each backend other than ``eager`` is a module of this package,
`fastbert.backends.cpp` (the C++ extension ``fastbert._C``), `fastbert.backends.triton` (the Triton kernels of
``fastbert.kernels``), `fastbert.backends.vendor` (cuBLAS GEMMs + Triton epilogues) and `fastbert.backends.onednn`
(oneDNN GEMMs on packed weights + cpp epilogues, CPU inference), each of which registers its implementations when
imported and says what it runs on with ``describe()``. A backend whose kernels are torch ops names them
``torch.ops.fastbert.<backend>_<op>`` (``cpp_attention``, ``triton_attention``), declared from the op's spec
(`fastbert.ops.spec.OpSpec.define`); the ``eager`` implementations are the specs' own (`fastbert.ops`).

Those modules are loaded lazily on first use (importing triton costs about a second), so ``import fastbert`` stays
cheap; a backend that fails to load is remembered with the reason. A backend's torch ops exist only once it is
loaded: code that calls them directly, not through `dispatch`, loads it first with `load`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.weak

from fastbert import cpu
from fastbert.backends import tuning

BACKENDS = ("eager", "triton", "cpp", "vendor", "onednn")


def cpu_auto_order() -> tuple[str, ...]:
    """The CPU backends `auto` considers, float32 and bfloat16 alike: cpp, onednn (GEMMs on weights packed once) and
    eager, on every CPU. Which wins depends on the CPU and its BLAS: on AMX oneDNN wants its weights in VNNI tiles;
    on an AMD EPYC (AVX-512, no AMX) the whole fp32 MiniLM forward at 8x128 ran 118 ms forced onto onednn against
    134 ms through cpp (`benchmarks/results/cpu-2core-whole-model-amd/run0-fp32-forced.md`); on an Intel AVX-512 VM
    they came out level (`benchmarks/results/cpu-2core-ops-onednn/`),
    and with AVX-512 BF16 but no AMX onednn's bf16 forwards ran 1.07-1.09x faster
    (`benchmarks/results/cpu-2core-avx512bf16/`). The packed copy of a weight whose op onednn did not win is
    released (`release`)."""
    return ("cpp", "onednn", "eager")


def cpu_packed_bf16(flags: frozenset[str] | None = None) -> str | None:
    """The backend that alone runs bfloat16 inference GEMMs under `auto` on a CPU with these flags (default: this
    CPU's): ``onednn`` (weights packed once) where the CPU has AMX-BF16, else None (every candidate timed). The
    others hand oneDNN the weights as stored, which it reorders into the VNNI tiles AMX reads at every call: timed
    alone, such a GEMM can come out ahead (cpp's MiniLM attention-output GEMM at 128 tokens, 0.072 vs 0.081 ms),
    but the whole forward pays for it: MiniLM bf16 at 1 x 128 ran 4.25 ms with cpp's and 4.07 with onednn's
    (interleaved medians on the 2-core AMX VM, `benchmarks/results/cpu-2core-amx/README.md`)."""
    flags = cpu.cpu_info()[1] if flags is None else flags
    return "onednn" if cpu.AMX_BF16 in flags else None


# The backends `auto` considers per device type (measuring takes the fastest of those that can run a call), and
# with measuring off its preference: the static order. Triton on CPU only runs under TRITON_INTERPRET=1, which is
# far too slow to be picked automatically, so `auto` never takes it for CPU tensors.
AUTO_ORDER = {"cuda": ("triton", "vendor", "eager"), "cpu": cpu_auto_order()}
# Per device type, the backend that alone runs bfloat16 inference calls of the ops it has a GEMM of its own for,
# wherever it can run them (`packed_bf16_choice`), or None.
PACKED_BF16 = {"cpu": cpu_packed_bf16()}
PACKED_BF16_HOW = "bf16 GEMM on weights packed once (PACKED_BF16)"
UNPACKED_BF16 = ("not timed for bfloat16 here: its GEMM hands oneDNN the weight as stored, reordered for AMX at every "
                 "call (PACKED_BF16)")
# The static order under autograd (grad mode on and an input that requires grad). The cpp backward of most ops is
# the spec's formula in PyTorch ops, recomputing from saved inputs: `benchmarks/train_step_cpu.py` (4 layers, H 256,
# one thread, 2-core VM) measured a step at 288 ms through cpp vs 220 ms through eager, so the static order trains
# those through eager on CPU; backend="cpp" still trains through cpp.
AUTO_ORDER_AUTOGRAD = {"cuda": ("triton", "vendor", "eager"), "cpu": ("eager",)}
# Per-op exceptions to AUTO_ORDER_AUTOGRAD: op -> {device type: order}. Attention on CPU trains through cpp, whose
# forward and backward are C++ kernels that follow each sequence's real length (eager trains through SDPA's autograd,
# called per sequence); measured with `benchmarks/train_step_cpu.py` (README, Backends).
AUTO_ORDER_AUTOGRAD_BY_OP = {"attention": {"cpu": ("cpp", "eager")}}
_BACKEND_MODULES = {"triton": "fastbert.backends.triton", "cpp": "fastbert.backends.cpp",
                    "vendor": "fastbert.backends.vendor", "onednn": "fastbert.backends.onednn"}


class BackendUnavailable(RuntimeError):
    """A forced backend cannot run the given inputs; the message says why."""


@dataclass(frozen=True)
class OpImpl:
    """One backend's implementation of an op: the function, its ``supports`` check (None: it can run the inputs,
    else the reason), and whether it is differentiable."""

    fn: Callable
    supports: Callable[..., str | None]
    has_backward: bool = False


_REGISTRY: dict[str, dict[str, OpImpl]] = {}
# op -> position of its ``dropout_p`` argument (filled by `fastbert.ops.spec.declare` from the schemas): a training
# `OpTable` resolves these ops once with and once without dropout, since some kernels decline p > 0.
DROPOUT_ARGUMENT: dict[str, int] = {}
_LOAD_ERRORS: dict[str, str] = {}
_LOADED: set[str] = {"eager"}
_OBSERVERS: list[Callable[[str, str], None]] = []
_GENERATION = 0
_ENV_BACKEND = os.environ.get("FASTBERT_BACKEND", "auto") or "auto"  # read once: see `read_environment`
_WARNED: set[str] = set()
_DECIDED: dict[tuple, Decision] = {}  # `_call_key` -> measured decision (cleared with each generation)


# parameter -> the optimizer steps that updated it since `optimizer_steps` was first called: fused optimizers
# (torch.optim's fused=True, the HF Trainer's default adamw_torch_fused) write parameters without moving their
# version counters, so each step counts as a possible write to every parameter it holds (and to no other: a
# distillation teacher beside a training student keeps its packed copies).
_STEPS = torch.utils.weak.WeakIdKeyDictionary()
_STEP_HOOK: list = []
_ALL_STEPS = [0]  # optimizer steps of any optimizer since the hook was installed


# backend -> what drops the copies it keeps of some tensors (onednn's packed weights): `release`
_RELEASERS: dict[str, Callable[[Iterable[torch.Tensor]], None]] = {}


def register_release(backend: str, releaser: Callable[[Iterable[torch.Tensor]], None]) -> None:
    """``releaser(tensors)`` drops whatever ``backend`` keeps derived from those tensors."""
    _RELEASERS[backend] = releaser


def release(backend: str, tensors: Iterable[torch.Tensor]) -> None:
    """Drop what ``backend`` keeps derived from ``tensors`` (nothing for a backend that keeps nothing): called when
    `auto` measured it and chose another, so that a copy made only to be timed does not stay."""
    releaser = _RELEASERS.get(backend)
    if releaser is not None:
        releaser(tensors)


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _ALL_STEPS[0] += 1
    for group in optimizer.param_groups:
        for param in group["params"]:
            _STEPS[param] = _STEPS.get(param, 0) + 1


def _watch_optimizer_steps() -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_count_optimizer_step))


def optimizer_steps(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """How many torch optimizer steps updated each of ``tensors`` (counted from the first call of this function, by
    a global step post-hook)."""
    _watch_optimizer_steps()
    return tuple(_STEPS.get(tensor, 0) for tensor in tensors)


def all_optimizer_steps() -> int:
    """How many steps any torch optimizer took (counted from the first call of this function or of
    `optimizer_steps`): one integer to compare where a step of any optimizer may be taken as a change."""
    _watch_optimizer_steps()
    return _ALL_STEPS[0]


def weight_stamp(tensor: torch.Tensor) -> tuple:
    """What changes when ``tensor``'s values may have changed: its storage, layout and version counter (plain
    tensors only; inference tensors have none), and the optimizer steps that updated it (`optimizer_steps`).
    In-place writes through ``.data`` (which bypasses version counters) are not seen. (fastbert.optimize's packed
    Q/K/V is a tensor of its own, refreshed in place: its counter moves.)"""
    return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
            None if tensor.is_inference() else tensor._version, *optimizer_steps((tensor,)))


def cpu_float_reason(backend: str, tensors: Iterable[torch.Tensor | None],
                     dtypes: tuple[torch.dtype, ...]) -> str | None:
    """None when the float tensors (None skipped) all lie on the CPU in one dtype of ``dtypes``; else why
    ``backend``, a CPU backend, cannot take them."""
    dtype = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            return f"the {backend} backend runs on CPU tensors only, got a tensor on {t.device}"
        if dtype is None:
            dtype = t.dtype
            if dtype not in dtypes:
                names = " and ".join(str(d).removeprefix("torch.") for d in dtypes)
                return f"the {backend} backend supports {names}, got {dtype}"
        elif t.dtype != dtype:
            return f"the {backend} backend needs one dtype for all float tensors, got {dtype} and {t.dtype}"
    return None


def register(op: str, backend: str, fn: Callable, supports: Callable[..., str | None] | None = None,
             has_backward: bool = False) -> None:
    """Register ``fn`` as ``backend``'s implementation of ``op`` (called by the backend modules at import)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _REGISTRY.setdefault(op, {})[backend] = OpImpl(fn, supports or (lambda *a, **k: None), has_backward)
    _bump()


def implementations(op: str) -> dict[str, OpImpl]:
    """The backends that registered ``op`` (loaded ones only: see `available`) and their implementations."""
    return dict(_REGISTRY.get(op, {}))


def _load(backend: str, warn: bool = True) -> str | None:
    """Import a backend's module once; returns the reason it is unavailable, or None. The first time a backend
    that an op wanted failed to load, a warning says so (the cpp module warns itself when only its compiled
    extension is missing); listing backends (`available`) does not warn."""
    if backend in _LOADED:
        return None
    if backend not in _LOAD_ERRORS:
        try:
            importlib.import_module(_BACKEND_MODULES[backend])
        except Exception as err:  # noqa: BLE001 - any import failure makes the backend unavailable, with its reason
            _LOAD_ERRORS[backend] = f"{backend} backend failed to load: {type(err).__name__}: {err}"
        else:
            _LOADED.add(backend)
            return None
    if warn and backend not in _WARNED:
        _WARNED.add(backend)
        warnings.warn(f"fastbert: the {_LOAD_ERRORS[backend]}; its ops run on another backend", stacklevel=4)
    return _LOAD_ERRORS[backend]


def read_environment() -> None:
    """(Re-)read ``FASTBERT_BACKEND`` and ``FASTBERT_TUNE``. They are read once, when fastbert is imported; a
    process that changes them later calls this (op tables resolved before are dropped)."""
    global _ENV_BACKEND
    _ENV_BACKEND = os.environ.get("FASTBERT_BACKEND", "auto") or "auto"
    tuning.read_environment()
    _bump()


def set_measuring(enabled: bool) -> None:
    """Turn measuring on or off for the process (``FASTBERT_TUNE`` sets it at import): off, ``auto`` takes the
    static order. Op tables resolved before are dropped."""
    tuning.set_enabled(enabled)
    _bump()


@contextmanager
def measuring(enabled: bool) -> Iterator[None]:
    """Measuring on or off for the ops first resolved within the block; op tables resolved before keep their
    choices (so a benchmark can hold a measured and a static model side by side)."""
    before = tuning.enabled()
    tuning.set_enabled(enabled)
    try:
        yield
    finally:
        tuning.set_enabled(before)


def _bump() -> None:
    global _GENERATION
    _GENERATION += 1
    _DECIDED.clear()


def generation() -> int:
    """Changes whenever something an `OpTable` resolved depends on changes (environment, registrations,
    observers): models key their tables on it."""
    return _GENERATION


def requested_backend(backend: str | None) -> str:
    """Resolve the user's request: an explicit backend wins, ``auto``/None defers to ``FASTBERT_BACKEND``."""
    if backend in (None, "auto"):
        if _ENV_BACKEND != "auto" and _ENV_BACKEND not in BACKENDS:
            raise ValueError(f"FASTBERT_BACKEND={_ENV_BACKEND!r} is not a backend; expected 'auto' or one of "
                             f"{BACKENDS}")
        return _ENV_BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {BACKENDS}")
    return backend


def _tensors(args: Iterable, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def why_not(op: str, backend: str, *args, **kwargs) -> str | None:
    """The reason ``backend`` cannot run ``op`` on these inputs, or None if it can."""
    reason = _load(backend)
    if reason:
        return reason
    impl = _REGISTRY.get(op, {}).get(backend)
    if impl is None:
        return f"{backend} backend has no implementation of {op}"
    tensors = _tensors(args, kwargs)
    if not impl.has_backward and tuning.under_autograd(tensors):
        return f"{backend} backend has no backward for {op} and an input requires grad"
    if backend != "eager" and torch.compiler.is_compiling() and _dropout_p(op, args, kwargs) > 0:
        return (f"under torch.compile dropout draws from torch's traced RNG, which only the eager {op} uses (this "
                "backend's kernel would take a seed fixed when the graph was traced)")
    return impl.supports(*args, **kwargs)


def _dropout_p(op: str, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of a call of ``op`` (0 for an op without dropout)."""
    index = DROPOUT_ARGUMENT.get(op)
    return 0.0 if index is None else _dropout_at(index, args, kwargs)


def _dropout_at(index: int, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of a call whose op takes it as positional argument ``index`` (or by name)."""
    return kwargs["dropout_p"] if "dropout_p" in kwargs else args[index] if len(args) > index else 0.0


def preload(backend: str | None, device_type: str) -> None:
    """Load, now, every backend that `choose` may try for ``backend`` on ``device_type`` (without warning: an op
    that wants a backend that failed to load warns then). Called before torch.compile traces a model: an import
    inside a compiled region breaks the graph."""
    backend = requested_backend(backend)
    if backend != "auto":
        candidates = {backend}
    else:
        candidates = {*AUTO_ORDER.get(device_type, ()),
                      *AUTO_ORDER_AUTOGRAD.get(device_type, ())}
        candidates.update(*(orders.get(device_type, ()) for orders in AUTO_ORDER_AUTOGRAD_BY_OP.values()))
    for name in sorted(candidates - _LOADED - set(_LOAD_ERRORS)):
        _load(name, warn=False)


def auto_order(device_type: str) -> tuple[str, ...]:
    """The backends `auto` considers, in order, for inference calls on ``device_type`` (AUTO_ORDER's)."""
    return AUTO_ORDER.get(device_type, ())


def packed_bf16_choice(op: str, device_type: str, tensors: list[torch.Tensor]) -> str | None:
    """`PACKED_BF16`'s backend for a call of ``op`` on these tensors when the call is bfloat16 inference (no input
    requires grad under grad mode, not traced: onednn hands traced calls to cpp) and the backend has an
    implementation of ``op`` of its own (not one it runs for another backend), else None."""
    backend = PACKED_BF16.get(device_type)
    if backend is None or _float_dtype(tensors) != torch.bfloat16 or tuning.under_autograd(tensors):
        return None
    if torch.compiler.is_compiling():
        return None
    if _load(backend, warn=False) or backend not in _REGISTRY.get(op, {}):
        return None
    return backend if same_implementation(op, backend, [b for b in _REGISTRY[op] if b != backend]) is None else None


def autograd_order(op: str, device_type: str) -> tuple[str, ...]:
    """The backends `auto` tries, in order, for ``op`` under autograd on ``device_type`` (eager comes last anyway)."""
    return AUTO_ORDER_AUTOGRAD_BY_OP.get(op, {}).get(device_type, AUTO_ORDER_AUTOGRAD.get(device_type, ()))


def runs_eager(op: str, backend: str | None, device_type: str) -> bool:
    """Whether a call of ``op`` with ``backend`` requested runs its eager implementation for certain: eager forced,
    or ``auto`` under autograd on a device whose order for the op holds no other backend (CPU's linear ops)."""
    requested = requested_backend(backend)
    if requested == "eager":
        return True
    return requested == "auto" and torch.is_grad_enabled() and set(autograd_order(op, device_type)) <= {"eager"}


@dataclass(frozen=True)
class Decision:
    """How `auto` (or a forced backend) chose for one call: the backend, why each other was not used, how it was
    chosen (``forced``, ``measured``, ``cache``, ``only candidate`` or ``static order: <why>``), and for a measured
    choice each candidate's fastest time in ms and the shape class it holds for."""

    backend: str
    skipped: dict[str, str]
    how: str
    times_ms: dict[str, float] | None = None
    shape_class: str | None = None

    def describe(self) -> str:
        """'measured: cpp 0.12 ms, eager 0.31 ms' ('measured earlier' from the cache), 'static order: measuring
        off', ... ('' for a forced backend)."""
        if self.times_ms:
            times = ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(self.times_ms.items(), key=lambda i: i[1]))
            return ("measured" if self.how == "measured" else "measured earlier") + f": {times}"
        return "" if self.how == "forced" else self.how


def choose(op: str, backend: str | None, *args, **kwargs) -> tuple[str, dict[str, str]]:
    """Pick the backend for ``op``: returns (backend, {skipped backend: reason}) (`decide` says how)."""
    decision = decide(op, backend, args, kwargs)
    return decision.backend, decision.skipped


def decide(op: str, backend: str | None, args: tuple, kwargs: dict, measure: bool | None = None) -> Decision:
    """The `Decision` for a call of ``op`` with ``args``/``kwargs``: a forced backend if it can run them, else
    ``auto``'s: measured (``measure``, default `tuning.enabled`) or the static order."""
    backend = requested_backend(backend)
    if backend != "auto":
        reason = why_not(op, backend, *args, **kwargs)
        if reason:
            raise BackendUnavailable(f"fastbert.ops.{op}: backend {backend!r} cannot run these inputs: {reason}")
        return Decision(backend, {}, "forced")
    tensors = _tensors(args, kwargs)
    device_type = tensors[0].device.type if tensors else "cpu"
    if not (tuning.enabled() if measure is None else measure):
        return _static(op, device_type, tensors, args, kwargs, "static order: measuring off")
    if torch.compiler.is_compiling():  # no file reads or timing inside a traced graph
        return _static(op, device_type, tensors, args, kwargs, "static order: not measured under torch.compile")
    try:
        key = _call_key(op, args, kwargs)
        known = _DECIDED.get(key)
    except TypeError:  # an unhashable argument: decide without the memo
        key = known = None
    if known is not None:
        return known
    decision = _measured(op, device_type, tensors, args, kwargs)
    if key is not None and not decision.how.startswith("static"):
        if len(_DECIDED) > 4096:
            _DECIDED.clear()
        _DECIDED[key] = dataclasses.replace(decision, how="cache") if decision.how == "measured" else decision
    return decision


def _call_key(op: str, args: tuple, kwargs: dict) -> tuple:
    """What a measured decision depends on, cheaply: per argument its shape, dtype, device and whether it requires
    grad (tensors), on/off (dropout_p), nothing (the dropout seed) or the value; grad mode, threads, whether the
    call is for a CUDA graph (`tuning.for_replay`), the cache's `tuning.state`. The memo of `dispatch` users, who
    decide at every call."""
    index = DROPOUT_ARGUMENT.get(op, -2)
    parts = [op, torch.is_grad_enabled(), torch.get_num_threads(), tuning.replaying(), tuning.state()]
    for i, value in enumerate(args):
        parts.append(_fingerprint(value, i == index, i == index + 1))
    for name, value in kwargs.items():
        parts.append((name, _fingerprint(value, name == "dropout_p", name == "dropout_seed")))
    return tuple(parts)


def _fingerprint(value, dropout: bool, seed: bool):
    if isinstance(value, torch.Tensor):
        return value.shape, value.dtype, value.device, value.requires_grad
    if seed:
        return None
    if dropout:
        return value > 0
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(v, False, False) for v in value)
    return value


def _float_dtype(tensors: list[torch.Tensor]) -> torch.dtype | None:
    """The dtype of a call's first floating-point tensor (its ids and masks come first in some ops)."""
    return next((t.dtype for t in tensors if t.is_floating_point()), None)


def _static(op: str, device_type: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict,
            how: str) -> Decision:
    """`auto` by the static preference lists (`auto_order`, and under autograd `autograd_order`)."""
    skipped: dict[str, str] = {}
    order = inference_order = auto_order(device_type)
    packed = packed_bf16_choice(op, device_type, tensors)
    if packed is not None and why_not(op, packed, *args, **kwargs) is None:
        untimed = [name for name in order if name != packed and why_not(op, name, *args, **kwargs) is None]
        return Decision(packed, dict.fromkeys(untimed, UNPACKED_BF16), f"{how}; {PACKED_BF16_HOW}")
    if tuning.under_autograd(tensors):
        order = autograd_order(op, device_type)
        for preferred in inference_order:
            if preferred in order:
                continue
            reason = why_not(op, preferred, *args, **kwargs)
            same = None if reason else same_implementation(op, preferred, [*order, "eager"])
            if same is None:  # (one that runs an ordered backend's implementation is not a choice of its own)
                skipped[preferred] = reason or (
                    "auto trains through eager here: this backend's backward recomputes with PyTorch ops and is "
                    "slower than eager's autograd (force it with backend=)")
    for candidate in order + ("eager",):
        reason = why_not(op, candidate, *args, **kwargs)
        if reason is None:
            return Decision(candidate, skipped, how)
        skipped[candidate] = reason
    raise BackendUnavailable(f"fastbert.ops.{op}: no backend can run these inputs: {skipped}")


def _measured(op: str, device_type: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Decision:
    """`auto` by measurement among the device's backends that can run the call (`fastbert.backends.tuning`)."""
    skipped: dict[str, str] = {}
    candidates = []
    for candidate in dict.fromkeys(auto_order(device_type) + ("eager",)):
        reason = why_not(op, candidate, *args, **kwargs)
        same = None if reason else same_implementation(op, candidate, candidates)
        if same is not None:  # e.g. vendor runs triton's kernel for ops without a GEMM: nothing to compare
            skipped[candidate] = f"runs {same}'s implementation of {op}"
        elif reason is None:
            candidates.append(candidate)
        else:
            skipped[candidate] = reason
    if not candidates:
        raise BackendUnavailable(f"fastbert.ops.{op}: no backend can run these inputs: {skipped}")
    packed = packed_bf16_choice(op, device_type, tensors)
    if packed in candidates:
        skipped.update({name: UNPACKED_BF16 for name in candidates if name != packed})
        return Decision(packed, skipped, PACKED_BF16_HOW)
    if len(candidates) == 1:
        return Decision(candidates[0], skipped, "only candidate")
    device = tensors[0].device
    shape_class = f"{op} {tuning.shape_class(args, kwargs, DROPOUT_ARGUMENT.get(op))}"
    entry = tuning.entries(device).get(shape_class)
    how = "cache"
    if entry is None or entry.choice not in candidates or set(entry.times_ms) != set(candidates):
        if not tuning.can_measure(tensors):
            return _static(op, device_type, tensors, args, kwargs, "static order: cannot measure now (CUDA graph "
                           "capture, tracing or a tensor subclass) and nothing cached")
        times, rounds, clock = tuning.measure({name: _REGISTRY[op][name].fn for name in candidates}, args, kwargs)
        preferred = _static(op, device_type, tensors, args, kwargs, "").backend
        entry = tuning.Entry(tuning.pick(times, preferred), times, rounds, clock)
        tuning.record(device, shape_class, entry)
        how = "measured"
        for name in candidates:  # (only here: a cached choice made no copy, and another class may run one)
            if name != entry.choice:
                release(name, tensors)
    best = entry.times_ms[entry.choice]
    for name, ms in entry.times_ms.items():
        if name != entry.choice:
            skipped[name] = (f"measured slower: {ms:.3g} ms vs {best:.3g} ms" if ms >= best else
                             f"measured {ms:.3g} ms vs {best:.3g} ms: not {tuning.MARGIN:.0%} faster than the "
                             "static order's choice")
    return Decision(entry.choice, skipped, how, dict(entry.times_ms), shape_class)


# ------------------------------------------------------------------------------------------ whole-model decisions
# Op by op, the fastest implementation can make a slower forward: caches and packed weights are shared between ops
# (a GEMM faster timed alone was slower inside the forward on AMX). So `auto` also times whole inference forwards of
# a model, per shape class: the per-op table (`MODEL_TABLE`) against each backend running every op alone, and the
# forward runs the winner. CPU only (on CUDA every backend of the table shares the GPU's caches the same way).
MODEL_TABLE = "per-op table"
MODEL_MARGIN = 0.02  # a whole forward is long and steady: a backend alone replaces the table when 2 % faster
FIRST_USE_BUDGET_S = 5.0  # the timing a model's first forward of a class may add, at most (else the table runs)
_model_budget_s = FIRST_USE_BUDGET_S
_MODEL_LOCK = threading.RLock()


@contextmanager
def model_budget(seconds: float) -> Iterator[None]:
    """Within the block, whole-model decisions may spend up to ``seconds`` per shape class (`fastbert tune`)."""
    global _model_budget_s
    previous, _model_budget_s = _model_budget_s, seconds
    try:
        yield
    finally:
        _model_budget_s = previous


def model_candidates(device_type: str) -> tuple[str, ...]:
    """The whole-model candidates: the per-op table, then each backend `auto` considers, alone, but eager (the
    reference implementation: the table already runs it wherever it wins an op, and alone it is the slowest)."""
    return (MODEL_TABLE, *(name for name in auto_order(device_type) if name != "eager"))


def model_class(signature: str, dtype: torch.dtype, tokens: int) -> str:
    """The class of a whole inference forward: the model's architecture, dtype, threads and its token count's
    `tuning.bucket` (the GEMMs, which decide, scale with the tokens)."""
    return (f"model {signature} {str(dtype).removeprefix('torch.')} no-grad t{torch.get_num_threads()} "
            f"tokens<={tuning.bucket(tokens)}")


def decide_model(cls: str, device: torch.device, run: Callable[[str], object],
                 weights: Iterable[torch.Tensor]) -> Decision:
    """The whole-model `Decision` for a forward of class ``cls``: cached, or measured now when its rounds fit the
    budget (`FIRST_USE_BUDGET_S`, or `model_budget`'s). ``run(candidate)`` runs the forward on a candidate (raising
    `BackendUnavailable` where a backend cannot run it all); ``weights``: what a backend that lost may release."""
    with _MODEL_LOCK:  # one decision at a time: two timing at once would each time the other's load
        entry = tuning.entries(device).get(cls)
        if entry is not None:
            return Decision(entry.choice, {}, "cache", dict(entry.times_ms), cls)
        return _measure_model(cls, device, run, weights)


def _measure_model(cls: str, device: torch.device, run: Callable[[str], object],
                   weights: Iterable[torch.Tensor]) -> Decision:
    """`decide_model` when nothing is cached: warm up each candidate, then time them if the budget allows."""
    once: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for name in model_candidates(device.type):  # the warm-up: the table's ops measure themselves here
        start = time.perf_counter()
        try:
            run(name)
        except BackendUnavailable as err:
            skipped[name] = str(err)
            continue
        once[name] = time.perf_counter() - start
    estimate = min(once.values(), default=0.0) * len(once) * tuning.MIN_ROUNDS
    if len(once) < 2 or estimate > _model_budget_s:
        why = (f"not timed: {tuning.MIN_ROUNDS} rounds of {len(once)} candidates take about {estimate:.1f} s, over "
               f"the {_model_budget_s:g} s budget (fastbert tune has a larger one)") if len(once) > 1 else \
            "only candidate"
        decision = Decision(MODEL_TABLE, skipped, why, None, cls)
    else:
        candidates = {name: functools.partial(run, name) for name in once}
        times, rounds, clock = tuning.measure(candidates, (), {}, budget_s=_model_budget_s, warm_up=False)
        entry = tuning.Entry(tuning.pick(times, MODEL_TABLE, MODEL_MARGIN), times, rounds, clock)
        tuning.record(device, cls, entry)
        decision = Decision(entry.choice, skipped, "measured", dict(times), cls)
    weights = list(weights)
    for name in once:
        if name != decision.backend:
            release(name, weights)  # (a weight the table runs on that backend is packed again on its next call)
    return decision


def same_implementation(op: str, candidate: str, earlier: list[str]) -> str | None:
    """The earlier candidate whose implementation of ``op`` is ``candidate``'s very function, if any."""
    fn = _REGISTRY[op][candidate].fn
    return next((name for name in earlier if getattr(_REGISTRY[op].get(name), "fn", None) is fn), None)


def dispatch(op: str, backend: str | None, *args, **kwargs):
    """Run ``op`` on the chosen backend (chosen again at every call: models use an `OpTable` instead)."""
    chosen, _ = choose(op, backend, *args, **kwargs)
    for observer in _OBSERVERS:
        observer(op, chosen)
    return _REGISTRY[op][chosen].fn(*args, **kwargs)


@contextmanager
def observe(observer: Callable[[str, str], None]) -> Iterator[None]:
    """Within the block, call ``observer(op, backend)`` for every fused op call, through `dispatch` or an
    `OpTable` (tables resolved outside the block do not report, so models resolve new ones)."""
    _OBSERVERS.append(observer)
    _bump()
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)
        _bump()


class OpTable:
    """Every op's implementation, resolved once and then called directly: the dispatch of a model for one
    (device, dtype, grad mode, backend request). An op is resolved on its first call, by `decide` on that call's
    arguments (``supports`` sees real tensors); later calls skip the choice and the argument checks, which the
    model's fixed shapes make redundant. Attribute per op: ``table.attention(q, k, v, cu_seqlens, max_seqlen,
    key_padding_mask, scale)`` takes the arguments `dispatch` passes to the implementations. A ``training`` table
    resolves an op with a dropout argument twice, for calls with and without dropout (its sites differ in p).

    A table made while measuring is on (``measure``) with the request ``auto`` resolves an op once per shape of
    its first argument and per `tuning.replaying` instead (each maps to its measured shape class; a CUDA graph's
    calls are measured apart); ``chosen`` holds each op's latest
    backend and ``decisions`` every `Decision` per op and shape class."""

    def __init__(self, backend: str | None, training: bool = False):
        self.backend = backend
        self.training = training
        self.measure = tuning.enabled()
        self.chosen: dict[str, str] = {}
        self.decisions: dict[str, dict[str, Decision]] = {}

    def __getattr__(self, op: str):
        if op.startswith("_") or op not in _REGISTRY:
            raise AttributeError(op)
        index = DROPOUT_ARGUMENT.get(op) if self.training else None
        per_shape = self.measure and requested_backend(self.backend) == "auto"
        resolved: dict = {}

        def call(*args, **kwargs):
            key = None
            if per_shape:  # a graph's calls are measured apart (`tuning.for_replay`)
                first = args[0] if args else None
                key = (first.shape if isinstance(first, torch.Tensor) else None, tuning.replaying())
            if index is not None:
                key = (key, _dropout_at(index, args, kwargs) > 0)  # the index is known: no table lookup per call
            fn = resolved.get(key)
            if fn is None:
                if len(resolved) > 1024:  # many distinct batch shapes: start over (each lookup is cheap)
                    resolved.clear()
                fn = resolved[key] = self._resolve(op, index, args, kwargs)
                if not per_shape and index is None:
                    setattr(self, op, fn)  # one choice for every call: later calls skip this wrapper
            return fn(*args, **kwargs)

        setattr(self, op, call)
        return call

    def _resolve(self, op: str, index: int | None, args: tuple, kwargs: dict) -> Callable:
        decision = decide(op, self.backend, args, kwargs, self.measure)
        label = op + (" (dropout)" if index is not None and _dropout_at(index, args, kwargs) > 0 else "")
        self.chosen[label] = decision.backend
        self.decisions.setdefault(label, {})[decision.shape_class or ""] = decision
        fn = _REGISTRY[op][decision.backend].fn
        return _observed(op, decision.backend, fn) if _OBSERVERS else fn


def _observed(op: str, chosen: str, fn: Callable) -> Callable:
    def call(*args, **kwargs):
        for observer in _OBSERVERS:
            observer(op, chosen)
        return fn(*args, **kwargs)

    return call


class PerCallDispatch:
    """`OpTable`'s interface over `dispatch` (chosen at every call): what a model uses while torch.compile traces
    it, since dynamo follows plain calls better than a table that rewrites itself."""

    def __init__(self, backend: str | None):
        self.backend = backend

    def __getattr__(self, op: str):
        if op.startswith("_"):
            raise AttributeError(op)
        return functools.partial(dispatch, op, self.backend)


def explain(op, *args, backend: str | None = "auto", **kwargs) -> str:
    """A one-line human answer: which backend runs ``op`` on these inputs, how it was chosen (the measured times
    behind it, or "static order: measuring off"), and why the others were not used. With measuring on, a call
    whose shape class has not been measured is measured here.

    ``explain(model)`` (a fastbert model, or a model `fastbert.optimize` changed) needs no op arguments: which
    backend each op of that model ran on, per (device, dtype, grad mode) it has run with."""
    if isinstance(op, torch.nn.Module):
        return _explain_model(op)
    decision = decide(op, backend, args, kwargs)
    how = decision.describe()
    others = "; ".join(f"{name}: {reason}" for name, reason in decision.skipped.items()
                       if not reason.startswith("measured"))
    return (f"{op}: {decision.backend}" + (f" ({how})" if how else "")
            + (f" (not used: {others})" if others else ""))


def load(backend: str) -> str | None:
    """Load ``backend`` now, without warning (backends otherwise load on first use): None once it is loaded, its
    torch ops ``torch.ops.fastbert.<backend>_<op>`` declared; else the reason it failed to load. Code that calls
    those torch ops directly calls this first."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return _load(backend, warn=False)


def available() -> dict[str, str | None]:
    """Each backend and the reason it failed to load (None when it loaded)."""
    return {name: load(name) for name in BACKENDS}


def describe_available() -> str:
    """`available()` in words, for people (``scripts/setup.sh`` prints it): each backend loaded, with what it runs
    here, or why not; e.g. ``eager loaded; triton loaded (no GPU: CPU only under TRITON_INTERPRET=1); cpp loaded
    (AVX2)``."""
    parts = []
    for name, reason in available().items():
        if reason is not None:
            parts.append(f"{name} not loaded ({reason.removeprefix(f'{name} backend failed to load: ')})")
        elif name in _BACKEND_MODULES:
            parts.append(importlib.import_module(_BACKEND_MODULES[name]).describe())
        else:
            parts.append(f"{name} loaded")
    return "; ".join(parts)


def fastbert_encoders(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every fastbert encoder in ``model``, its own or one `fastbert.optimize` built."""
    encoders = []
    for module in model.modules():
        if "_op_tables" in module.__dict__ or type(module).__name__ == "FastBertModel":
            encoders.append((type(module).__name__, module))
        state = module.__dict__.get("_fastbert")  # fastbert.optimize's state on a transformers base model
        build = getattr(state, "build", None)
        if build is not None and build.fast is not None:
            encoders.append((f"{type(module).__name__} (fastbert.optimize)", build.fast))
    return encoders


def model_decisions(model: torch.nn.Module) -> list[tuple[str, Decision]]:
    """(op, `Decision`) for every op and shape class the fastbert encoders in ``model`` have resolved (the op
    carries " (dropout)" for a training call with dropout): what `explain` shows, for programs."""
    found = []
    for _, encoder in fastbert_encoders(model):
        for table in _own_tables(encoder).values():
            found.extend((op, decision) for op, by_class in table.decisions.items() for decision in by_class.values())
    return found


def _own_tables(encoder: torch.nn.Module) -> dict[tuple, OpTable]:
    """The encoder's op tables for its own backend request (not those of the backends a whole-model decision ran
    alone: `decide_model`)."""
    return {key: table for key, table in encoder.__dict__.get("_op_tables", {}).items() if key[4] == encoder.backend}


def whole_model_decisions(model: torch.nn.Module) -> list[Decision]:
    """Every whole-model `Decision` (`decide_model`) the fastbert encoders in ``model`` have made."""
    return [decision for _, encoder in fastbert_encoders(model)
            for decision in encoder.__dict__.get("_model_decisions", {}).values()]


def _model_line(decision: Decision) -> str:
    how = decision.describe() if decision.times_ms else decision.how
    return f"  whole model: {decision.backend} ({how}) for {decision.shape_class.removeprefix('model ')}"


def _explain_model(model: torch.nn.Module) -> str:
    encoders = fastbert_encoders(model)
    if not encoders:
        return f"{type(model).__name__}: no fastbert encoder inside"
    lines = []
    for name, encoder in encoders:
        latest: dict = {}  # per (device, dtype, grad mode, request): the table of the newest generation
        for key, table in _own_tables(encoder).items():
            if table.chosen and (key[:-1] not in latest or latest[key[:-1]][0][-1] < key[-1]):
                latest[key[:-1]] = (key, table)
        current = list(latest.values())
        whole = encoder.__dict__.get("_model_decisions", {})
        if not current and not whole:
            lines.append(f"{name} (backend {encoder.backend!r}): has not run yet; each op is resolved on its first "
                         f"call (loaded: {describe_available()})")
        elif not current:
            lines.append(f"{name} (backend {encoder.backend!r}): each forward runs one backend for the whole model "
                         f"(no per-op table; loaded: {describe_available()})")
        for (device, dtype, grad, training, requested, _), table in current:
            lines.extend(_table_lines(name, device, dtype, grad, training, requested, table))
        lines.extend(_model_line(d) for d in whole.values())
    return "\n".join(lines)


def _table_lines(name: str, device, dtype, grad: bool, training: bool, requested, table: OpTable) -> list[str]:
    """One line per table (each op's backend), then one per measured choice (its shape class and times) and one per
    op `PACKED_BF16` decided."""
    ops = ", ".join(f"{op} {chosen}" for op, chosen in table.chosen.items())
    mode = ("grad" if grad else "no grad") + (", training" if training else "")
    static = requested_backend(requested) == "auto" and not table.measure
    lines = [f"{name} (backend {requested!r}) on {device} {str(dtype).removeprefix('torch.')} {mode}: {ops}"
             + (" (static order: measuring off)" if static else "")]
    for op, by_class in table.decisions.items():
        for shape_class, decision in by_class.items():
            if decision.times_ms:
                lines.append(f"  {op}: {decision.backend} ({decision.describe()}) for "
                             f"{shape_class.removeprefix(op.split()[0] + ' ')}")
            elif PACKED_BF16_HOW in decision.how:
                untimed = ", ".join(decision.skipped) or "none"
                lines.append(f"  {op}: {decision.backend} ({decision.how}; not timed: {untimed})")
    return lines
