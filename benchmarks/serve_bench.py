"""Load benchmark of `fastbert serve` against a baseline server, on loopback, with every answer checked.

    .venv/bin/python benchmarks/serve_bench.py --out benchmarks/results/serve-cpu   # full run (about 10 minutes)
    .venv/bin/python benchmarks/serve_bench.py --quick --out /tmp/serve-quick      # sanity run (about 1 minute)

Servers (each its own process, 127.0.0.1, a free port, one at a time, killed at the end): `fastbert serve`
(all-MiniLM-L6-v2, fp32), the baseline a user writes today (a plain FastAPI handler calling sentence-transformers'
``encode`` per request, same model, same torch threads), and, with ``--infinity-venv``, infinity-emb's torch and
ONNX (optimum) engines from that venv, offline from the same model directory. ``--servers`` runs some of them (one
timed call each) into ``--out``; ``--merge`` joins such runs into one results file with the targets. Requests: 1 to
``--max-texts`` (8) mixed-length sentences of CPython's docs (`fastbert.training.corpus.cpython_sentences`),
seeded. Loads, each bounded by a time and a request count:

- closed loop at 1/16/64/256 clients (each sends its next request when the last one is answered): throughput
  (texts/s, tokens/s) and p50/p90/p99 latency per concurrency; the peak is the best texts/s;
- open loop (Poisson arrivals at a fixed rate, whatever the answers) at 50 % and 80 % of the server's own peak
  load (in requests/s from the peak texts/s), and for fastbert at twice it, with the statuses, the latency of the
  429s, and the server's RSS.
Each load also records the CPU the server and this process (the load generator, on the same cores) used.

Every 200 answer of fastbert is compared with a direct `fastbert embed` (`fastbert.embedding.Embedder`) of its own
texts; the baseline's with a looser tolerance (sentence-transformers pads, fastbert does not). The targets, computed
from this run's figures, are printed met / not met and written with the figures (results.json, results.md,
serve_bench.png, machine info with the CPU flags, and the git commit) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-6  # fastbert's answers against the direct embedding of the same texts
BASELINE_TOLERANCE = 1e-4
# fastbert in bfloat16 or int8 (`--serve-args '--dtype auto'` on a CPU with AMX): its unit vectors against the fp32
# direct embedding, elementwise; bf16 keeps 8 bits of mantissa (a unit vector's elements move by a few 1e-3)
REDUCED_TOLERANCE = 3e-2
SERVERS = ("fastbert", "baseline", "infinity-torch", "infinity-onnx")
INFINITY_ENGINES = {"infinity-torch": "torch", "infinity-onnx": "optimum"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small loads: a sanity run of about a minute")
    parser.add_argument("--out", default=None, help="directory for results.json, results.md, serve_bench.png")
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each server")
    parser.add_argument("--concurrencies", default=None, help="closed-loop concurrencies, comma-separated")
    parser.add_argument("--duration", type=float, default=None, help="seconds per load (default 20; quick 4)")
    parser.add_argument("--open-duration", type=float, default=None,
                        help="seconds of each open loop (default 60; quick 8): its p99 needs a few hundred answers")
    parser.add_argument("--max-requests", type=int, default=None, help="requests per load at most (default 3000)")
    parser.add_argument("--max-queue", type=int, default=1024,
                        help="fastbert serve --max-queue (default 1024: 256 closed-loop clients are never refused)")
    parser.add_argument("--max-texts", type=int, default=8, help="texts per request at most (default 8)")
    parser.add_argument("--servers", default="fastbert,baseline", help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--infinity-venv", default=None, help="a venv with infinity-emb installed (its own)")
    parser.add_argument("--fastbert-root", default=None,
                        help="serve fastbert from this checkout (its .venv): an older commit beside this one")
    parser.add_argument("--serve-args", default="", help="more options for fastbert serve (e.g. '--dtype auto')")
    parser.add_argument("--merge", nargs="*", default=None,
                        help="results.json files of earlier --servers runs: join them (with --out) and judge targets")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)  # the baseline's process
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.concurrencies = [int(c) for c in (args.concurrencies or ("1,16,64" if quick else "1,16,64,256")).split(",")]
    args.servers = [name.strip() for name in args.servers.split(",") if name.strip()]
    unknown = [name for name in args.servers if name not in SERVERS]
    if unknown or (any(n.startswith("infinity") for n in args.servers) and not args.infinity_venv):
        parser.error(f"--servers: unknown {unknown}, or an infinity server without --infinity-venv")
    args.duration = args.duration or (4.0 if quick else 12.0)
    args.open_duration = args.open_duration or (8.0 if quick else 20.0)
    args.max_requests = args.max_requests or (150 if quick else 3000)
    args.pool = 400 if quick else 4000
    return args


# ------------------------------------------------------------------------------------------------ the servers
def run_baseline_server(model_dir: str | None, port: int, threads: int) -> None:
    """The baseline: sentence-transformers' encode per request in a plain FastAPI handler (FastAPI runs a `def`
    handler in its thread pool, as most such servers do)."""
    import torch
    import uvicorn
    from fastapi import FastAPI
    from sentence_transformers import SentenceTransformer

    from fastbert.common.resolve import default_model_dir

    torch.set_num_threads(threads)
    model = SentenceTransformer(model_dir or default_model_dir(), device="cpu")
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/embed")
    def embed(body: dict) -> list:
        inputs = body["inputs"]
        return model.encode([inputs] if isinstance(inputs, str) else inputs, normalize_embeddings=True).tolist()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    name: str
    process: subprocess.Popen
    url: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_server(name: str, args: argparse.Namespace) -> Server:
    port = free_port()
    if name == "fastbert":
        python = str(Path(args.fastbert_root) / ".venv" / "bin" / "python") if args.fastbert_root else sys.executable
        command = [python, "-m", "fastbert.cli", "serve", "--port", str(port), "--threads", str(args.threads),
                   "--max-queue", str(args.max_queue), "--log-level", "warning", *args.serve_args.split()]
        command += ["--model", args.model] if args.model else []
        command += [] if "--dtype" in args.serve_args else ["--dtype", "float32"]
    elif name in INFINITY_ENGINES:
        command = [str(Path(args.infinity_venv) / "bin" / "infinity_emb"), "v2", "--model-id", model_copy(args),
                   "--served-model-name", "minilm", "--engine", INFINITY_ENGINES[name], "--device", "cpu",
                   "--dtype", "float32", "--pooling-method", "mean", "--port", str(port), "--log-level", "warning"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads),
               "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"}
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        server = Server(name, process, f"http://127.0.0.1:{port}")
        wait_ready(server)
        return server
    else:
        command = [sys.executable, __file__, "--baseline-server", "--port", str(port), "--threads", str(args.threads)]
        command += ["--model", args.model] if args.model else []
    root = args.fastbert_root if name == "fastbert" and args.fastbert_root else ROOT
    process = subprocess.Popen(command, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    server = Server(name, process, f"http://127.0.0.1:{port}")
    wait_ready(server)
    return server


def model_copy(args: argparse.Namespace) -> str:
    """The model directory copied once under /tmp: infinity's ONNX engine writes its optimized graph and
    rewritten configs next to the weights (it needs a ``model.onnx`` there), and the packaged model lies in
    site-packages."""
    import shutil
    import tempfile

    from fastbert.common.resolve import default_model_dir

    if getattr(args, "model_copy", None) is None:
        args.model_copy = str(Path(tempfile.mkdtemp(prefix="serve-bench-")) / "all-MiniLM-L6-v2")
        shutil.copytree(args.model or default_model_dir(), args.model_copy)
    return args.model_copy


def wait_ready(server: Server, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited: {server.process.stderr.read().decode(errors='replace')}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{server.name} did not become ready in {timeout} s")


class RssSampler:
    """The server's resident memory (VmRSS, MiB) every 0.2 s, in a thread, while a load runs."""

    def __init__(self, pid: int):
        self.pid, self.values, self.stopping = pid, [], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.stopping.is_set():
            try:
                with open(f"/proc/{self.pid}/status") as f:
                    line = next(x for x in f if x.startswith("VmRSS:"))
                self.values.append(int(line.split()[1]) / 1024)
            except (OSError, StopIteration):
                return
            self.stopping.wait(0.2)

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(5)


