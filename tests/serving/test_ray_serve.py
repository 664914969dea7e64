"""`fastbert serve --ray --replicas 2` on a local Ray cluster (slow: Ray starts in tens of seconds): both replicas
answer (two pids on /info), each answer is the direct embedding of its texts, SIGTERM shuts it down."""

from __future__ import annotations

import signal

import httpx
import numpy as np
import pytest

pytest.importorskip("ray.serve")


@pytest.mark.slow
def test_two_replicas_on_local_ray(start_server, direct):
    server = start_server(["--ray", "--replicas", "2"], env={"RAY_ADDRESS": "local"},
                          wait=False).wait_ready(timeout=400)
    texts = ["replica one", "replica two", "a third text"]
    pids = set()
    for _ in range(40):
        pids.add(httpx.get(server.url + "/info", timeout=60).json()["pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2, pids
    for _ in range(4):
        answer = httpx.post(server.url + "/embed", json={"inputs": texts}, timeout=60)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(np.array(answer.json()), direct(texts), atol=1e-6)
    assert server.stop() == 0


def test_settings_a_replica_would_refuse_are_refused_before_ray_starts(monkeypatch):
    from fastbert.common.resolve import UserError
    from fastbert.serving import ServeSettings
    from fastbert.serving import ray as on_ray

    monkeypatch.setattr(on_ray.ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    for task, length in [("embed", 2), ("rerank", 4), ("classify", 100_000)]:
        with pytest.raises(UserError, match="--max-input-length"):
            on_ray.serve_on_ray(ServeSettings(task=task, max_input_length=length), 1, "127.0.0.1", 8080)
    with pytest.raises(UserError, match=r"--max-batch-tokens \(100\) must be at least --max-input-length \(256\)"):
        on_ray.serve_on_ray(ServeSettings(max_batch_tokens=100), 1, "127.0.0.1", 8080)


class _Status:
    """What `serve.status()` holds for an application whose replicas failed to start."""

    def __init__(self, message: str):
        deployment = type("Deployment", (), {"message": message})()
        application = type("Application", (), {"deployments": {"fastbert": deployment}})()
        self.applications = {"fastbert": application}


def test_a_replica_that_fails_to_start_is_one_line_naming_its_error(monkeypatch):
    from fastbert.common.resolve import UserError
    from fastbert.serving import ServeSettings
    from fastbert.serving import ray as on_ray

    traceback = ("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n  File "
                 "\"app.py\", line 102, in __init__\n    self.engine = load_engine(...)\n"
                 "fastbert.common.resolve.UserError: /models/x: no trained sequence-classification head\n")
    calls = []
    for name in ("init", "shutdown"):
        monkeypatch.setattr(on_ray.ray, name, lambda *a, name=name, **k: calls.append(name))
    for name in ("start", "shutdown"):
        monkeypatch.setattr(on_ray.serve, name, lambda *a, name=name, **k: calls.append(f"serve.{name}"))

    def run(*args, **kwargs):
        raise RuntimeError("Deploying application fastbert failed: Failed to update the deployments ['fastbert'].")

    monkeypatch.setattr(on_ray.serve, "run", run)
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(on_ray.serve, "status", lambda: _Status(traceback))
    with pytest.raises(UserError, match=r"^Ray Serve could not start the replicas: UserError: /models/x: no trained "
                                        r"sequence-classification head$"):
        on_ray.serve_on_ray(ServeSettings(), 1, "127.0.0.1", 8080)
    assert calls == ["init", "serve.start", "serve.shutdown", "shutdown"]
    assert signal.getsignal(signal.SIGTERM) is handler  # a failed start leaves the caller's handler
    monkeypatch.setattr(on_ray.serve, "status", lambda: _Status(""))
    with pytest.raises(UserError, match=r"^Ray Serve could not start the replicas: Deploying application fastbert "
                                        r"failed: Failed to update the deployments \['fastbert'\]\.$"):
        on_ray.serve_on_ray(ServeSettings(), 1, "127.0.0.1", 8080)
