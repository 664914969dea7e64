"""Shared pieces of the triton backend: where it can run, dtype checks, the meta-parameter policy, the cached
launcher every kernel is launched through (`launch`), the tiles of 2-D and row grids (`tile_offsets`, `row_tile`),
and the pieces of the backward and dropout kernels (the Philox keep mask, LayerNorm's backward on a tile, the second
stage of the two-stage fp32 reductions, the backward launchers' torch ops).

Triton kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter. Whether the interpreter is on
is decided by triton when a kernel is decorated (``TRITON_INTERPRET=1`` must be in the environment before
`fastbert.kernels` is imported), so it is read once here from a decorated probe kernel, not from the environment.
"""

from __future__ import annotations

import functools
import inspect
import operator
import os
import re
import warnings
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from fastbert.ops.dropout import keep_scale


@triton.jit
def _probe_kernel(ptr):
    tl.store(ptr, 0)


INTERPRETER: bool = type(_probe_kernel).__name__ == "InterpretedFunction"
"""True when triton runs kernels in its interpreter. For bf16 inputs the kernels then cast `tl.dot` operands to fp32
first (flag DOT_IN_FP32): the interpreter multiplies bf16 operands as raw integer bits (wrong by ~1e10, triton 3.9).
Products of bf16 values are exact in fp32, so results equal an fp32-accumulated GPU dot up to summation order.
fp16 operands go to `tl.dot` unmodified, as on a GPU: the interpreter's fp16 dot is right, so every fp16 test runs
the dot path the GPU runs."""


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the kernels must widen `tl.dot` operands of this dtype (the interpreter's bf16 dot is wrong)."""
    return INTERPRETER and dtype == torch.bfloat16

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreter_index_fix() -> bool:
    """Loops over a runtime length (``range(0, K, BLOCK_K)``) call ``int()`` on the interpreter's scalar, a 1-element
    1-d numpy array; numpy >= 2.4 refuses that ("only 0-dimensional arrays can be converted to Python scalars").
    triton >= 3.7 squeezes first; on older ones (3.6) the interpreter's patch of ``tl.tensor.__index__`` is wrapped
    to do the same. Interpreter only: compiled kernels never see this. Returns whether the wrapper was installed."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_fastbert_index_fix", False):
        return False

    def patch_lang_tensor(tensor, scope, *args, **kwargs):
        result = original(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        return result

    patch_lang_tensor._fastbert_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True


if INTERPRETER:
    _interpreter_index_fix()

_INTERPRETED = tl.constexpr(INTERPRETER)


@triton.jit
def tile_offsets(rows, cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of program (program_id(0), program_id(1)) of a 2-D grid over [rows, cols]: (int64
    row offsets, int64 column offsets, column mask, mask of its real elements)."""
    offs_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < cols
    return offs_m, offs_n, n_mask, (offs_m < rows)[:, None] & n_mask[None, :]


@triton.jit
def row_tile(rows, width, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The ROWS whole rows of program program_id(0) of a row kernel over [rows, width] (BLOCK >= width): (int64 row
    offsets, column offsets, column mask, mask of its real elements)."""
    offs_r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.arange(0, BLOCK)
    col_mask = offs_c < width
    return offs_r, offs_c, col_mask, (offs_r < rows)[:, None] & col_mask[None, :]


@triton.jit
def layernorm_tile(x, mask, offs_col, col_mask, weight_ptr, bias_ptr, width, eps, HAS_BIAS: tl.constexpr):
    """LayerNorm of each row of an fp32 tile x [ROWS, BLOCK] (``mask``: real elements; padding columns may hold
    anything), statistics in fp32; returns the normalised, scaled and (when HAS_BIAS) shifted fp32 tile."""
    mean = tl.sum(tl.where(mask, x, 0.0), axis=1) / width
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / width + eps)
    weight = tl.load(weight_ptr + offs_col, mask=col_mask, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * weight[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_col, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """x.to(dtype) rounded to nearest even. A GPU cast already rounds so; the interpreter (triton 3.9) truncates
    fp32 -> bf16, which would double bf16 errors, so there the rounding is done on the bits first."""
    if _INTERPRETED:  # nested constexpr ifs: compile-time on every triton version
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


def device_reason(tensors: list[torch.Tensor | None]) -> str | None:
    """Why these tensors cannot be handed to a triton kernel (device and dtype agreement), or None."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) > 1:
        return f"tensors are on different devices {sorted(str(d) for d in devices)}"
    device = next(iter(devices))
    if device.type == "cpu":
        if not INTERPRETER:
            return ("tensors are on cpu and TRITON_INTERPRET is not set (Triton runs on a CPU only in its interpreter: "
                    "TRITON_INTERPRET=1 in the environment, e.g. TRITON_INTERPRET=1 fastbert ...)")
    elif device.type != "cuda":
        return f"tensors are on {device.type}; the triton backend runs on cuda (or cpu under TRITON_INTERPRET=1)"
    return None


def float_reason(tensors: list[torch.Tensor | None]) -> str | None:
    """Why these floating tensors are not one dtype the kernels take (fp16, bf16, fp32), or None."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) > 1:
        return f"mixed dtypes {sorted(str(d).removeprefix('torch.') for d in dtypes)}"
    dtype = next(iter(dtypes))
    if dtype not in FLOAT_DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')} (the triton backend takes float16, bfloat16, float32)"
    return None


def first_reason(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r), None)


def tl_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in full precision (not TF32) so the fp32 path matches PyTorch to ~1e-5."""
    return "ieee" if dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. triton.cdiv and triton.next_power_of_2 are ConstexprFunctions since triton 3.6,
    whose calls unwrap their arguments first (~1-2 µs each on a GPU host, against ~0.05 µs here); the launchers
    call them a few hundred times per BERT-base forward, so host code uses these."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for host ints (as triton.next_power_of_2: 0 for 0; see `cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


MAX_WIDTH = 65536
"""The widest row the LayerNorm-style kernels take: a row must fit one block (`row_block`)."""


def row_block(width: int) -> int:
    """Power-of-two block covering a whole row of ``width`` elements (LayerNorm needs the full row)."""
    return next_power_of_2(width)


def rows_per_program(width: int) -> int:
    """Rows one LayerNorm-style program handles: several under the interpreter (per-program overhead dominates
    there), one row per program on a GPU for wide rows, a few for narrow ones."""
    if INTERPRETER:
        return 16
    return max(1, min(16, 4096 // row_block(width)))


def backward_rows_per_program(width: int) -> int:
    """Rows per tile of the LayerNorm backward kernels: half the forward's on a GPU (they hold ~6 fp32 tiles, the
    forward ~3), the forward's under the interpreter."""
    return rows_per_program(width) if INTERPRETER else max(1, rows_per_program(width) // 2)


def backward_row_warps(width: int, rows: int) -> int:
    """Warps for a LayerNorm backward program of ``rows`` x row_block(width): ~16 values per thread and tile (it
    keeps about twice the forward's tiles live; at the forward's ~32 the sm_90 build spills)."""
    elements = rows * row_block(width)
    return max(1, min(8, elements // 512))


def row_warps(width: int, rows: int = 1) -> int:
    """Warps for a program holding ``rows`` x row_block(width) fp32 values: ~32 values per thread and tensor."""
    elements = rows * row_block(width)
    return max(1, min(8, elements // 1024))


# ------------------------------------------------------------------------------------- dropout and backward pieces
DROPOUT_MAX_ELEMENTS = 1 << 31
"""Dropout masks are Philox draws at each element's flat index as an int32 counter (the fast 32-bit Philox on a
GPU), so a tensor with dropout holds fewer than 2**31 elements; `dropout_reason` says so past that."""


def dropout_reason(dropout_p: float, elements: int) -> str | None:
    """Why a kernel cannot apply dropout over ``elements`` elements, or None."""
    if dropout_p > 0 and elements >= DROPOUT_MAX_ELEMENTS:
        return f"dropout over {elements} elements (the kernels' Philox offsets are int32: fewer than 2**31)"
    return None


def dropout_args(dropout_p: float, dropout_seed: int) -> tuple[int, float, float]:
    """The (seed, dropout_p, keep_scale) kernel arguments the dropout kernels take; seed 0 and scale 1 without
    dropout (the kernels ignore them then)."""
    dropout = dropout_p > 0
    return int(dropout_seed) if dropout else 0, float(dropout_p), keep_scale(dropout_p) if dropout else 1.0


@triton.jit
def dropout_keep(seed, offsets, dropout_p):
    """True where the element of flat index ``offsets`` (row * width + column of the tensor dropout acts on) is
    kept: Philox's uniform draw for (seed, offset) is >= dropout_p. A function of (seed, offset) only, so a
    forward and its backward draw the same mask whatever their tiling."""
    return tl.rand(seed, offsets.to(tl.int32)) >= dropout_p


@triton.jit
def layernorm_backward_tile(x, grad, mask, weight, width, eps):
    """LayerNorm's backward on fp32 tiles [ROWS, BLOCK]: x the LayerNorm's input, grad dL/d(output), ``mask`` the
    real elements, weight [BLOCK] its scale (0 past the width). The statistics are recomputed from x (two row
    reductions over a tile already in registers: cheaper than storing and reloading them). Returns (dL/dx, x_hat):
    x_hat = (x - mean) * rstd, for the weight's gradient sum(grad * x_hat); both 0 outside ``mask``."""
    mean = tl.sum(tl.where(mask, x, 0.0), axis=1) / width
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / width + eps)
    x_hat = centred * rstd[:, None]
    scaled = tl.where(mask, grad * weight[None, :], 0.0)
    mean_scaled = tl.sum(scaled, axis=1) / width
    mean_scaled_x_hat = tl.sum(scaled * x_hat, axis=1) / width
    grad_x = (scaled - mean_scaled[:, None] - x_hat * mean_scaled_x_hat[:, None]) * rstd[:, None]
    return tl.where(mask, grad_x, 0.0), x_hat


@triton.jit
def _column_sum_kernel(
    partial_ptr,  # [parts, N] fp32 partial column sums, contiguous
    out_ptr,  # [N] the column sums, in the output's dtype
    parts, N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, parts, BLOCK_P):
        p_mask = offs_p < parts - start
        acc += tl.sum(tl.load(partial_ptr + (start + offs_p).to(tl.int64)[:, None] * N + offs_n[None, :],
                              mask=p_mask[:, None] & n_mask[None, :], other=0.0), axis=0)
    tl.store(out_ptr + offs_n, cast_rtne(acc, out_ptr.dtype.element_ty), mask=n_mask)


def column_sum(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The second stage of a two-stage fp32 reduction: partial [parts, N] fp32 (one row per program of the first
    stage) summed over its rows in fp32 -> [N] in ``dtype`` (one rounding)."""
    parts, width = partial.shape
    out = torch.empty(width, dtype=dtype, device=partial.device)
    if width == 0:
        return out
    block_n = 256 if INTERPRETER else 64
    launch(_column_sum_kernel, (cdiv(width, block_n),), partial, out, parts, width, BLOCK_P=32,
           BLOCK_N=block_n, num_warps=4)
    return out


@functools.cache
def sm_count(device: torch.device) -> int:
    """The CUDA device's streaming multiprocessors (programs that run at once, one per SM, at the least)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def reduction_programs(tiles: int, device: torch.device) -> int:
    """Programs of a backward row kernel whose weight gradients are reduced in two stages: each program loops over
    row tiles (pid, pid + programs, ...) accumulating per-column fp32 partial sums, so the partial buffer is
    [programs, N]. A few waves of the GPU's SMs (enough to fill it, few enough that the second stage is small);
    4 under the interpreter (whose cost is per program step, not per program)."""
    if INTERPRETER or device.type != "cuda":
        return max(1, min(tiles, 4))
    return max(1, min(tiles, 4 * sm_count(device)))


def define_kernel_op(name: str, schema: str, impl, fake):
    """Register the torch op ``fastbert::<name>`` (``schema``: its arguments and results) running ``impl``, with
    ``fake`` for meta/fake tensors, and return it. The backward formulas call their Triton launchers through such
    ops so that AOTAutograd and torch.compile trace a backward instead of running kernels on fake tensors. A second
    import of a kernels module (as top-level `kernels` when the repository root is on sys.path) keeps the first."""
    if not hasattr(torch.ops.fastbert, name):
        op = torch.library.custom_op(f"fastbert::{name}", impl, mutates_args=(), schema=schema)
        op.register_fake(fake)
    return getattr(torch.ops.fastbert, name)


# ------------------------------------------------------------------------------------------------ cached launches
def env_flag(name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """An on/off environment variable: unset or anything else is on; 0, false, no or off (any case) is off."""
    return environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def cached_launch_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """FASTBERT_CACHED_LAUNCH: unset or 1 replays compiled kernels; 0 (false, no, off) launches through triton."""
    return env_flag("FASTBERT_CACHED_LAUNCH", environ)


CACHED_LAUNCH: bool = cached_launch_enabled()
"""Whether `launch` replays compiled kernels (FASTBERT_CACHED_LAUNCH=0: every launch goes through triton's own
``kernel[grid](...)``). Read at import."""

# The launch `launch` replays: what JITFunction.run does with the kernel it compiled or found (triton 3.6 and 3.9
# alike: the compiled kernel's run(grid, stream, function, packed metadata, launch metadata, hooks, *all arguments
# in parameter order, constexprs included)).
_TRITON_LAUNCH = re.compile(
    r"kernel\.run\(\s*grid_0,\s*grid_1,\s*grid_2,\s*stream,\s*kernel\.function,\s*kernel\.packed_metadata,\s*"
    r"launch_metadata,\s*knobs\.runtime\.launch_enter_hook,\s*knobs\.runtime\.launch_exit_hook,\s*"
    r"\*bound_args\.values\(\)\s*\)")
_MAX_ENTRIES = 4096  # per kernel; past it new specialisations launch through triton (keys are bounded in practice)


def launch_layout_reason() -> str | None:
    """Why the installed triton does not launch the way `launch` replays (the call in JITFunction.run, the
    returned compiled kernel, the autotuner's best_config), or None when it does."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    try:
        run, tuner = inspect.getsource(JITFunction.run), inspect.getsource(Autotuner.run)
        compiled = inspect.getsource(CompiledKernel)
    except (OSError, TypeError) as err:
        return f"triton {triton.__version__}: its sources cannot be read ({err})"
    missing = [what for what, ok in (
        ("JITFunction.run launching kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, "
         "kernel.packed_metadata, launch_metadata, enter_hook, exit_hook, *bound_args.values())",
         _TRITON_LAUNCH.search(run)),
        ("JITFunction.run returning the compiled kernel", re.search(r"\n\s*return kernel\s*\n", run)),
        ("Autotuner.run setting self.best_config and launching config.all_kwargs()",
         "self.best_config = config" in tuner and "config.all_kwargs()" in tuner),
        ("CompiledKernel.packed_metadata and launch_metadata",
         "self.packed_metadata" in compiled and "def launch_metadata" in compiled)) if not ok]
    return f"triton {triton.__version__}: unknown launch layout, missing {'; '.join(missing)}" if missing else None


LAUNCH_LAYOUT_REASON: str | None = launch_layout_reason()
"""None when the installed triton launches as `launch` expects; checked at import on every machine (the tests
read it under the interpreter too)."""


def replays_launches(cached_launch: bool, interpreter: bool, layout_reason: str | None) -> bool:
    """Whether `launch` replays compiled kernels. Under the interpreter there is nothing compiled to replay. A triton
    whose launch layout is unknown (`launch_layout_reason`) still runs every kernel, through its own
    ``kernel[grid](...)`` (a few µs more host time per launch), and one warning line says so."""
    if not cached_launch or interpreter:
        return False
    if layout_reason is not None:
        warnings.warn(f"fastbert.kernels: {layout_reason}; every kernel launches through triton's own path "
                      "(correct, more host time per launch)", stacklevel=2)
        return False
    return True


_CACHING: bool = replays_launches(CACHED_LAUNCH, INTERPRETER, LAUNCH_LAYOUT_REASON)
_current_device = None  # triton's driver functions, bound on the first cached launch (a GPU is needed)
_current_stream = None
_UNSET = object()
_Tensor = torch.Tensor
_data_ptr = torch.Tensor.data_ptr
_dtype_of = operator.attrgetter("dtype")
_RUNTIME_KNOBS = triton.knobs.runtime  # the launch hooks (a profiler's) are read from it on every launch


class KernelInfo:
    """What `launch` needs about one kernel (a JITFunction or an Autotuner over one), computed once: the runtime
    parameters (all before the constexprs, so that a launch's arguments are its runtime arguments followed by a
    tail fixed per specialisation), the constexprs' defaults, the autotuner's key positions, and its entries: key
    -> (compiled kernel, constexpr tail, meta for the grid), or None for a specialisation launched through triton."""

    __slots__ = ("kernel", "runtime_names", "runtime_count", "constexprs", "tune_positions", "autotuner", "reason",
                 "entries", "types", "tensors", "ints", "fifteens", "ones")

    def __init__(self, kernel):
        self.kernel = kernel  # held: its id, the key of `_INFOS`, is not reused while it is there
        self.entries: dict = {}
        self.autotuner = getattr(kernel, "configs", None) is not None and hasattr(kernel, "keys")
        jit = kernel.fn if self.autotuner else kernel
        params = getattr(jit, "params", None)
        self.reason = None if params is not None else f"{type(jit).__name__} is not a JITFunction"
        params = params or []
        runtime = [p.name for p in params if not p.is_constexpr]
        constexprs = [p.name for p in params if p.is_constexpr]
        if runtime != [p.name for p in params[:len(runtime)]]:
            self.reason = "a constexpr parameter comes before a runtime one"
        defaults = {name: p.default for name, p in jit.signature.parameters.items()} if params else {}
        self.runtime_names, self.runtime_count = tuple(runtime), len(runtime)
        self.constexprs = tuple((name, defaults.get(name, inspect.Parameter.empty)) for name in constexprs)
        keys = list(kernel.keys) if self.autotuner else []
        self.tune_positions = tuple(runtime.index(k) for k in keys if k in runtime)
        self.types: tuple | None = None  # the runtime arguments' types at the first launch (`learn_types`)

    def learn_types(self, args: tuple) -> None:
        """Take the types of ``args`` as this kernel's: later launches with these types get `launch_key`'s fast
        key, computed by C-level loops (positions of the tensors and ints picked out once, here)."""
        types = tuple(map(type, args))
        if not all(issubclass(t, _Tensor) or t in (int, float, bool, type(None)) for t in types):
            types = ()  # matches no launch: every launch takes the per-argument key
        self.tensors = _picker([i for i, t in enumerate(types) if issubclass(t, _Tensor)])
        ints = [i for i, t in enumerate(types) if t is int]
        self.ints, self.fifteens, self.ones = _picker(ints), (15,) * len(ints), (1,) * len(ints)
        self.types = types  # last: a launch in another thread reads the pickers once the types match


def _picker(positions: list[int]):
    """args -> the tuple of args at ``positions`` (operator.itemgetter, which returns a bare item for one)."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return (lambda args: (args[positions[0]],)) if positions else (lambda args: ())


_INFOS: dict[int, KernelInfo] = {}  # by id: JITFunction's own hash is the hash of its source's cache key


def arg_key(arg) -> object:
    """What triton's specialisation of one runtime argument depends on, or finer: a tensor's dtype and 16-byte
    alignment; an int's being 1, its divisibility by 16 and whether it fits int32 / int64; the type of a float,
    bool or None. Raises TypeError for anything else (`launch` then leaves the call to triton)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    kind = type(arg)
    if kind is int:
        return arg == 1, not arg & 15, -0x80000000 <= arg <= 0x7FFFFFFF, arg <= 0x7FFFFFFFFFFFFFFF
    if kind is float or kind is bool or arg is None:
        return kind
    raise TypeError(f"no launch key for an argument of type {kind.__name__}")


def launch_key(info: KernelInfo, device, args: tuple, kwargs: dict) -> tuple:
    """The cache key of one launch: the device, the keyword arguments (constexprs and options such as num_warps,
    names then values), what triton's specialisation of each runtime argument depends on, and the values of the
    autotuner's key arguments. Fast key, when the arguments have the kernel's types (`KernelInfo.learn_types`),
    every tensor is 16-byte aligned and every int fits int32: the tensors' dtypes and each int's divisibility by 16
    and equality to 1, by C-level loops. Otherwise each argument's `arg_key` (the two kinds never compare equal)."""
    if tuple(map(type, args)) == info.types:
        tensors, ints = info.tensors(args), info.ints(args)
        if not functools.reduce(operator.or_, map(_data_ptr, tensors), 0) & 15 and (
                not ints or (min(ints) >= -0x80000000 and max(ints) <= 0x7FFFFFFF)):
            key = (device, True, len(kwargs), *kwargs, *kwargs.values(), *map(_dtype_of, tensors),
                   *map(operator.not_, map(operator.and_, ints, info.fifteens)), *map(operator.eq, ints, info.ones))
            return (*key, *[args[i] for i in info.tune_positions]) if info.tune_positions else key
    key = (device, False, len(kwargs), *kwargs, *kwargs.values(), *map(arg_key, args))
    return (*key, *[args[i] for i in info.tune_positions]) if info.tune_positions else key


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``. The first launch of a specialisation (`launch_key`) goes through triton
    (compiling or autotuning as it does) and keeps the compiled kernel; later ones launch it directly on the current
    stream, skipping triton's argument binding, cache-key string and launch-metadata building. Runtime arguments
    may be positional or by keyword, constexprs and options by keyword. ``grid`` is a tuple, or a callable that
    reads only constexprs and options from its argument. Plain triton launches under the interpreter, with
    FASTBERT_CACHED_LAUNCH=0 and for kernels or arguments the cache cannot key (`arg_key`)."""
    if not _CACHING:
        return kernel[grid](*args, **kwargs)
    info = _INFOS.get(id(kernel)) or _INFOS.setdefault(id(kernel), KernelInfo(kernel))
    if info.reason is not None:
        return kernel[grid](*args, **kwargs)
    if len(args) != info.runtime_count:
        positional = _as_positional(info, args, kwargs)
        if positional is None:
            return kernel[grid](*args, **kwargs)
        args, kwargs = positional
    device = _current_device() if _current_device is not None else _bind_driver()
    if info.types is None:
        info.learn_types(args)
    try:
        key = launch_key(info, device, args, kwargs)
        entry = info.entries.get(key, _UNSET)
    except TypeError:  # an argument without a key, or an unhashable keyword value
        return kernel[grid](*args, **kwargs)
    if entry is _UNSET:
        return _first_launch(info, kernel, key, grid, args, kwargs)
    if entry is None:
        return kernel[grid](*args, **kwargs)
    compiled, tail, meta = entry
    if callable(grid):
        grid = grid(meta)
    stream = _current_stream(device)
    enter, leave = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    if getattr(enter, "calls", enter) or getattr(leave, "calls", leave):  # a profiler's hooks: as triton does
        metadata = compiled.launch_metadata(grid, stream, *args, *tail)
    else:
        metadata = enter = leave = None
    size = len(grid)
    compiled.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, stream, compiled.function,
                 compiled.packed_metadata, metadata, enter, leave, *args, *tail)
    return compiled


def _as_positional(info: KernelInfo, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """(every runtime argument in parameter order, the other keywords) for a call that gives some runtime
    arguments by keyword; None when one is missing (a default) or a constexpr is positional."""
    names = info.runtime_names[len(args):]
    if len(args) > info.runtime_count or any(name not in kwargs for name in names):
        return None
    return (*args, *[kwargs[name] for name in names]), {k: v for k, v in kwargs.items() if k not in names}


def _bind_driver():
    """Bind triton's current-device and current-stream functions (its driver is set up by now); the device."""
    global _current_device, _current_stream
    from triton.runtime.driver import driver

    _current_device, _current_stream = driver.active.get_current_device, driver.active.get_current_stream
    return _current_device()


def _first_launch(info: KernelInfo, kernel, key: tuple, grid, args: tuple, kwargs: dict):
    """Launch through triton and keep what it compiled for ``key``, when the replay is known to be the same launch:
    a compiled kernel came back, the grid callable gives the same grid from the constexprs alone, and the chosen
    autotuner config has no pre-hook. Otherwise the key is kept as None (always triton's path)."""
    compiled = kernel[grid](*args, **kwargs)
    meta = dict(kwargs)
    if info.autotuner:
        config = kernel.best_config
        meta.update(config.all_kwargs())
        replayable = config.pre_hook is None
    else:
        replayable = True
    tail = tuple(meta.get(name, default) for name, default in info.constexprs)
    replayable = replayable and inspect.Parameter.empty not in tail and all(
        hasattr(compiled, name) for name in ("run", "function", "packed_metadata", "launch_metadata"))
    if replayable and callable(grid):
        try:
            names = (*info.runtime_names, *(name for name, _ in info.constexprs))
            bound = dict(zip(names, (*args, *tail), strict=True))
            replayable = tuple(grid(meta)) == tuple(grid({**meta, **bound}))
        except (KeyError, TypeError):
            replayable = False
    if len(info.entries) < _MAX_ENTRIES:
        info.entries[key] = (compiled, tail, meta) if replayable else None
    return compiled


def launch_cache_info() -> dict[str, dict]:
    """Per kernel launched through `launch`: its cached specialisations, those left to triton, and why the kernel
    is not cached at all (None: it is)."""
    out = {}
    for info in _INFOS.values():
        name = getattr(getattr(info.kernel, "fn", info.kernel), "__name__", repr(info.kernel))
        out[name] = {"cached": sum(e is not None for e in info.entries.values()),
                     "left_to_triton": sum(e is None for e in info.entries.values()), "reason": info.reason}
    return out