# ---------------------------------------------------------------------------------------------------- loads
@dataclass
class Sample:
    texts: list[int]  # indices into the pool
    sent: float
    latency: float
    status: int
    body: bytes
    server_ms: dict[str, int] | None = None  # fastbert's TEI timing headers (x-queue-time -> "queue", ...)


TIMING_HEADERS = ("total", "tokenization", "queue", "inference")


@dataclass
class Workload:
    pool: list[str]
    tokens: np.ndarray  # tokens per pool text
    requests: list[list[int]]  # each: 1 to 32 indices into the pool
    cursor: int = 0

    def next(self) -> list[int]:
        self.cursor += 1
        return self.requests[self.cursor % len(self.requests)]


@dataclass
class Phase:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    rss_mib: list[float] = field(default_factory=list)
    server_cpu_s: float = 0.0  # CPU seconds (user + system) the server used during the phase
    client_cpu_s: float = 0.0  # and this process, the load generator: it shares the server's cores
    forwards: dict | None = None  # fastbert's forwards in the phase, from its /metrics: count, seconds, tokens


class LoadClient:
    """The load generator's HTTP client: one aiohttp session posting to fastbert's ``/embed`` or, for infinity,
    OpenAI's ``/embeddings``. It shares the server's cores, so its own cost must stay small and flat: aiohttp spent
    0.2-0.4 ms of CPU per request at 64 and 256 connections, httpx's AsyncClient 2.6 and 8.2 ms
    (benchmarks/results/serve-cpu-infinity), which took a quarter of a core from the server at 256 clients."""

    def __init__(self, url: str, connections: int, openai_route: bool):
        import aiohttp

        self.openai_route = openai_route
        self.session = aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=60),
                                             connector=aiohttp.TCPConnector(limit=connections))

    async def __aenter__(self) -> LoadClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def post(self, texts: list[str]) -> tuple[int, bytes, dict[str, int] | None]:
        """The answer's status, body and server-side times (TEI's x-*-time headers, None where absent)."""
        if self.openai_route:
            path, payload = "/embeddings", {"input": texts, "model": "minilm"}
        else:
            path, payload = "/embed", {"inputs": texts}
        async with self.session.post(path, json=payload) as answer:
            body = await answer.read()
            times = {name: answer.headers.get(f"x-{name}-time") for name in TIMING_HEADERS}
            return answer.status, body, None if None in times.values() else {k: int(v) for k, v in times.items()}


