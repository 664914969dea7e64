"""One dispatch for every fused op: backends ``eager`` | ``triton`` | ``cpp`` | ``vendor``.

Each backend registers, per op, an implementation and a ``supports`` check that returns ``None`` when it can run
the given inputs and otherwise the reason it cannot. ``backend="auto"`` walks the preference list for the inputs'
device and takes the first backend whose check passes; a forced backend whose check fails raises
:class:`BackendUnavailable` carrying that reason. The env var ``FASTBERT_BACKEND`` forces a backend wherever
``"auto"`` was asked for; it is read once, when fastbert is imported (`read_environment` reads it again).

`dispatch` chooses at every call (the functional entries in `fastbert.ops` use it); a model resolves an
`OpTable` once per (device, dtype, grad mode, backend request) and calls the implementations directly.

Layout: this module is the dispatcher; each backend other than ``eager`` is a module of this package,
`fastbert.backends.cpp` (the C++ extension ``fastbert._C``) and `fastbert.backends.triton` (the Triton kernels of
``fastbert.kernels``), which registers its implementations when imported and says what it runs on with
``describe()``. A backend whose kernels are torch ops names them ``torch.ops.fastbert.<backend>_<op>``
(``cpp_attention``, ``triton_attention``), declared from the op's spec (`fastbert.ops.spec.OpSpec.define`); the
``eager`` implementations are the specs' own (`fastbert.ops`).

Those modules are loaded lazily on first use (importing triton costs about a second), so ``import fastbert`` stays
cheap; a backend that fails to load is remembered with the reason.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BACKENDS = ("eager", "triton", "cpp", "vendor")
# Preference of `auto` by device type. Triton on CPU only runs under TRITON_INTERPRET=1, which is far too slow to
# be picked automatically, so `auto` never takes it for CPU tensors.
AUTO_ORDER = {"cuda": ("triton", "vendor", "eager"), "cpu": ("cpp", "eager")}
# Under autograd (grad mode on and an input that requires grad). The cpp backward of most ops is the spec's formula
# in PyTorch ops, recomputing from saved inputs: `benchmarks/train_step_cpu.py` (4 layers, H 256, one thread, 2-core
# VM) measured a step at 288 ms through cpp vs 220 ms through eager, so `auto` trains those through eager on CPU;
# backend="cpp" still trains through cpp.
AUTO_ORDER_AUTOGRAD = {"cuda": ("triton", "vendor", "eager"), "cpu": ("eager",)}
# Per-op exceptions to AUTO_ORDER_AUTOGRAD: op -> {device type: order}. Attention on CPU trains through cpp, whose
# forward and backward are C++ kernels that follow each sequence's real length (eager pads the packed batch to the
# longest sequence for SDPA and its autograd); measured with `benchmarks/train_step_cpu.py` (README, Backends).
AUTO_ORDER_AUTOGRAD_BY_OP = {"attention": {"cpu": ("cpp", "eager")}}
_BACKEND_MODULES = {"triton": "fastbert.backends.triton", "cpp": "fastbert.backends.cpp",
                    "vendor": "fastbert.backends.vendor"}


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
    """(Re-)read ``FASTBERT_BACKEND``. It is read once, when fastbert is imported; a process that changes it later
    calls this (op tables resolved before are dropped)."""
    global _ENV_BACKEND
    _ENV_BACKEND = os.environ.get("FASTBERT_BACKEND", "auto") or "auto"
    _bump()


def _bump() -> None:
    global _GENERATION
    _GENERATION += 1


def generation() -> int:
    """Changes whenever something an `OpTable` resolved depends on changes (environment, registrations,
    observers): models key their tables on it."""
    return _GENERATION


def requested_backend(backend: str | None) -> str:
    """Resolve the user's request: an explicit backend wins, ``auto``/None defers to ``FASTBERT_BACKEND``."""
    if backend in (None, "auto"):
        backend = _ENV_BACKEND
    if backend != "auto" and backend not in BACKENDS:
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
    if not impl.has_backward and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return f"{backend} backend has no backward for {op} and an input requires grad"
    if backend != "eager" and torch.compiler.is_compiling() and _dropout_p(op, args, kwargs) > 0:
        return (f"under torch.compile dropout draws from torch's traced RNG, which only the eager {op} uses (this "
                "backend's kernel would take a seed fixed when the graph was traced)")
    return impl.supports(*args, **kwargs)


def _dropout_p(op: str, args: tuple, kwargs: dict) -> float:
    """The ``dropout_p`` of a call of ``op`` (0 for an op without dropout)."""
    index = DROPOUT_ARGUMENT.get(op)
    if index is None:
        return 0.0
    return kwargs["dropout_p"] if "dropout_p" in kwargs else args[index] if len(args) > index else 0.0


def preload(backend: str | None, device_type: str) -> None:
    """Load, now, every backend that `choose` may try for ``backend`` on ``device_type`` (without warning: an op
    that wants a backend that failed to load warns then). Called before torch.compile traces a model: an import
    inside a compiled region breaks the graph."""
    backend = requested_backend(backend)
    if backend != "auto":
        candidates = {backend}
    else:
        candidates = {*AUTO_ORDER.get(device_type, ()), *AUTO_ORDER_AUTOGRAD.get(device_type, ())}
        candidates.update(*(orders.get(device_type, ()) for orders in AUTO_ORDER_AUTOGRAD_BY_OP.values()))
    for name in sorted(candidates - _LOADED - set(_LOAD_ERRORS)):
        _load(name, warn=False)


