"""The server under load and at shutdown: a flooded small queue answers 429 with Retry-After (the others 200, none
5xx), the API key (bearer, from the option or the environment), and SIGTERM: stop accepting, finish the requests in
flight, exit 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import numpy as np
import pytest

from fastbert.training.corpus import cpython_sentences

KEY = "s3cret-token"


@pytest.fixture(scope="module")
def long_texts() -> list[str]:
    return [s for s in cpython_sentences(limit=3000) if len(s) > 200][:32]


async def fire(url: str, bodies: list[dict], headers: dict | None = None) -> list[tuple[httpx.Response, float]]:
    """All bodies at once to /embed; each answer with the monotonic time it came back."""
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers,
                                 limits=httpx.Limits(max_connections=len(bodies))) as client:
        async def one(body):
            answer = await client.post("/embed", json=body)
            return answer, time.monotonic()

        return await asyncio.gather(*(one(b) for b in bodies))


def test_flooded_small_queue_answers_429_and_the_api_key(start_server, long_texts):
    server = start_server(["--max-queue", "2", "--max-batch-tokens", "512"], env={"FASTBERT_API_KEY": KEY})
    assert httpx.get(server.url + "/health").status_code == 200  # open to a load balancer's probe
    assert httpx.post(server.url + "/embed", json={"inputs": "x"}).status_code == 401
    wrong = httpx.post(server.url + "/embed", json={"inputs": "x"}, headers={"Authorization": "Bearer s3cret"})
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.url + "/metrics").status_code == 401
    for refused in (KEY, f"Basic {KEY}", f"Bearer{KEY}", f"Bearer {KEY}x", "Bearer"):
        assert httpx.get(server.url + "/info", headers={"Authorization": refused}).status_code == 401, refused
    for scheme in ("bearer", "BEARER"):  # a scheme is case-insensitive (RFC 9110)
        assert httpx.get(server.url + "/info", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    answers = asyncio.run(fire(server.url, [{"inputs": long_texts}] * 24, auth))
    statuses = [a.status_code for a, _ in answers]
    assert set(statuses) <= {200, 429}, statuses
    # requests being tokenized hold their places: the queue of 2 takes the first two, the rest may be refused
    assert statuses.count(429) >= 10 and statuses.count(200) >= 2, statuses
    refused = next(a for a, _ in answers if a.status_code == 429)
    assert refused.headers["retry-after"] == "1" and "queue is full" in refused.json()["error"]
    ok = [np.array(a.json()) for a, _ in answers if a.status_code == 200]
    assert all(np.array_equal(o, ok[0]) for o in ok)  # the same texts, the same vectors, whatever the batch


def test_sigterm_finishes_requests_in_flight_and_exits_0(start_server, long_texts):
    server = start_server(["--max-batch-tokens", "1024"])

    async def flood_then_terminate():
        requests = asyncio.ensure_future(fire(server.url, [{"inputs": long_texts}] * 6))
        await asyncio.sleep(1.0)  # the requests are queued or running
        server.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # uvicorn checks for the signal every 0.1 s, then stops listening
        probed_at = time.monotonic()
        async with httpx.AsyncClient(timeout=5) as probe:  # a new connection, as a load balancer's probe makes
            try:
                health: int | str = (await probe.get(server.url + "/health")).status_code
            except httpx.ConnectError:
                health = "refused"
        return probed_at, health, await requests

    probed_at, health, answers = asyncio.run(flood_then_terminate())
    assert [a.status_code for a, _ in answers] == [200] * 6
    assert any(done > probed_at for _, done in answers), "no request was in flight at the probe"
    # what docs/serving.md says: while the requests in flight drain, a new connection is refused (no 503)
    assert health == "refused", health
    assert server.process.wait(60) == 0, server.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