async def send(client: LoadClient, workload: Workload, indices: list[int]) -> Sample:
    start = time.perf_counter()
    try:
        status, body, server_ms = await client.post([workload.pool[i] for i in indices])
    except Exception:  # noqa: BLE001 - a transport failure (reset, timeout) is a result of the load, status 0
        status, body, server_ms = 0, b"", None
    return Sample(indices, start, time.perf_counter() - start, status, body, server_ms)


async def closed_loop(url: str, workload: Workload, concurrency: int, duration: float, limit: int,
                      openai_route: bool = False) -> Phase:
    phase, deadline = Phase(), time.perf_counter() + duration

    async def client_loop(client) -> None:
        while time.perf_counter() < deadline and len(phase.samples) < limit:
            phase.samples.append(await send(client, workload, workload.next()))

    async with LoadClient(url, concurrency, openai_route) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        phase.wall = time.perf_counter() - start
    return phase


async def open_loop(url: str, workload: Workload, rate: float, duration: float, limit: int, seed: int,
                    openai_route: bool = False) -> Phase:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` s (at most ``limit``), each sent whatever the
    answers of the others, on a connection of its own: a pool capped at the server's --max-queue would hold the
    excess of an overload in the client (its wait counted as latency, no 429 ever sent back)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, size=limit))
    arrivals = arrivals[arrivals < duration]
    phase, tasks = Phase(), []
    async with LoadClient(url, len(arrivals) + 1, openai_route) as client:
        start = time.perf_counter()
        for at in arrivals:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(send(client, workload, workload.next())))
        phase.samples = list(await asyncio.gather(*tasks))
        phase.wall = time.perf_counter() - start
    return phase


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(server: Server, coroutine) -> Phase:
    server_start, client_start = cpu_seconds(server.process.pid), time.process_time()
    forwards_before = forward_totals(server)
    with RssSampler(server.process.pid) as rss:
        phase = asyncio.run(coroutine)
    phase.rss_mib = rss.values
    phase.server_cpu_s = cpu_seconds(server.process.pid) - server_start
    phase.client_cpu_s = time.process_time() - client_start
    if forwards_before is not None:
        after = forward_totals(server)
        phase.forwards = {name: after[name] - forwards_before[name] for name in after}
    return phase


def forward_totals(server: Server) -> dict | None:
    """fastbert's forwards so far by its /metrics (`parse_forward_totals`); None for another server."""
    if server.name != "fastbert":
        return None
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
        return parse_forward_totals(answer.read().decode())


def parse_forward_totals(exposition: str) -> dict:
    """Forwards (count), their seconds and their real tokens so far, from fastbert's Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(exposition)}
    total = {sample.name: sample.value for name in ("fastbert_forward_seconds", "fastbert_batch_tokens")
             for sample in families[name].samples}
    return {"count": total["fastbert_forward_seconds_count"], "seconds": total["fastbert_forward_seconds_sum"],
            "tokens": total["fastbert_batch_tokens_sum"]}


# ---------------------------------------------------------------------------------------------------- figures
def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(phase: Phase, workload: Workload) -> dict:
    ok = [s for s in phase.samples if s.status == 200]
    refused = [s for s in phase.samples if s.status == 429]
    latencies = [s.latency for s in ok]
    texts = sum(len(s.texts) for s in ok)
    statuses: dict[str, int] = {}
    for s in phase.samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    return {"requests": len(phase.samples), "statuses": statuses, "wall_s": phase.wall,
            "texts_per_s": texts / phase.wall if phase.wall else 0.0,
            "tokens_per_s": float(sum(workload.tokens[s.texts].sum() for s in ok)) / phase.wall if phase.wall else 0.0,
            "p50_s": percentile(latencies, 50), "p90_s": percentile(latencies, 90), "p99_s": percentile(latencies, 99),
            "refused_p99_s": percentile([s.latency for s in refused], 99),
            "refused_max_s": max((s.latency for s in refused), default=None),
            "server_errors": sum(1 for s in phase.samples if s.status >= 500 or s.status == 0),
            "rss_max_mib": max(phase.rss_mib, default=None),
            "server_cpu_cores": phase.server_cpu_s / phase.wall if phase.wall else 0.0,
            "client_cpu_cores": phase.client_cpu_s / phase.wall if phase.wall else 0.0,
            "server_side": server_side(ok), "forwards": phase.forwards}


def server_side(ok: list[Sample]) -> dict | None:
    """Where the answered requests' time went by the server's own headers (fastbert's, TEI's): p50 and p99 of each
    part in ms, of what came after the last forward within the server's total, of what the client waited beyond
    that total (HTTP, the event loop before the handler, the load generator itself), and of all but the forwards;
    None for a server without them."""
    timed = [s for s in ok if s.server_ms is not None]
    if not timed:
        return None
    parts = {name: [s.server_ms[name] for s in timed] for name in TIMING_HEADERS}
    # after its last forward: the event loop's wait to resume the handler, the answer written (whole ms: +-3)
    parts["after"] = [s.server_ms["total"] - s.server_ms["tokenization"] - s.server_ms["queue"]
                      - s.server_ms["inference"] for s in timed]
    parts["outside"] = [s.latency * 1000 - s.server_ms["total"] for s in timed]
    parts["beyond_inference"] = [s.latency * 1000 - s.server_ms["inference"] for s in timed]
    return {name: {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
            for name, values in parts.items()}


def check_answers(phase: Phase, reference: np.ndarray, tolerance: float) -> dict:
    """Each 200 answer against the direct embeddings of its own texts: the largest difference and how many rows
    passed the tolerance."""
    worst, wrong, rows = 0.0, 0, 0
    for sample in phase.samples:
        if sample.status != 200:
            continue
        body = json.loads(sample.body)
        if isinstance(body, dict):  # OpenAI's shape
            body = [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]
        got = np.asarray(body, dtype=np.float64)
        error = np.abs(got - reference[sample.texts]).max(axis=1) if len(got) == len(sample.texts) else np.array([1.0])
        worst, wrong, rows = max(worst, float(error.max())), wrong + int((error > tolerance).sum()), rows + len(error)
    return {"rows_checked": rows, "max_abs_error": worst, "rows_over_tolerance": wrong, "tolerance": tolerance}


def make_workload(size: int, max_texts: int, seed: int = 0) -> tuple[Workload, np.ndarray]:
    """Pool texts, their token counts, 5000 seeded requests of 1 to ``max_texts`` texts, and the direct
    embeddings."""
    from fastbert.embedding import Embedder
    from fastbert.training.corpus import cpython_sentences

    pool = list(cpython_sentences(limit=size))
    embedder = Embedder()
    reference, _ = embedder.embed(pool)
    tokens = np.array([len(ids) for ids in embedder.tokenize(pool)[0]])
    rng = np.random.default_rng(seed)
    requests = [list(rng.choice(len(pool), size=int(rng.integers(1, max_texts + 1)), replace=False))
                for _ in range(5000)]
    return Workload(pool, tokens, requests), reference.astype(np.float64)


# ------------------------------------------------------------------------------------------------------ runs
def closed_loops(server: Server, workload: Workload, args: argparse.Namespace, reference: np.ndarray,
                 tolerance: float) -> list[dict]:
    openai_route = server.name in INFINITY_ENGINES
    asyncio.run(closed_loop(server.url, workload, 2, 2.0, 20, openai_route))  # first calls, allocator, connections
    results = []
    for concurrency in args.concurrencies:
        phase = run_phase(server, closed_loop(server.url, workload, concurrency, args.duration, args.max_requests,
                                              openai_route))
        figures = {"concurrency": concurrency, **summarize(phase, workload),
                   "check": check_answers(phase, reference, tolerance)}
        results.append(figures)
        print(f"  {server.name:8s} closed c={concurrency:3d}: {figures['texts_per_s']:8.1f} texts/s, p50 "
              f"{fmt_ms(figures['p50_s'])}, p99 {fmt_ms(figures['p99_s'])}, statuses {figures['statuses']}", flush=True)
    return results


def open_loops(server: Server, workload: Workload, args: argparse.Namespace, reference: np.ndarray,
               peak_texts_per_s: float, tolerance: float) -> list[dict]:
    mean_texts = float(np.mean([len(r) for r in workload.requests]))
    results = []
    for fraction in (0.5, 0.8, 2.0) if server.name == "fastbert" else (0.5, 0.8):
        rate = fraction * peak_texts_per_s / mean_texts
        limit = max(20, int(rate * args.open_duration) + 1)
        phase = run_phase(server, open_loop(server.url, workload, rate, args.open_duration, limit,
                                            seed=int(fraction * 10), openai_route=server.name in INFINITY_ENGINES))
        figures = {"fraction_of_peak": fraction, "rate_requests_per_s": rate, **summarize(phase, workload),
                   "check": check_answers(phase, reference, tolerance)}
        results.append(figures)
        print(f"  {server.name} open {fraction:.1f}x peak ({rate:.1f} req/s): {figures['texts_per_s']:8.1f} texts/s, "
              f"p99 {fmt_ms(figures['p99_s'])}, 429 p99 {fmt_ms(figures['refused_p99_s'])}, statuses "
              f"{figures['statuses']}, RSS max {figures['rss_max_mib']} MiB", flush=True)
    return results


def fastbert_tolerance(args: argparse.Namespace) -> float:
    """How far fastbert's answers may lie from the fp32 direct embedding: 1e-6 in float32 (the CLI's default dtype,
    auto, may pick bfloat16 or int8 instead: `REDUCED_TOLERANCE`)."""
    words = args.serve_args.split()
    dtype = words[words.index("--dtype") + 1] if "--dtype" in words[:-1] else "float32"
    return TOLERANCE if dtype == "float32" else REDUCED_TOLERANCE


def run_server(name: str, args: argparse.Namespace, workload: Workload, reference: np.ndarray) -> dict:
    server = start_server(name, args)
    try:
        tolerance = fastbert_tolerance(args) if name == "fastbert" else BASELINE_TOLERANCE
        closed = closed_loops(server, workload, args, reference, tolerance)
        result = {"closed_loop": closed, "peak_texts_per_s": max(c["texts_per_s"] for c in closed),
                  "peak_tokens_per_s": max(c["tokens_per_s"] for c in closed)}
        result["open_loop"] = open_loops(server, workload, args, reference, result["peak_texts_per_s"], tolerance)
        budget = max_batch_tokens(server) if name == "fastbert" else None
    finally:
        server.stop()
    if budget is not None:  # simulated once the server is gone: its CPU is not the next server's
        result["ideal_late_cut"] = ideal_server(result, workload, budget)
    return result


def max_batch_tokens(server: Server) -> int:
    import urllib.request

    with urllib.request.urlopen(server.url + "/info", timeout=30) as answer:
        return json.loads(answer.read())["max_batch_tokens"]


# ------------------------------------------------------------------------------------------------ queue model
def ideal_server(result: dict, workload: Workload, budget: int, seconds: float = 600.0) -> dict | None:
    """An estimate of the best a server of this design could do with this run's forwards: one model thread, batches
    cut late (every waiting request, up to ``budget`` real tokens, when the model frees: the batcher's rule), each
    forward as long as this run's closed loops measured for its token count (`forward_cost`), the rest of a
    request's time a constant (the one-client loop's median time beyond its forwards, by the server's headers). Its
    p99 at half (and 0.8x) the measured peak over its own idle p99 is what the measured ratio is read against
    (simulated over ``seconds`` of Poisson arrivals, the workload's requests in order). The closed loops' forwards
    ran beside the load generator and the server's other threads, as the open loops' do. None without a
    one-client loop or two measured forward sizes."""
    tokens, cost = forward_cost(result["closed_loop"])
    one = next((c for c in result["closed_loop"] if c["concurrency"] == 1), None)
    if len(tokens) < 3 or one is None or not one.get("server_side"):
        return None
    overhead = one["server_side"]["beyond_inference"]["p50_ms"] / 1000
    per_request = np.array([workload.tokens[r].sum() for r in workload.requests], dtype=float)
    idle = np.percentile([forwards_time(t, budget, tokens, cost) for t in per_request], 99) + overhead
    mean_texts = float(np.mean([len(r) for r in workload.requests]))
    figures = {"forward_cost_points": [[float(t), float(c)] for t, c in zip(tokens, cost, strict=True)],
               "overhead_s": overhead, "idle_p99_s": float(idle)}
    for fraction in (0.5, 0.8):
        rate = fraction * result["peak_texts_per_s"] / mean_texts
        latency = late_cut_latencies(per_request, rate, seconds, budget, tokens, cost) + overhead
        figures[f"p99_at_{fraction}_s"] = float(np.percentile(latency, 99))
        figures[f"p99_at_{fraction}_over_idle"] = float(np.percentile(latency, 99) / idle)
    return figures


def forward_cost(closed: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(real tokens, seconds) of the closed loops' mean forwards, by tokens, from (0, 0): below the one-client
    forward a forward costs its share of it, no fixed part (generous to the ideal server)."""
    points = sorted((f["tokens"] / f["count"], f["seconds"] / f["count"])
                    for f in (c.get("forwards") for c in closed) if f and f["count"])
    return np.array([0.0] + [p[0] for p in points]), np.array([0.0] + [p[1] for p in points])


def forwards_time(total: float, budget: int, tokens: np.ndarray, cost: np.ndarray) -> float:
    """The forwards of ``total`` real tokens: full ones of ``budget`` tokens and the rest (the batcher cuts a request
    past the budget so), each by `forward_cost`'s points, past the last point along the last segment."""
    full, rest = divmod(total, budget)

    def one(size: float) -> float:
        if size <= tokens[-1]:
            return float(np.interp(size, tokens, cost))
        slope = (cost[-1] - cost[-2]) / (tokens[-1] - tokens[-2])
        return float(cost[-1] + slope * (size - tokens[-1]))

    return full * one(budget) + (one(rest) if rest else 0.0)


def late_cut_latencies(per_request: np.ndarray, rate: float, seconds: float, budget: int, tokens: np.ndarray,
                       cost: np.ndarray, seed: int = 0) -> np.ndarray:
    """Each request's time from arrival to the end of its forwards in the late-cut server of `ideal_server`; the
    first tenth (the empty start) left out."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, size=int(rate * seconds) + 1))
    sizes = per_request[np.arange(1, len(arrivals) + 1) % len(per_request)]  # Workload.next starts at the second
    done, now, head, cut = np.empty(len(arrivals)), 0.0, 0, 0
    while cut < len(arrivals):
        now = max(now, arrivals[cut])
        while head < len(arrivals) and arrivals[head] <= now:
            head += 1
        end, total = cut, 0.0
        while end < head and (end == cut or total + sizes[end] <= budget):
            total += sizes[end]
            end += 1
        now += forwards_time(total, budget, tokens, cost)
        done[cut:end], cut = now, end
    return (done - arrivals)[len(arrivals) // 10:]


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


# --------------------------------------------------------------------------------------------------- targets
def targets(results: dict) -> list[dict]:
    """The issue's targets, each met or not from this run's figures (those whose servers ran)."""
    servers = results["servers"]
    if "fastbert" not in servers:
        return []
    fast = servers["fastbert"]
    idle = fast["closed_loop"][0]  # concurrency 1 (the first one given): single requests on an idle server
    by_fraction = {o["fraction_of_peak"]: o for o in fast["open_loop"]}
    half, double = by_fraction[0.5], by_fraction[2.0]
    checked = [c["check"] for c in fast["closed_loop"]] + [o["check"] for o in fast["open_loop"]]
    closed_rss = max(c["rss_max_mib"] or 0 for c in fast["closed_loop"])
    rows = []
    peers = {name: s["peak_texts_per_s"] for name, s in servers.items() if name.startswith("infinity")}
    if peers:
        best = max(peers, key=peers.get)
        ratio = fast["peak_texts_per_s"] / peers[best]
        rows.append(("peak >= 2x infinity-emb's best engine", ratio >= 2,
                     f"{ratio:.2f}x ({fast['peak_texts_per_s']:.0f} vs {best} {peers[best]:.0f} texts/s)"))
    if "baseline" in servers:
        ratio = fast["peak_texts_per_s"] / servers["baseline"]["peak_texts_per_s"]
        rows.append(("peak >= 2.5x the plain FastAPI + sentence-transformers server", ratio >= 2.5, f"{ratio:.2f}x "
                     f"({fast['peak_texts_per_s']:.0f} vs {servers['baseline']['peak_texts_per_s']:.0f} texts/s)"))
    for clients in (64, 256):
        load = next((c for c in fast["closed_loop"] if c["concurrency"] == clients), None)
        if load is not None:
            share = load["texts_per_s"] / fast["peak_texts_per_s"]
            rows.append((f"throughput at {clients} clients >= 95 % of the peak", share >= 0.95,
                         f"{load['texts_per_s']:.0f} texts/s, {share:.0%} of {fast['peak_texts_per_s']:.0f}"))
    p99 = half["p99_s"] or float("inf")
    ideal = fast.get("ideal_late_cut")
    bound = "" if not ideal else (f"; an ideal late-cut server with this run's forwards (estimate): "
                                  f"x{ideal['p99_at_0.5_over_idle']:.2f} ({fmt_ms(ideal['p99_at_0.5_s'])} vs "
                                  f"{fmt_ms(ideal['idle_p99_s'])})")
    rows.append(("p99 at half the peak load <= 2x the idle p99 (one client, closed loop)", p99 <= 2 * idle["p99_s"],
                 f"p99 {fmt_ms(p99)} vs idle p99 {fmt_ms(idle['p99_s'])} (x{p99 / idle['p99_s']:.2f}){bound}"))
    refused, count = double["refused_p99_s"], double["statuses"].get("429", 0)
    rows.append(("at 2x the peak load the excess is answered 429 within 50 ms (p99)",
                 refused is None or refused <= 0.05,
                 f"{count} x 429, p99 {fmt_ms(refused)}, max {fmt_ms(double['refused_max_s'])}"))
    rows.append(("at 2x the peak load memory stays bounded (RSS max <= 1.25 x the closed loops')",
                 (double["rss_max_mib"] or 0) <= 1.25 * closed_rss, f"{double['rss_max_mib']} vs {closed_rss} MiB"))
    errors = sum(c["server_errors"] for c in fast["closed_loop"] + fast["open_loop"])
    rows.append(("no 5xx (nor transport errors) at any load", errors == 0, f"{errors}"))
    wrong, worst = sum(c["rows_over_tolerance"] for c in checked), max(c["max_abs_error"] for c in checked)
    tolerance = fastbert_tolerance(argparse.Namespace(serve_args=results["settings"].get("serve_args", "")))
    rows.append((f"every 200 answer equals the direct embedding of its texts within {tolerance:g}", wrong == 0,
                 f"{sum(c['rows_checked'] for c in checked)} rows, max |diff| {worst:.2e}, {wrong} over"))
    return [{"target": t, "met": bool(m), "figures": f} for t, m, f in rows]


# --------------------------------------------------------------------------------------------------- outputs
def machine(args: argparse.Namespace) -> dict:
    """`machine_info` (CPU flags among them) with the commit (dirty when fastbert or this script is edited), the
    server threads and the load generator."""
    from fastbert.bench.machine import git_commit, machine_info

    info = machine_info("cpu")
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "fastbert", "benchmarks/serve_bench.py"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    info.update(git_commit=git_commit(ROOT, short=False) or "",
                git_dirty=bool(dirty), server_threads=args.threads,
                load_generator="aiohttp ClientSession in one process on the same machine")
    return info


def machine_lines(machine: dict) -> list[str]:
    """Where and when the figures were measured: CPU and its flags, versions, date, commit."""
    versions = ", ".join(f"{name} {version}" for name, version in machine.get("versions", {}).items())
    return [f"Machine: {machine['cpu']}, {machine['cpu_cores']} cores, server threads {machine['server_threads']}; "
            f"CPU flags: {' '.join(machine['cpu_flags']) or 'none of fastbert.cpu.FEATURES'}; "
            f"GPU: {machine.get('gpu') or 'none'}",
            f"Date: {machine.get('date')}; Python {machine.get('python')}; {versions}; "
            f"commit {machine['git_commit'][:12]}"]


def cpu_cores(figures: dict) -> str:
    """The cores the server and the load generator kept busy in a load (absent from older results files)."""
    if "server_cpu_cores" not in figures:
        return "-"
    return f"{figures['server_cpu_cores']:.2f} / {figures['client_cpu_cores']:.2f}"


def markdown(results: dict) -> str:
    lines = ["# fastbert serve: load benchmark", "", f"Command: `{results['command']}`", "",
             *machine_lines(results["machine"]), "",
             "| server | load | requests | statuses | texts/s | tokens/s | p50 | p90 | p99 | CPU server / load gen "
             "| p99 by the server: total / queue / inference / after it / outside the server (ms) |",
             "|" + "---|" * 11]
    for name, server in results["servers"].items():
        loads = [(f"closed c={c['concurrency']}", c) for c in server["closed_loop"]]
        loads += [(f"open {o['fraction_of_peak']}x peak ({o['rate_requests_per_s']:.1f} req/s)", o)
                  for o in server.get("open_loop", [])]
        for label, f in loads:
            lines.append(f"| {name} | {label} | {f['requests']} | {f['statuses']} | {f['texts_per_s']:.1f} | "
                         f"{f['tokens_per_s']:.0f} | {fmt_ms(f['p50_s'])} | {fmt_ms(f['p90_s'])} | "
                         f"{fmt_ms(f['p99_s'])} | {cpu_cores(f)} | {server_parts(f.get('server_side'))} |")
    lines += ["", "| target | met | figures |", "|---|---|---|"]
    lines += [f"| {t['target']} | {'met' if t['met'] else 'NOT met'} | {t['figures']} |" for t in results["targets"]]
    return "\n".join(lines) + "\n"


def server_parts(side: dict | None) -> str:
    if not side:
        return "-"
    return " / ".join(f"{side[name]['p99_ms']:.0f}" for name in ("total", "queue", "inference", "after", "outside"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fastbert.bench.report import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, server in results["servers"].items():
        closed = server["closed_loop"]
        left.plot([c["concurrency"] for c in closed], [c["texts_per_s"] for c in closed], marker="o", label=name)
        for q, style in (("p50_s", "-"), ("p99_s", "--")):
            right.plot([c["texts_per_s"] for c in closed], [c[q] * 1000 for c in closed], style, marker="o",
                       label=f"{name} {q[:3]} (closed)")
    for o in results["servers"].get("fastbert", {}).get("open_loop", []):
        if o["p99_s"] is not None:
            right.scatter([o["texts_per_s"]], [o["p99_s"] * 1000], marker="x", s=60,
                          label=f"fastbert p99, open {o['fraction_of_peak']}x peak")
    left.set(xlabel="concurrent clients (closed loop)", ylabel="texts/s", title="throughput", xscale="log")
    right.set(xlabel="texts/s", ylabel="latency (ms)", title="latency against throughput", yscale="log")
    left.legend(), right.legend(fontsize=7)
    save_figure(fig, path)


def write_outputs(results: dict, out: Path) -> None:
    from fastbert.files import write_atomic

    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    write_atomic(out / "results.md", markdown(results))
    plot(results, out / "serve_bench.png")
    print(f"wrote {out}/results.json, results.md, serve_bench.png")


def merge(paths: list[str]) -> dict:
    """Several --servers runs joined: their servers side by side, the first run's command, settings and machine
    (each run's own is kept under runs)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    merged = {"command": " + ".join(r["command"] for r in runs), "settings": runs[0]["settings"], "servers": {},
              "machine": runs[0]["machine"], "runs": [{k: r[k] for k in ("command", "machine")} for r in runs]}
    for run in runs:
        merged["servers"].update(run["servers"])
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.baseline_server:
        run_baseline_server(args.model, args.port, args.threads)
        return 0
    if args.merge:
        results = merge(args.merge)
    else:
        print(f"workload: {args.pool} sentences, requests of 1-{args.max_texts} texts; computing the direct "
              "embeddings", flush=True)
        workload, reference = make_workload(args.pool, args.max_texts)
        results = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "settings": {
            k: v for k, v in vars(args).items() if k not in ("baseline_server", "port", "model_copy")}, "servers": {}}
        for name in args.servers:
            results["servers"][name] = run_server(name, args, workload, reference)
        results["machine"] = machine(args)
    results["targets"] = targets(results)
    for t in results["targets"]:
        print(f"{'MET    ' if t['met'] else 'NOT MET'}  {t['target']}: {t['figures']}")
    if args.out:
        write_outputs(results, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
