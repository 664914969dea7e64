"""The cached launcher (`fastbert.kernels.common.launch`): its key refines triton's own specialisation, a replayed
launch passes the compiled kernel exactly the arguments triton's launch passes, autotuned kernels replay the config
the autotuner chose for their key, FASTBERT_CACHED_LAUNCH=0 launches through triton every time, and under the
interpreter (no compiled kernel to replay) `launch` is triton's own launch. The replay itself is checked against
triton's launch on CUDA in the `gpu` test at the end.

On CPU the replay path is driven with a JITFunction whose ``run`` binds its arguments as triton does
(`inspect.Signature.bind`, defaults applied) and returns a recording stand-in for the compiled kernel."""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fastbert import kernels  # noqa: F401 (registers the triton ops)
from fastbert.kernels import common

KERNEL_MODULES = ("attention", "common", "embedding_layernorm", "gemm", "linear_activation", "linear_glu",
                  "linear_residual_layernorm", "qkv_rotary")


def _toy(x_ptr, out_ptr, n, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):
    pass  # never compiled: only its signature is used


class Compiled:
    """Stands in for triton's CompiledKernel: records each replayed launch."""

    def __init__(self, bound: tuple):
        self.bound, self.calls = bound, []
        self.function, self.packed_metadata = object(), (4, 1, 0)

    def run(self, *call):
        self.calls.append(call)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}


class RecordingJIT(JITFunction):
    """A JITFunction whose run binds the arguments as triton does and returns a `Compiled` per specialisation."""

    def __init__(self, fn=_toy):
        super().__init__(fn)
        self.plain: list[tuple] = []

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in self.signature.parameters}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = tuple(bound.arguments.values())
        grid = grid(bound.arguments) if callable(grid) else grid
        self.plain.append((grid, values, options))
        return Compiled(values)


@pytest.fixture
def caching(monkeypatch):
    """The replay path switched on, on a pretend device 0 with stream 77."""
    monkeypatch.setattr(common, "_CACHING", True)
    monkeypatch.setattr(common, "_current_device", lambda: 0)
    monkeypatch.setattr(common, "_current_stream", lambda device: 77)


def tensor(dtype=torch.float16, offset=0, size=130):
    return torch.zeros(size + 8, dtype=dtype)[offset:offset + size]


# ------------------------------------------------------------------------------------------------ the key
def test_triton_launch_layout_is_known():
    assert common.LAUNCH_LAYOUT_REASON is None, common.LAUNCH_LAYOUT_REASON


def test_unknown_launch_layout_is_named(monkeypatch):
    real = inspect.getsource

    def planted(obj):
        return "def run(self):\n    return launch_differently()\n" if obj is JITFunction.run else real(obj)

    monkeypatch.setattr(inspect, "getsource", planted)
    reason = common.launch_layout_reason()
    assert reason is not None and "unknown launch layout" in reason and "JITFunction.run launching" in reason
    assert "Autotuner" not in reason and "CompiledKernel" not in reason


def test_unknown_launch_layout_launches_through_triton():
    with pytest.warns(UserWarning, match="through triton's own path"):
        assert common.replays_launches(True, False, "triton 9.9: unknown launch layout, missing x") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert common.replays_launches(True, False, None) is True
        assert common.replays_launches(True, True, "unknown") is False  # the interpreter: nothing to replay
        assert common.replays_launches(False, False, "unknown") is False


def test_unknown_launch_layout_at_import_keeps_the_triton_backend(tmp_path):
    """A triton release whose JITFunction.run launches differently: fastbert.kernels imports with the cached
    launcher off and one warning, and the triton backend still loads (it used to raise, which left CUDA to eager)."""
    script = tmp_path / "planted.py"
    script.write_text(
        "from triton.runtime.jit import JITFunction\n\n\n"
        "def run(self, *args, grid, warmup, **kwargs):\n"
        "    return self.launch_some_other_way(*args)\n\n\n"
        "JITFunction.run = run\n"
        "from fastbert.kernels import common\n"
        "from fastbert.backends import triton as backend\n"
        "print(common.INTERPRETER, common._CACHING, 'unknown launch layout' in common.LAUNCH_LAYOUT_REASON)\n")
    env = {**os.environ, "TRITON_INTERPRET": "0", "FASTBERT_CACHED_LAUNCH": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True"]
    assert "unknown launch layout" in done.stderr and "through triton's own path" in done.stderr


def _samples() -> list:
    ints = [0, 1, 2, 7, 15, 16, 17, 32, 768, 130, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
            -(2**31), -(2**31) - 1, -(2**31) - 16, 2**32, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16]
    tensors = [tensor(dtype, offset) for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32,
                                                   torch.int64) for offset in (0, 1, 2, 4, 8)]
    return ints + tensors + [0.5, 1.0, -3.0, True, False, None]


