"""The app's JSON writer on its own: rows (numpy float32) written by orjson read back as the same float32 values,
as the plain-json fallback's do, for contiguous rows, row views and a non-contiguous array."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastbert.serving import app


@pytest.mark.parametrize("shape", [(1, 1), (7, 130), (3, 768)])
@pytest.mark.parametrize("fast", [True, False])
def test_json_bytes_rows_read_back_as_the_same_float32(monkeypatch, shape, fast):
    if not fast:
        monkeypatch.setattr(app, "orjson", None)
    elif app.orjson is None:
        pytest.fail("orjson is missing: the serve extra installs it (pip install -e '.[serve]')")
    rows = (np.random.default_rng(shape[1]).standard_normal(shape) / 3).astype(np.float32)
    body = {"object": "list", "data": [{"index": i, "embedding": row} for i, row in enumerate(rows)],
            "usage": np.int64(rows.size), "rows": rows, "columns": rows.T}
    back = json.loads(app.json_bytes(body))
    for name, expected in (("rows", rows), ("columns", rows.T)):
        got = np.array(back[name], dtype=np.float64)
        np.testing.assert_array_equal(got.astype(np.float32), expected)
        assert np.abs(got - expected).max() <= 6e-8 * max(1.0, float(np.abs(expected).max()))
    np.testing.assert_array_equal(np.array([d["embedding"] for d in back["data"]], dtype=np.float32), rows)
    assert back["usage"] == rows.size and back["object"] == "list"


def test_json_bytes_refuses_what_json_cannot_hold():
    with pytest.raises(TypeError):
        app.json_bytes({"x": object()})


def test_normalized_rows_are_torch_normalize_without_torch():
    """numpy (a torch op in a worker thread would start OpenMP workers there): the numbers of
    torch.nn.functional.normalize, a zero row included (over max(norm, 1e-12): zeros, not NaN)."""
    import torch

    rows = np.random.default_rng(0).standard_normal((7, 384)).astype(np.float32) * 3
    rows[3] = 0
    got = app.normalized(rows)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, torch.nn.functional.normalize(torch.from_numpy(rows), dim=1).numpy(), rtol=1e-6,
                               atol=1e-7)
    assert not got[3].any()


@pytest.mark.parametrize("error, status", [("QueueFull", 429), ("ShuttingDown", 503)])
def test_the_gate_refuses_a_queued_route_before_reading_the_body(error, status):
    """While the queue is full (or the server stops), a POST to a route that queues is answered at the gate: its
    body is never read nor parsed, the inner app never runs; other routes pass."""
    import asyncio
    from types import SimpleNamespace

    from fastbert.serving import batcher

    full = [True]

    def check_room():
        if full[0]:
            raise getattr(batcher, error)("full" if error == "QueueFull" else "stopping")

    service = SimpleNamespace(settings=SimpleNamespace(api_key=None, max_body_bytes=1024),
                              batcher=SimpleNamespace(check_room=check_room),
                              metrics=SimpleNamespace(record_request=lambda *args: None))
    reached = []

    async def inner(scope, receive, send):
        reached.append(scope["path"])
        await app.json_response({"ok": True})(scope, receive, send)

    async def receive():
        raise AssertionError("the body was read")

    async def call(path):
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", b"10")],
                 "query_string": b""}
        await app.Gate(inner, service)(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"])

    status_seen, headers = asyncio.run(call("/v1/embeddings"))
    assert status_seen == status and headers[b"retry-after"] == b"1" and reached == []
    assert asyncio.run(call("/embed"))[0] == status and reached == []
    service.settings.max_body_bytes = 5  # /tokenize does not queue: it reaches the body limit (413), not the gate's
    assert asyncio.run(call("/tokenize"))[0] == 413 and reached == []
    full[0], service.settings.max_body_bytes = False, 1024  # room again: the request reaches the app

    async def body():
        return {"type": "http.request", "body": b"0123456789", "more_body": False}

    receive_body = body
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/embed", "headers": [(b"content-length", b"10")],
             "query_string": b""}
    asyncio.run(app.Gate(inner, service)(scope, receive_body, send))
    assert sent[0]["status"] == 200 and reached == ["/embed"]


def test_freeze_heap_leaves_what_lives_out_of_the_collectors_scans():
    """An object alive at the freeze is no longer among the objects the collector scans; garbage alive then (a
    reference cycle) is collected first, not frozen."""
    import gc
    import weakref

    class Node:
        pass

    kept, cycle = Node(), Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    try:
        app.freeze_heap()
        assert gone() is None
        assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("freeze", [True, False])
def test_the_servers_warm_up_freezes_the_heap_after_its_forwards(monkeypatch, freeze):
    """The model's thread warms up, then freezes (the objects the warm-up made are frozen too), unless the settings
    say not to (a Service in a process it shares)."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(app, "warm", lambda *args: calls.append("warm"))
    monkeypatch.setattr(app, "freeze_heap", lambda: calls.append("freeze"))
    service = SimpleNamespace(engine=None, max_batch_tokens=64)
    app.Service.warm_up(service, app.ServeSettings(freeze_heap=freeze))
    assert calls == (["warm", "freeze"] if freeze else ["warm"])


def test_the_lifespan_unfreezes_at_shutdown(monkeypatch):
    """After the batcher stops, what the freeze kept is collectable again: a dropped Service (whose app and
    metrics point back to it) is not kept for good."""
    import asyncio
    import gc
    from types import SimpleNamespace

    batcher = SimpleNamespace(start=lambda: None, stop=lambda: None)
    service = SimpleNamespace(batcher=batcher, settings=app.ServeSettings(), pool=SimpleNamespace(
        shutdown=lambda wait: None))
    monkeypatch.setattr(app, "release_openmp_threads", lambda: None)
    built = app.build_app(service)

    async def run_lifespan():
        async with built.router.lifespan_context(built):
            app.freeze_heap()
            assert gc.get_freeze_count() > 0

    try:
        asyncio.run(run_lifespan())
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
