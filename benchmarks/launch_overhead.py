"""Host time of a Triton launch in fastbert, attributed: from the op call the model makes down to the kernel launch.

    .venv/bin/python benchmarks/launch_overhead.py --out benchmarks/results/cpu-2core-launch      # CPU
    python benchmarks/launch_overhead.py --device cuda --out $OUT/launch                           # a GPU

On CPU (no GPU; the kernels are Triton-interpreter functions there) nothing is launched: each launch is replaced by
a no-op (monkeypatched here, never in library code), so what is timed is the Python and dispatcher work around it.
Per op of a BERT-base layer (fp16, 128 tokens, packed attention), median µs per call, the variants interleaved
round by round (so that the load of this shared machine drifts over all of them alike):

- ``op``: the triton backend's function the model's op table calls (`fastbert.kernels.<op>.<op>`): the torch
  custom op's dispatch, its Python implementation, argument handling, output allocation, grid; launches no-op;
- ``op_no_grad``: the same under ``torch.no_grad`` instead of ``inference_mode`` (transformers' pipelines and
  sentence-transformers use no_grad: the custom op's autograd kernel then runs on every call);
- ``dispatch``: an empty custom op registered like fastbert's (schema, fake, CompositeExplicitAutograd Python
  implementation, autograd formula) minus calling its implementation directly: the dispatcher's share;
- per launch: ``replay``, `fastbert.kernels.common.launch` replaying a cached compiled kernel (key, lookup, grid,
  the compiled kernel's run: a no-op here), and ``triton_run``, triton's own ``kernel[grid](...)`` path
  (JITFunction.run: options, binder, specialisation, cache-key string, globals check, grid; a pretend driver and a
  prefilled cache, the compiled kernel's run a no-op) for the same arguments. Neither includes what both share on a
  GPU: the CudaLauncher's Python wrapper and the C launch (~5 µs, triton-lang/triton #3638); triton 3.9 also
  builds launch metadata on every launch (its hook chain is never None), not counted in ``triton_run`` either.
Per forward (BERT-base without pooler, batch 1 x 128, `fastbert.optimize`d transformers model on the triton backend
without CUDA graphs, inference_mode): the host time with no-op launches, the same with the kernels' host code calling
triton.cdiv / triton.next_power_of_2 again (the A/B of `common.cdiv`), the launches it makes, and the two per-launch
costs above times that count. Host times on CPU are this thread's CPU time (`time.thread_time_ns`: the waits for a
core of a shared machine left out); on CUDA wall-clock.

On CUDA the launches are real: per kernel, host µs per launch of a bare ``kernel[grid](...)``, of
`common.launch` (the replay) and of the fastbert op, N launches back to back (tiny grids: the host is the
bottleneck), then one synchronize.

What the profile found (2-core CPU VM, figures in benchmarks/results/cpu-2core-launch/README.md):
- triton's own ``kernel[grid](...)`` costs about twice what a replay through `common.launch` costs per launch
  (binder, specialisation list, cache-key string, options, globals check; the replay keeps the key to a tuple of
  C-level loops and calls the compiled kernel's run directly);
- triton.cdiv and triton.next_power_of_2 are ConstexprFunctions since triton 3.6: each host call unwraps its
  arguments (~30x a plain int division); the launchers made ~255 such calls per forward, now plain ints;
- the custom op's dispatch costs ~2 µs per op under inference_mode and ~3x that under torch.no_grad (its
  autograd kernel runs; transformers' pipelines and sentence-transformers call models under no_grad);
- the launchers' own Python (argument tuples of ~25 strides and sizes, flags, output allocation, grid) is the
  largest remaining share: ~15-25 µs per op here, no-op launch included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and "cuda" not in " ".join(sys.argv[1:]):  # before triton is imported: on CPU the
    os.environ.setdefault("TRITON_INTERPRET", "1")  # kernels are interpreter functions (never run here)

import torch

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, HEADS, FFN, TOKENS = 768, 12, 3072, 128


# ------------------------------------------------------------------------------------------------ timing
def per_call_us(fn, calls: int, clock=time.thread_time_ns) -> float:
    """Mean µs of one call over ``calls`` back-to-back calls. The default clock is this thread's CPU time: on this
    shared CPU machine, time spent waiting for a core is left out (unlike wall-clock time); on CUDA the callers pass
    `time.perf_counter_ns` (the host's wall-clock time to enqueue the launches)."""
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls / 1e3


def interleaved(variants: dict, calls: int, rounds: int, sync=None, clock=time.thread_time_ns) -> dict[str, dict]:
    """Median and min µs per call of each variant, the variants timed in turn in every round; ``sync`` (CUDA)
    runs before each timed block, outside it, so that a block times the host enqueueing ``calls`` calls."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # first calls: caches, lazy imports, compiles
    for _ in range(rounds):
        for name, fn in variants.items():
            if sync is not None:
                sync()
            times[name].append(per_call_us(fn, calls, clock))
    return {name: {"median_us": round(statistics.median(t), 3), "min_us": round(min(t), 3)}
            for name, t in times.items()}


# ------------------------------------------------------------------------------------------------ the ops
def layer_cases(device, dtype, tokens: int = TOKENS, sizes: tuple[int, int, int] = (HIDDEN, HEADS, FFN)
                ) -> dict[str, tuple]:
    """(function the op table calls, its arguments) for each op of a BERT-base layer plus the embeddings."""
    from fastbert.kernels import (
        attention,
        embedding_layernorm,
        linear_activation,
        linear_residual_layernorm,
        qkv_projection,
    )

    hidden, heads, ffn = sizes

    def t(*shape, dt=dtype):
        return torch.randn(*shape, device=device).to(dt)

    ids = torch.randint(0, 1000, (1, tokens), device=device)
    positions = torch.arange(tokens, device=device)[None]
    x, ctx, inner = t(tokens, hidden), t(tokens, hidden), t(tokens, ffn)
    packed = t(tokens, 3, heads, hidden // heads)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    norm = (t(hidden), t(hidden), 1e-12)
    return {
        "embedding_layernorm": (embedding_layernorm.embedding_layernorm,
                                (ids, positions, torch.zeros_like(ids), t(1000, hidden), t(512, hidden),
                                 t(2, hidden), *norm)),
        "qkv_projection": (qkv_projection.qkv_projection, (x, t(3 * hidden, hidden), t(3 * hidden), heads)),
        "attention": (attention.attention, (packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens, tokens, None,
                                            (hidden // heads) ** -0.5, None)),
        "linear_residual_layernorm (attention output)": (
            linear_residual_layernorm.linear_residual_layernorm, (ctx, t(hidden, hidden), t(hidden), x, *norm)),
        "linear_activation (FFN in)": (linear_activation.linear_activation, (x, t(ffn, hidden), t(ffn), "gelu")),
        "linear_residual_layernorm (FFN out)": (
            linear_residual_layernorm.linear_residual_layernorm, (inner, t(hidden, ffn), t(hidden), x, *norm)),
    }


def kernel_modules() -> list:
    """Every loaded kernels module that launches through `common.launch` (imported by name into each)."""
    from fastbert.kernels import common

    return [m for name, m in sorted(sys.modules.items())
            if name.startswith("fastbert.kernels.") and getattr(m, "launch", None) is common.launch]


@contextlib.contextmanager
def launches_replaced(record: list | None = None):
    """Every kernel launch a no-op (each call's (kernel, grid, args, kwargs) appended to ``record``)."""
    from fastbert.kernels import common

    modules, real = kernel_modules(), common.launch

    def fake(kernel, grid, *args, **kwargs):
        if record is not None:
            record.append((kernel, grid, args, kwargs))

    for module in modules:
        module.launch = fake
    try:
        yield
    finally:
        for module in modules:
            module.launch = real


# ------------------------------------------------------------------------------------------------ dispatch share
_BENCH_LIBRARY = None


def empty_custom_op():
    """An op registered as fastbert registers its ops (schema, fake, CompositeExplicitAutograd Python
    implementation, autograd formula) whose implementation returns a preallocated tensor; and that implementation."""
    global _BENCH_LIBRARY
    name = "fastbert_launch_bench::empty"
    result = torch.empty(1)

    def impl(x, weight, bias, activation):
        return result

    if _BENCH_LIBRARY is None:
        _BENCH_LIBRARY = torch.library.Library("fastbert_launch_bench", "DEF")
        _BENCH_LIBRARY.define("empty(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor")
        torch.library.register_fake(name, lambda x, weight, bias, activation: x.new_empty(1), lib=_BENCH_LIBRARY)
        _BENCH_LIBRARY.impl("empty", impl, "CompositeExplicitAutograd")
        torch.library.register_autograd(name, lambda ctx, grad: (grad, None, None, None),
                                        setup_context=lambda ctx, inputs, output: None, lib=_BENCH_LIBRARY)
    return torch.ops.fastbert_launch_bench.empty, impl


def dispatch_share(calls: int, rounds: int) -> dict:
    """µs of the custom op's dispatch: the registered empty op minus its implementation called directly."""
    op, impl = empty_custom_op()
    x, w, b = torch.zeros(8, 32), torch.zeros(32, 32), torch.zeros(32)
    variants = {"impl": lambda: impl(x, w, b, "gelu"), "custom_op": lambda: op(x, w, b, "gelu")}
    with torch.inference_mode():
        inference = interleaved(variants, calls, rounds)
    with torch.no_grad():
        no_grad = interleaved(variants, calls, rounds)
    def share(times):
        return round(times["custom_op"]["median_us"] - times["impl"]["median_us"], 3)

    return {"inference_mode": inference, "no_grad": no_grad, "dispatch_us_inference_mode": share(inference),
            "dispatch_us_no_grad": share(no_grad)}


# ------------------------------------------------------------------------------------------------ per launch
class NoopCompiled:
    """Stands in for triton's CompiledKernel: its run (the CudaLauncher on a GPU) does nothing."""

    function = None
    packed_metadata = (4, 1, 0)

    def run(self, *args):
        return None

    def launch_metadata(self, grid, stream, *args):
        return None


def noop_jit(fn):
    """A JITFunction of ``fn`` whose launches through triton return a `NoopCompiled` without compiling."""
    from triton.runtime.jit import JITFunction

    class NoopJIT(JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            return NoopCompiled()

    return NoopJIT(fn)


class PretendDriver:
    """What JITFunction.run asks triton's driver for, answered without a GPU (C builtins where triton's own are C
    calls: the current device and stream)."""

    get_current_device = int  # int() -> 0
    get_current_stream = abs  # abs(0) -> 0

    def __init__(self):
        self.active = self

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def replay_enabled():
    """`common.launch` replaying (as on a GPU) with the current device and stream from C builtins."""
    from fastbert.kernels import common

    saved = common._CACHING, common._current_device, common._current_stream
    common._CACHING, common._current_device, common._current_stream = True, int, abs
    try:
        yield
    finally:
        common._CACHING, common._current_device, common._current_stream = saved


def triton_path(fn):
    """A JITFunction of ``fn`` whose run takes triton's own path up to the compiled kernel's run (a no-op): a
    pretend driver, and a compile that fills the kernel cache with a `NoopCompiled` instead of compiling."""
    import triton.runtime.jit as jit_module

    jit = jit_module.JITFunction(fn)

    def do_compile(key, signature, device, constexprs, options, attrs, warmup):
        jit.device_caches[device][0][key] = compiled = NoopCompiled()
        return compiled

    jit._do_compile = do_compile
    return jit


@contextlib.contextmanager
def pretend_driver():
    import triton.runtime.jit as jit_module

    saved = jit_module.driver
    jit_module.driver = PretendDriver()
    try:
        yield
    finally:
        jit_module.driver = saved


def launch_costs(launches: list, calls: int, rounds: int) -> dict:
    """µs per launch of the recorded ``launches`` (kernel, grid, args, kwargs): replayed by `common.launch`, and
    through triton's JITFunction.run (`triton_path`), interleaved."""
    from fastbert.kernels import common

    replays = [(noop_jit(k.fn), g, a, kw) for k, g, a, kw in launches]
    tritons = [(triton_path(k.fn), g, a, kw) for k, g, a, kw in launches]

    def replay():
        for kernel, grid, args, kwargs in replays:
            common.launch(kernel, grid, *args, **kwargs)

    def through_triton():
        for kernel, grid, args, kwargs in tritons:
            kernel[grid](*args, **kwargs)

    with replay_enabled(), pretend_driver(), torch.inference_mode():
        times = interleaved({"replay": replay, "triton_run": through_triton}, calls, rounds)
        cached = sum(v["cached"] for v in common.launch_cache_info().values())
    count = len(launches)
    return {"launches": count, "replay_us_per_launch": round(times["replay"]["median_us"] / count, 3),
            "triton_run_us_per_launch": round(times["triton_run"]["median_us"] / count, 3),
            "replay_entries_cached": cached}


# ------------------------------------------------------------------------------------------------ CPU: per op
def op_costs(device, dtype, calls: int, rounds: int) -> list[dict]:
    """Per op of a BERT-base layer: host µs of the op with launches no-op (inference_mode, no_grad), its
    launches, and what one launch adds when replayed or through triton (`launch_costs`)."""
    rows = []
    for name, (fn, args) in layer_cases(device, dtype).items():
        record: list = []
        with launches_replaced(record), torch.inference_mode():
            fn(*args)
        launches = list(record)
        with launches_replaced():
            with torch.inference_mode():
                inference = interleaved({"op": lambda f=fn, a=args: f(*a)}, calls, rounds)["op"]
            with torch.no_grad():
                no_grad = interleaved({"op": lambda f=fn, a=args: f(*a)}, calls, rounds)["op"]
        per_launch = launch_costs(launches, calls, rounds)
        n = per_launch["launches"]
        rows.append({"op": name, "op_us": inference["median_us"], "op_no_grad_us": no_grad["median_us"],
                     **per_launch, "kernels": sorted({getattr(k, "__name__", str(k)) for k, *_ in launches}),
                     "op_with_replay_us": round(inference["median_us"] + n * per_launch["replay_us_per_launch"], 3),
                     "op_with_triton_run_us": round(inference["median_us"]
                                                    + n * per_launch["triton_run_us_per_launch"], 3)})
        print(f"  {name}: op {inference['median_us']:.1f} µs (no_grad {no_grad['median_us']:.1f}), {n} launches: "
              f"replay {per_launch['replay_us_per_launch']:.2f} / triton {per_launch['triton_run_us_per_launch']:.2f}"
              " µs each", flush=True)
    return rows


def bert_base(dtype, device, layers: int = 12, tiny: bool = False):
    """A transformers BertModel at BERT-base's sizes (random weights; ``tiny``: 2 layers of width 64, for dry runs
    under the interpreter), `fastbert.optimize`d on the triton backend without CUDA graphs (each forward launches
    its kernels)."""
    import transformers

    import fastbert

    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=layers) if not tiny else transformers.BertConfig(
        vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
    config._attn_implementation = "sdpa"
    # no pooler: on CPU its dense layer (the one matmul left outside fastbert's ops) would dominate the host time
    model = transformers.BertModel(config, add_pooling_layer=False).eval().to(device=device, dtype=dtype)
    return fastbert.optimize(model, backend="triton", cuda_graphs=False)


@contextlib.contextmanager
def triton_host_helpers():
    """The kernels' host code calling triton.cdiv / triton.next_power_of_2 (ConstexprFunctions) as it did before
    `common.cdiv` / `common.next_power_of_2`: for the A/B of that change."""
    import triton

    swapped = [(m, name, getattr(m, name)) for m in kernel_modules() for name in ("cdiv", "next_power_of_2")
               if hasattr(m, name)]
    for module, name, _ in swapped:
        setattr(module, name, getattr(triton, name))
    try:
        yield
    finally:
        for module, name, own in swapped:
            setattr(module, name, own)


def forward_costs(dtype, device, calls: int, rounds: int) -> dict:
    """Host µs per forward (batch 1 x 128) with no-op launches, the launches one forward makes and their replay
    and triton costs (`launch_costs`) added per forward."""
    model = bert_base(dtype, device)
    ids = torch.randint(1000, 2000, (1, TOKENS), device=device)
    mask = torch.ones_like(ids)
    record: list = []
    with launches_replaced(record), torch.inference_mode():
        model(input_ids=ids, attention_mask=mask)
        launches = list(record)
        def with_triton_helpers():
            with triton_host_helpers():
                model(input_ids=ids, attention_mask=mask)

        both = interleaved({"forward": lambda: model(input_ids=ids, attention_mask=mask),
                            "forward_triton_host_helpers": with_triton_helpers}, max(1, calls // 50), rounds)
        noop = both["forward"]
    per_launch = launch_costs(launches, max(1, calls // 50), rounds)
    n = per_launch["launches"]
    return {"forward_noop_launch_us": noop["median_us"],
            "forward_noop_launch_triton_host_helpers_us": both["forward_triton_host_helpers"]["median_us"],
            **per_launch,
            "forward_with_replay_us": round(noop["median_us"] + n * per_launch["replay_us_per_launch"], 1),
            "forward_with_triton_run_us": round(noop["median_us"] + n * per_launch["triton_run_us_per_launch"], 1)}


# ------------------------------------------------------------------------------------------------ CUDA: real launches
def cuda_launch_table(calls: int, rounds: int, tokens: int = 1, device: str = "cuda") -> list[dict]:
    """Per op (BERT-base sizes, ``tokens`` tokens: tiny kernels, so the host is the bottleneck), host µs per call
    of: its launches as bare ``kernel[grid](...)``, its launches through `common.launch` (replayed), the op with
    replays, and the op with every launch through triton (the cache switched off). ``device="cpu"``: a dry run
    of this code under the interpreter (tiny sizes, nothing replayed: the figures mean nothing)."""
    from fastbert.kernels import common

    device, rows = torch.device(device), []
    cuda = device.type == "cuda"
    sizes = (HIDDEN, HEADS, FFN) if cuda else (64, 2, 128)
    for name, (fn, args) in layer_cases(device, torch.float16 if cuda else torch.float32, tokens, sizes).items():
        record: list = []
        with torch.inference_mode():
            fn(*args)  # compiles
            with launches_replaced(record):
                fn(*args)
        launches = list(record)

        def bare(launches=launches):
            for kernel, grid, a, kw in launches:
                kernel[grid](*a, **kw)

        def cached(launches=launches):
            common._CACHING = True  # the variants run in turn: each sets the switch it needs
            for kernel, grid, a, kw in launches:
                common.launch(kernel, grid, *a, **kw)

        def op(fn=fn, args=args, replay=True):
            common._CACHING = replay
            fn(*args)

        variants = {"bare_kernel_grid": bare, "cached_launch": cached, "op": op,
                    "op_plain_launch": lambda fn=fn, args=args: op(fn, args, False)}
        with torch.inference_mode():
            times = interleaved(variants, calls, rounds, sync=torch.cuda.synchronize if cuda else None,
                                clock=time.perf_counter_ns)
        common._CACHING = common.CACHED_LAUNCH and not common.INTERPRETER
        n = len(launches)
        rows.append({"op": name, "tokens": tokens, "launches": n,
                     **{f"{k}_us": v["median_us"] for k, v in times.items()},
                     **{f"{k}_us_per_launch": round(times[k]["median_us"] / n, 3) for k in ("bare_kernel_grid",
                                                                                          "cached_launch")}})
        print(f"  {name}: {rows[-1]}", flush=True)
    return rows


def cuda_forward_host(rounds: int, batch: int = 1, seqlen: int = 128, device: str = "cuda") -> dict:
    """BERT-base fp16 (`fastbert.optimize`, triton, no CUDA graphs): per forward the host µs until the last launch
    is enqueued and the wall µs after a synchronize, with replayed and with plain triton launches, interleaved.
    ``device="cpu"``: a dry run of this code (a tiny fp32 model under the interpreter)."""
    from fastbert.kernels import common

    cuda = torch.device(device).type == "cuda"
    model = bert_base(torch.float16 if cuda else torch.float32, torch.device(device), tiny=not cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ids = torch.randint(1000, 2000, (batch, seqlen), device=device)
    mask = torch.ones_like(ids)
    record: list = []
    host: dict[bool, list] = {True: [], False: []}
    wall: dict[bool, list] = {True: [], False: []}
    with torch.inference_mode():
        with launches_replaced(record):
            model(input_ids=ids, attention_mask=mask)
        for _ in range(rounds + 2):
            for replay in (True, False):
                common._CACHING = replay and common.CACHED_LAUNCH and not common.INTERPRETER
                sync()
                start = time.perf_counter_ns()
                model(input_ids=ids, attention_mask=mask)
                enqueued = time.perf_counter_ns()
                sync()
                host[replay].append((enqueued - start) / 1e3)
                wall[replay].append((time.perf_counter_ns() - start) / 1e3)
    common._CACHING = common.CACHED_LAUNCH and not common.INTERPRETER
    out = {"shape": f"{batch}x{seqlen}", "launches_per_forward": len(record)}
    for replay, label in ((True, "replay"), (False, "plain")):
        out[f"host_us_{label}"] = round(statistics.median(host[replay][2:]), 1)
        out[f"wall_us_{label}"] = round(statistics.median(wall[replay][2:]), 1)
    return out


# ------------------------------------------------------------------------------------------------ main
def environment(device: torch.device) -> dict:
    """Machine, CPU flags, versions, date, commit, the command and the load (the VM is shared)."""
    from fastbert.bench.machine import git_commit, machine_info

    return {**machine_info(device), "commit": git_commit(ROOT),
            "command": " ".join([sys.executable, *sys.argv]), "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=None, help="folder for launch_overhead.json (default: print only)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=15, help="timed blocks per variant (interleaved)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host time only: an idle second OpenMP thread adds wake-up noise
    device = torch.device(args.device)
    clock = "thread_time_ns (CPU time of this thread)" if device.type == "cpu" else "perf_counter_ns (wall)"
    result: dict = {"environment": {**environment(device), "clock": clock}}
    if device.type == "cpu":
        import fastbert.kernels  # noqa: F401 (the triton ops)

        print("dispatch share of an empty custom op ...", flush=True)
        result["dispatch"] = dispatch_share(args.calls * 5, args.rounds)
        print("per op of a BERT-base layer (fp16, 128 tokens), launches no-op ...", flush=True)
        result["ops"] = op_costs(device, torch.float16, args.calls, args.rounds)
        print("per forward (BERT-base, 1 x 128) ...", flush=True)
        result["forward"] = forward_costs(torch.float16, device, args.calls, args.rounds)
    else:
        print("per op, real launches ...", flush=True)
        result["ops"] = cuda_launch_table(min(args.calls, 100), args.rounds)
        result["forward"] = cuda_forward_host(args.rounds)
    result["environment"]["load_average_after"] = list(os.getloadavg())
    text = json.dumps(result, indent=2, default=str)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "launch_overhead.json").write_text(text + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