def _triton_specialisation(arg):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kind, attribute = native_specialize_impl(BaseBackend, arg, False, True, True)[:2]
    return kind, attribute


def test_arg_key_refines_triton_specialisation():
    """Arguments with one key have one triton specialisation: a cached kernel is never replayed for arguments
    triton would have compiled differently."""
    samples = _samples()
    for a in samples:
        for b in samples:
            if common.arg_key(a) == common.arg_key(b):
                assert _triton_specialisation(a) == _triton_specialisation(b), (a, b)


def _pair(x_ptr, n, BLOCK: tl.constexpr):
    pass


def test_launch_key_refines_triton_specialisation():
    """The same over launch keys, fast (the kernel's argument types, aligned tensors, int32 ints) and per argument:
    every group of argument pairs with one key has one triton specialisation."""
    info = common.KernelInfo(JITFunction(_pair))
    info.learn_types((tensor(), 7))
    tensors = [a for a in _samples() if isinstance(a, torch.Tensor)]
    others = [a for a in _samples() if not isinstance(a, torch.Tensor)]
    groups: dict = {}
    kinds = set()
    for x in tensors:
        for n in others:
            key = common.launch_key(info, 0, (x, n), {"BLOCK": 16})
            kinds.add(key[1])
            groups.setdefault(key, set()).add((_triton_specialisation(x), _triton_specialisation(n)))
    assert kinds == {True, False}  # both keys were exercised
    assert all(len(specialisations) == 1 for specialisations in groups.values())
    assert len(groups) >= 20


def test_arg_key_separates_dtypes_alignments_and_ints():
    key = common.arg_key
    assert key(tensor(torch.float16)) == key(tensor(torch.float16, 8))  # 16-byte aligned both
    assert key(tensor(torch.float16)) != key(tensor(torch.float16, 1))
    assert key(tensor(torch.float16)) != key(tensor(torch.bfloat16))
    assert key(tensor(torch.float32, 1)) == key(tensor(torch.float32, 2))  # both misaligned: one specialisation
    assert key(7) == key(130) != key(768) == key(16)
    assert key(1) != key(7)
    assert key(2**31) != key(2**31 - 16) and key(2**63) != key(2**63 - 16)
    assert key(0.5) == key(2.0) != key(True)
    with pytest.raises(TypeError):
        key("gelu")


def test_launch_key_names_constexprs_and_options():
    info = common.KernelInfo(RecordingJIT())
    args = (tensor(), tensor(), 130, 0.5, True)
    base = common.launch_key(info, 0, args, {"BLOCK": 16, "MODE": 2})
    assert base == common.launch_key(info, 0, (tensor(), tensor(), 7, 2.5, False), {"BLOCK": 16, "MODE": 2})
    assert base != common.launch_key(info, 0, args, {"BLOCK": 2, "MODE": 16})  # same values, other names
    assert base != common.launch_key(info, 0, args, {"BLOCK": 16, "MODE": 2, "num_warps": 8})
    assert base != common.launch_key(info, 1, args, {"BLOCK": 16, "MODE": 2})  # another device
    assert base != common.launch_key(info, 0, (tensor(), tensor(torch.float32), 130, 0.5, True),
                                     {"BLOCK": 16, "MODE": 2})


def _kernel_functions() -> list:
    found = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"fastbert.kernels.{name}")
        for attribute, value in vars(module).items():
            if attribute.endswith("_kernel") and hasattr(value, "fn") and not attribute.startswith("_probe"):
                found.append((f"{name}.{attribute}", value.fn))
    return found


def test_every_kernel_can_be_replayed():
    """Each kernel's runtime parameters come before its constexprs (what `launch` needs to replay it)."""
    functions = _kernel_functions()
    assert len(functions) >= 10
    for name, fn in functions:
        info = common.KernelInfo(JITFunction(fn))
        assert info.reason is None, f"{name}: {info.reason}"
        assert info.runtime_count > 0


# ------------------------------------------------------------------------------------------------ the replay
def _expected_call(compiled: Compiled, grid: tuple, bound: tuple) -> tuple:
    padded = (*grid, 1, 1)[:3]
    return (*padded, 77, compiled.function, compiled.packed_metadata, None, None, None, *bound)


