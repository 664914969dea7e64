"""`fastbert serve --ray --replicas 2` on a local Ray cluster (slow: Ray starts in tens of seconds): both replicas
answer (two pids on /info), each answer is the direct embedding of its texts, SIGTERM shuts it down."""

from __future__ import annotations

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
