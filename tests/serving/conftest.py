"""What the server tests share: real `fastbert serve` processes on loopback (started on a free port, waited for on
/health, always killed at the end), small sequence-classification checkpoints built offline from
all-MiniLM-L6-v2, and direct embeddings to compare the server's answers with."""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180
READY_LINE = re.compile(r"^fastbert serve: .* on http://127\.0\.0\.1:(\d+)$", re.MULTILINE)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range and above Ray's worker ports (10002-19999): a port
    the kernel hands out for bind(0) can be taken, before the server binds it, by one of the many processes a
    server starts (Ray's GCS, raylet, dashboard and agents bind port 0)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's dynamic range starts at 49152
        ephemeral_low = 49152
    candidates = list(range(20000, max(ephemeral_low, 20001)))
    random.SystemRandom().shuffle(candidates)  # not the tests' seeded generator: servers started together differ
    for port in candidates[:200]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the ephemeral range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m fastbert.cli serve ARGS` on 127.0.0.1, ready once /health answers 200. The plain server binds
    --port 0 and its ready line names the port the system gave it (no port can be taken from under it); a Ray one
    gets a port from `free_port`, since Ray Serve's proxy binds the port itself."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, log_dir: Path | None = None):
        self._port = free_port() if "--ray" in args else None
        if "--dtype" not in args:  # the tests compare with float32 references (the default, auto, is tested apart)
            args = [*args, "--dtype", "float32"]
        command = [sys.executable, "-m", "fastbert.cli", "serve", "--host", "127.0.0.1", "--port",
                   str(self._port or 0), "--threads", "1", "--log-level", "warning", *args]
        descriptor, name = tempfile.mkstemp(prefix="fastbert-serve-", suffix=".log", dir=log_dir)
        self.log_path, self.log = Path(name), os.fdopen(descriptor, "w")  # closed in stop()
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def port(self) -> int:
        """The port it serves on: for --port 0, read off its ready line once the model is loaded."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while self._port is None:
            found = READY_LINE.search(self.output())
            if found:
                self._port = int(found.group(1))
            elif self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server named no port (exit status {self.process.poll()}):\n{self.output()}")
            else:
                time.sleep(0.05)
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        url = self.url
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within {timeout} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL of its process group after 20 s; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        self.log.close()
        return self.process.returncode


@pytest.fixture(scope="session")
def start_server(tmp_path_factory) -> Iterator:
    """A function starting a server (args, env) and returning it ready; every one is stopped at the end."""
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("serve-logs")

    def start(args: Sequence[str] = (), env: dict[str, str] | None = None, wait: bool = True) -> ServerProcess:
        server = ServerProcess(args, env, log_dir)
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.stop()


def classifier_checkpoint(directory: Path, minilm_dir: str, labels: Sequence[str]) -> str:
    """all-MiniLM-L6-v2 under BertForSequenceClassification with a seeded head of ``len(labels)`` labels (one
    label: a cross-encoder reranker), saved with its tokenizer files."""
    import transformers

    torch.manual_seed(1234)
    model = transformers.BertForSequenceClassification.from_pretrained(
        minilm_dir, num_labels=len(labels), id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)})
    with torch.no_grad():  # a head with visible spread, so that the scores order the texts
        model.classifier.weight.normal_(0.0, 0.5)
        model.classifier.bias.normal_(0.0, 0.1)
    model.eval().save_pretrained(directory)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), directory)
    return str(directory)


@pytest.fixture(scope="session")
def reranker_dir(tmp_path_factory, minilm_dir) -> str:
    return classifier_checkpoint(tmp_path_factory.mktemp("reranker"), minilm_dir, ["relevance"])


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory, minilm_dir) -> str:
    return classifier_checkpoint(tmp_path_factory.mktemp("classifier"), minilm_dir, ["negative", "neutral", "positive"])


@pytest.fixture(scope="session")
def embedder():
    """`fastbert embed`'s Embedder of the default model, to check the server against."""
    from fastbert.embedding import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def direct(embedder):
    """The direct embeddings [n, 384] of texts, as `fastbert embed` computes them."""

    def embed(texts: Sequence[str]) -> np.ndarray:
        return embedder.embed(list(texts))[0]

    return embed


TIMING_HEADERS = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time", "x-compute-time")


def timing_headers_are_teis(answer: httpx.Response, elapsed_ms: float, tokens: int, characters: int) -> None:
    """TEI's timing headers, whole milliseconds: parts within the total, the total within the client's wait; the
    callers send milliseconds of forward, so an inference time of 0 means the route lost its timing."""
    assert answer.status_code == 200, answer.text
    times = {name: int(answer.headers[name]) for name in TIMING_HEADERS}
    assert all(value >= 0 for value in times.values()), times
    parts = times["x-tokenization-time"] + times["x-queue-time"] + times["x-inference-time"]
    assert parts <= times["x-total-time"] and times["x-compute-time"] == times["x-total-time"]  # slices of the total
    assert times["x-total-time"] <= elapsed_ms + 1 and times["x-inference-time"] >= 1
    assert int(answer.headers["x-compute-tokens"]) == tokens
    assert int(answer.headers["x-compute-characters"]) == characters
    assert answer.headers["x-compute-type"] == "cpu+float32"


@pytest.fixture
def check_timing_headers():
    """`timing_headers_are_teis`, for the server tests of every task."""
    return timing_headers_are_teis