def test_replay_passes_what_triton_binds(caching):
    kernel = RecordingJIT()
    x, out = tensor(), tensor()
    first = common.launch(kernel, (7,), x, out, 130, 0.5, True, BLOCK=64, num_warps=4)
    assert len(kernel.plain) == 1
    y, z = tensor(), tensor()
    again = common.launch(kernel, (9, 2), y, out_ptr=z, n=7, scale=1.5, flag=False, BLOCK=64, num_warps=4)
    assert again is first and len(kernel.plain) == 1  # replayed, runtime arguments by keyword included
    reference = RecordingJIT()
    reference.run(y, z, 7, 1.5, False, BLOCK=64, grid=(9, 2), warmup=False, num_warps=4)
    assert first.calls == [_expected_call(first, (9, 2), reference.plain[0][1])]
    assert first.calls[0][-2:] == (64, 3)  # the constexprs, MODE from its default


def test_new_specialisations_launch_through_triton(caching):
    kernel = RecordingJIT()
    args = (tensor(), tensor(), 130, 0.5, True)
    common.launch(kernel, (1,), *args, BLOCK=64)
    common.launch(kernel, (1,), tensor(offset=1), *args[1:], BLOCK=64)  # misaligned
    common.launch(kernel, (1,), tensor(torch.float32), *args[1:], BLOCK=64)
    common.launch(kernel, (1,), *args[:2], 128, *args[3:], BLOCK=64)  # n divisible by 16
    common.launch(kernel, (1,), *args, BLOCK=32)
    common.launch(kernel, (1,), *args, BLOCK=64, MODE=1)
    assert len(kernel.plain) == 6
    common.launch(kernel, (1,), tensor(offset=8), *args[1:], BLOCK=64)  # aligned again: the first's kernel
    assert len(kernel.plain) == 6
    assert common.launch_cache_info()["_toy"]["cached"] >= 6


def test_grid_callable_gets_the_constexprs(caching):
    kernel = RecordingJIT()
    args = (tensor(), tensor(), 130, 0.5, True)

    def grid(meta):
        return (triton.cdiv(130, meta["BLOCK"]),)

    compiled = common.launch(kernel, grid, *args, BLOCK=32)
    common.launch(kernel, grid, *args, BLOCK=32)
    assert kernel.plain[0][0] == (5,) and compiled.calls[0][:3] == (5, 1, 1)


def test_grid_reading_runtime_arguments_is_left_to_triton(caching):
    kernel = RecordingJIT()
    for n in (130, 7):
        common.launch(kernel, lambda meta: (meta["n"],), tensor(), tensor(), n, 0.5, True, BLOCK=32)
    assert [grid for grid, _, _ in kernel.plain] == [(130,), (7,)]  # both through triton, each its own grid


def test_uncacheable_calls_go_to_triton(caching):
    kernel = RecordingJIT()
    args = (tensor(), tensor(), 130, 0.5, True)
    for _ in range(2):
        common.launch(kernel, (1,), *args, 64)  # a constexpr by position
        common.launch(kernel, (1,), *args[:4], flag="yes", BLOCK=64)  # an argument without a key
    assert len(kernel.plain) == 4


def test_profiler_hooks_get_launch_metadata(caching, monkeypatch):
    kernel = RecordingJIT()
    args = (tensor(), tensor(), 130, 0.5, True)
    compiled = common.launch(kernel, (3,), *args, BLOCK=64)
    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", seen.append)
    common.launch(kernel, (3,), *args, BLOCK=64)
    call = compiled.calls[0]
    assert call[6] == {"grid": (3,)} and call[7] == seen.append


def test_autotuned_kernel_replays_the_chosen_config(caching):
    configs = [triton.Config({"BLOCK": 16}, num_warps=2), triton.Config({"BLOCK": 64}, num_warps=4)]
    tuner = triton.autotune(configs=configs, key=["n"])(RecordingJIT())
    tuner._bench = lambda *args, config, **kwargs: [float(abs(config.kwargs["BLOCK"] - args[2]))]
    x, out = tensor(), tensor()

    def grid(meta):
        return (triton.cdiv(1000, meta["BLOCK"]),)

    small = common.launch(tuner, grid, x, out, 16, 0.5, True)  # the autotuner picks BLOCK 16 for n = 16
    large = common.launch(tuner, grid, x, out, 64, 0.5, True)  # and 64 for n = 64 (same specialisation)
    assert large is not small
    common.launch(tuner, grid, x, out, 64, 0.5, True)
    common.launch(tuner, grid, x, out, 16, 0.5, True)
    assert large.calls[0][:3] == (16, 1, 1) and large.calls[0][-2:] == (64, 3)
    assert small.calls[0][:3] == (63, 1, 1) and small.calls[0][-2:] == (16, 3)


def test_switch_off_launches_through_triton_every_time(monkeypatch):
    monkeypatch.setattr(common, "_CACHING", False)
    kernel = RecordingJIT()
    for _ in range(3):
        common.launch(kernel, (1,), tensor(), tensor(), 130, 0.5, True, BLOCK=64)
    assert len(kernel.plain) == 3


