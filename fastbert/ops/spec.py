"""The op registry: one `OpSpec` per fused op, declared once in its own file under `fastbert/ops/`.

A spec holds everything about an op that does not depend on a backend: the schema and fake (shapes and dtypes of
the result) of its registered torch op, the argument checks, the eager (pure PyTorch, differentiable)
implementation, the fp32 reference the tests hold every backend to, and its cost formula. Backends attach an
implementation and a ``supports`` check by name (`fastbert.backends.register`); a backend whose kernel is a torch
op gets it from `OpSpec.define` with its prefix (``torch.ops.fastbert.cpp_<op>`` from `fastbert.backends.cpp`,
``triton_<op>`` from `fastbert.backends.triton`'s kernel modules), so the schema and the fake exist once whatever
the number of backends. An op's backward (``setup_context`` and ``backward``, the `torch.library.register_autograd`
contract, in PyTorch ops) is written once in its spec too, and `OpSpec.define` attaches it to every torch op it
defines: each backend's kernel is then differentiable.

``SPECS`` is the list of ops: everything that enumerates ops (tests, benchmarks, CLI reports) reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fastbert import backends

NAMESPACE = "fastbert"
SPECS: dict[str, OpSpec] = {}
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_DEFINED: dict[str, object] = {}


@dataclass(frozen=True)
class OpCost:
    """Work of one op call: floating point operations (a multiply-add counts 2) and bytes read plus written."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class OpSpec:
    """One fused op. ``schema`` is the argument list and result of its torch op (``"(Tensor x, ...) -> Tensor"``;
    None for an op no backend registers as a torch op); ``fake`` computes that op's result shape on meta/fake
    tensors; ``check`` raises ValueError/TypeError for bad arguments of the functional entry; ``eager`` is the
    PyTorch implementation (it has autograd) and ``reference`` the fp32 computation tests compare every backend
    with; ``cost`` gives its `OpCost` (FLOPs, bytes moved) for given sizes, the formula the benchmarks use (its
    arguments are in the op's file).

    ``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)`` are the torch op's autograd formula (the
    contract of `torch.library.register_autograd`: ``inputs`` are the schema's arguments, ``output`` its result,
    ``backward`` returns one gradient per argument, None for non-tensors, integer tensors, None optionals and
    inputs that need none). They work on the torch op's result (the packed [..., 3H] buffer for the QKV ops), in
    PyTorch ops, recomputing from saved inputs what they need. None: the op has no backward outside eager."""

    name: str
    check: Callable[..., None]
    eager: Callable
    reference: Callable
    cost: Callable | None = None
    schema: str | None = None
    fake: Callable | None = None
    setup_context: Callable | None = None
    backward: Callable | None = None

    @property
    def has_backward(self) -> bool:
        """Whether the torch ops `define` registers are differentiable (the spec has a backward formula)."""
        return self.backward is not None

    def define(self, prefix: str, impl: Callable | None = None, setup_context: Callable | None = None,
               backward: Callable | None = None):
        """Register the torch op ``fastbert::<prefix><name>`` (``prefix``: the backend's, ``"cpp_"`` or
        ``"triton_"``) from this spec's schema and fake, with ``impl`` for every device (a compiled extension
        registers its own kernels instead: ``impl=None``), and the spec's backward as its autograd formula when it
        has one. A backend with its own backward kernels passes ``setup_context`` and ``backward`` (same contract)
        to use them instead of the spec's. Returns the op."""
        if self.schema is None or self.fake is None:
            raise ValueError(f"op {self.name} declares no torch op schema")
        name = prefix + self.name
        if name in _DEFINED:  # a backend module imported a second time under another name (`kernels` as a
            return _DEFINED[name]  # top-level package when the repository root is on sys.path): keep the first
        _LIBRARY.define(name + self.schema)
        torch.library.register_fake(f"{NAMESPACE}::{name}", self.fake, lib=_LIBRARY)
        if impl is not None:
            _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
        if backward is None:
            backward, setup_context = self.backward, self.setup_context
        if backward is not None:
            torch.library.register_autograd(f"{NAMESPACE}::{name}", first_order_only(name, backward),
                                            setup_context=setup_context, lib=_LIBRARY)
        _DEFINED[name] = getattr(getattr(torch.ops, NAMESPACE), name)
        return _DEFINED[name]


class _NoSecondDerivative(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them raises (`first_order_only`)."""

    @staticmethod
    def forward(ctx, op_name: str, anchor: torch.Tensor, *grads: torch.Tensor):
        ctx.op_name = op_name
        return tuple(grad.view_as(grad) for grad in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(f"fastbert::{ctx.op_name} has no second derivative: a gradient of a gradient (autograd.grad "
                           "or backward with create_graph=True, as a gradient penalty takes) through a model "
                           "`fastbert.optimize` sped up is not supported; run that model without fastbert (with "
                           "attn_implementation='eager': PyTorch's own SDPA kernels have none either)")


def first_order_only(name: str, backward: Callable) -> Callable:
    """``backward`` for a torch op's `register_autograd`, whose gradients, when the backward runs with
    create_graph=True, raise on being differentiated: the backends' backward kernels are torch ops without an
    autograd formula, so their results would otherwise count as constants there and a second derivative would
    silently lack their part (what `torch.autograd.function.once_differentiable` does for a Function)."""

    def guarded(ctx, *grads):
        if not torch.is_grad_enabled():
            return backward(ctx, *grads)
        with torch.no_grad():
            result = backward(ctx, *grads)
        single = isinstance(result, torch.Tensor)
        results = (result,) if single else tuple(result)
        tensors = [i for i, r in enumerate(results) if isinstance(r, torch.Tensor)]
        if not tensors:
            return result
        anchor = torch.zeros((), device=results[tensors[0]].device, requires_grad=True)
        marked = _NoSecondDerivative.apply(name, anchor, *(results[i] for i in tensors))
        results = list(results)
        for i, grad in zip(tensors, marked, strict=True):
            results[i] = grad
        return results[0] if single else tuple(results)

    return guarded


def declare(spec: OpSpec) -> OpSpec:
    """Add an op to the registry; its eager implementation is the ``eager`` backend's."""
    if spec.name in SPECS:
        raise ValueError(f"op {spec.name} is declared twice")
    SPECS[spec.name] = spec
    backends.register(spec.name, "eager", spec.eager, has_backward=True)
    if spec.schema is not None:
        schema = torch._C.parse_schema(f"{NAMESPACE}::{spec.name}{spec.schema}")
        names = [argument.name for argument in schema.arguments]
        if "dropout_p" in names:
            backends.DROPOUT_ARGUMENT[spec.name] = names.index("dropout_p")
    return spec