def autograd_order(op: str, device_type: str) -> tuple[str, ...]:
    """The backends `auto` tries, in order, for ``op`` under autograd on ``device_type`` (eager comes last anyway)."""
    return AUTO_ORDER_AUTOGRAD_BY_OP.get(op, {}).get(device_type, AUTO_ORDER_AUTOGRAD.get(device_type, ()))


def choose(op: str, backend: str | None, *args, **kwargs) -> tuple[str, dict[str, str]]:
    """Pick the backend for ``op``: returns (backend, {skipped backend: reason})."""
    backend = requested_backend(backend)
    if backend != "auto":
        reason = why_not(op, backend, *args, **kwargs)
        if reason:
            raise BackendUnavailable(f"fastbert.ops.{op}: backend {backend!r} cannot run these inputs: {reason}")
        return backend, {}
    tensors = _tensors(args, kwargs)
    device_type = tensors[0].device.type if tensors else "cpu"
    skipped: dict[str, str] = {}
    order = AUTO_ORDER.get(device_type, ())
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        order = autograd_order(op, device_type)
        for preferred in AUTO_ORDER.get(device_type, ()):
            if preferred not in order:
                skipped[preferred] = ("auto trains through eager here: this backend's backward recomputes with "
                                      "PyTorch ops and is slower than eager's autograd (force it with backend=)")
    for candidate in order + ("eager",):
        reason = why_not(op, candidate, *args, **kwargs)
        if reason is None:
            return candidate, skipped
        skipped[candidate] = reason
    raise BackendUnavailable(f"fastbert.ops.{op}: no backend can run these inputs: {skipped}")


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
    (device, dtype, grad mode, backend request). An op is resolved on its first call, by `choose` on that call's
    arguments (``supports`` sees real tensors); later calls skip the choice and the argument checks, which the
    model's fixed shapes make redundant. Attribute per op: ``table.attention(q, k, v, cu_seqlens, max_seqlen,
    key_padding_mask, scale)`` takes the arguments `dispatch` passes to the implementations. A ``training`` table
    resolves an op with a dropout argument twice, for calls with and without dropout (its sites differ in p)."""

    def __init__(self, backend: str | None, training: bool = False):
        self.backend = backend
        self.training = training
        self.chosen: dict[str, str] = {}

    def __getattr__(self, op: str):
        if op.startswith("_") or op not in _REGISTRY:
            raise AttributeError(op)
        if self.training and op in DROPOUT_ARGUMENT:
            return self._by_dropout(op)

        def first_call(*args, **kwargs):
            chosen, _ = choose(op, self.backend, *args, **kwargs)
            fn = _REGISTRY[op][chosen].fn
            if _OBSERVERS:
                fn = _observed(op, chosen, fn)
            self.chosen[op] = chosen
            setattr(self, op, fn)
            return fn(*args, **kwargs)

        return first_call

    def _by_dropout(self, op: str):
        index = DROPOUT_ARGUMENT[op]
        resolved: dict[bool, Callable] = {}

        def call(*args, **kwargs):
            dropout = (kwargs["dropout_p"] if "dropout_p" in kwargs else args[index] if len(args) > index else 0) > 0
            fn = resolved.get(dropout)
            if fn is None:
                chosen, _ = choose(op, self.backend, *args, **kwargs)
                fn = resolved[dropout] = _REGISTRY[op][chosen].fn
                if _OBSERVERS:
                    fn = resolved[dropout] = _observed(op, chosen, fn)
                self.chosen[op + (" (dropout)" if dropout else "")] = chosen
            return fn(*args, **kwargs)

        setattr(self, op, call)
        return call


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
    """A one-line human answer: which backend runs ``op`` on these inputs and why the others were not used.

    ``explain(model)`` (a fastbert model, or a model `fastbert.optimize` changed) needs no op arguments: which
    backend each op of that model ran on, per (device, dtype, grad mode) it has run with."""
    if isinstance(op, torch.nn.Module):
        return _explain_model(op)
    chosen, skipped = choose(op, backend, *args, **kwargs)
    others = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
    return f"{op}: {chosen}" + (f" (not used: {others})" if others else "")


def available() -> dict[str, str | None]:
    """Each backend and the reason it failed to load (None when it loaded)."""
    return {name: _load(name, warn=False) for name in BACKENDS}


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


def _explain_model(model: torch.nn.Module) -> str:
    encoders = []
    for module in model.modules():
        if "_op_tables" in module.__dict__ or type(module).__name__ == "FastBertModel":
            encoders.append((type(module).__name__, module))
        state = module.__dict__.get("_fastbert")  # fastbert.optimize's state on a transformers base model
        build = getattr(state, "build", None)
        if build is not None and build.fast is not None:
            encoders.append((f"{type(module).__name__} (fastbert.optimize)", build.fast))
    if not encoders:
        return f"{type(model).__name__}: no fastbert encoder inside"
    lines = []
    for name, encoder in encoders:
        latest: dict = {}  # per (device, dtype, grad mode, request): the table of the newest generation
        for key, table in encoder.__dict__.get("_op_tables", {}).items():
            if table.chosen and (key[:-1] not in latest or latest[key[:-1]][0][-1] < key[-1]):
                latest[key[:-1]] = (key, table)
        current = list(latest.values())
        if not current:
            lines.append(f"{name} (backend {encoder.backend!r}): has not run yet; each op is resolved on its first "
                         f"call (loaded: {describe_available()})")
        for (device, dtype, grad, training, requested, _), table in current:
            ops = ", ".join(f"{op} {chosen}" for op, chosen in table.chosen.items())
            mode = ("grad" if grad else "no grad") + (", training" if training else "")
            lines.append(f"{name} (backend {requested!r}) on {device} {str(dtype).removeprefix('torch.')} {mode}: "
                         f"{ops}")
    return "\n".join(lines)