@pytest.mark.parametrize("value, enabled", [("0", False), ("false", False), (" OFF", False), ("no", False),
                                            ("1", True), ("true", True), (None, True)])
def test_switch_values(value, enabled, monkeypatch):
    assert common.cached_launch_enabled({} if value is None else {"FASTBERT_CACHED_LAUNCH": value}) is enabled
    gemm = importlib.import_module("fastbert.kernels.gemm")  # every on/off variable reads the same way
    if value is None:
        monkeypatch.delenv("FASTBERT_TRITON_AUTOTUNE", raising=False)
    else:
        monkeypatch.setenv("FASTBERT_TRITON_AUTOTUNE", value)
    assert gemm.autotune_enabled() is enabled


def test_switch_is_read_at_import():
    env = {**os.environ, "FASTBERT_CACHED_LAUNCH": "0"}
    script = "from fastbert.kernels import common; print(common.CACHED_LAUNCH, common._CACHING)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# ------------------------------------------------------------------------------------- real kernels
@pytest.mark.skipif(not common.INTERPRETER, reason="the interpreter's path")
def test_interpreter_launch_is_triton_launch():
    assert common._CACHING is False
    partial = torch.randn(7, 130, generator=torch.Generator().manual_seed(3))
    via_launch = common.column_sum(partial, torch.float32)
    direct = torch.empty(130)
    common._column_sum_kernel[(triton.cdiv(130, 256),)](partial, direct, 7, 130, BLOCK_P=32, BLOCK_N=256)
    assert torch.equal(via_launch, direct)
    torch.testing.assert_close(via_launch, partial.sum(0), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_launch_equals_plain_launch_on_cuda(monkeypatch):
    """The ops through replayed kernels (second call) give bit-identical results to triton's own launches."""
    from fastbert import ops

    if not common.CACHED_LAUNCH:
        pytest.skip("FASTBERT_CACHED_LAUNCH=0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(130, 768, device="cuda", dtype=torch.float16, generator=gen)
    w = torch.randn(3072, 768, device="cuda", dtype=torch.float16, generator=gen) * 0.03
    b = torch.randn(3072, device="cuda", dtype=torch.float16, generator=gen)
    residual = torch.randn(130, 3072, device="cuda", dtype=torch.float16, generator=gen)

    def run():
        return [ops.linear_activation(x, w, b, "gelu", backend="triton"),
                ops.linear_activation(x[:7], w, None, "relu", backend="triton"),
                common.column_sum(residual.float(), torch.float16)]

    replayed = [run() for _ in range(3)][-1]
    assert sum(v["cached"] for v in common.launch_cache_info().values()) >= 2
    monkeypatch.setattr(common, "_CACHING", False)
    plain = run()
    for a, b_ in zip(replayed, plain, strict=True):
        assert torch.equal(a, b_)


def test_host_cdiv_and_next_power_of_2_match_triton():
    """The launchers' host helpers (triton's own are ConstexprFunctions, ~30x slower a call) give triton's values."""
    for n in [*range(0, 300), 767, 768, 769, 1023, 1024, 1025, 4095, 2**20 + 1]:
        assert common.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 7, 16, 64, 130):
            assert common.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _host_functions(tree):
    """The functions of a kernels module that are not Triton kernels (no @triton.jit decorator)."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and not any(
                "jit" in ast.unparse(decorator) for decorator in node.decorator_list):
            yield node


def test_every_launch_goes_through_the_cached_launcher():
    """No ``kernel[grid](...)`` in the kernels' host code (each launch is `common.launch(kernel, grid, ...)`, so
    the cache and FASTBERT_CACHED_LAUNCH apply to all), and no host call of triton.cdiv / triton.next_power_of_2
    (ConstexprFunctions: `common.cdiv` / `common.next_power_of_2`)."""
    import ast
    from pathlib import Path

    root = Path(common.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module = importlib.import_module(f"fastbert.kernels.{path.stem}") if path.stem != "__init__" else None
        for function in _host_functions(tree):
            if path.name == "common.py" and function.name in ("launch", "_first_launch"):
                continue  # the launcher itself: triton's own launch on a first call or a fallback
            for node in ast.walk(function):
                if not isinstance(node, ast.Call):
                    continue
                if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
                    target = getattr(module, node.func.value.id, None)
                    if hasattr(target, "run") and (hasattr(target, "fn") or hasattr(target, "configs")):
                        found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}(...)")
                if ast.unparse(node.func) in ("triton.cdiv", "triton.next_power_of_2"):
                    found.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
    assert not found, found
