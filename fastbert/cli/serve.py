"""``fastbert serve``: an HTTP server for embeddings (TEI's /embed, OpenAI's /v1/embeddings), reranking (/rerank)
or classification (/predict), batching requests by a token budget on the padding-free encoder
(`fastbert.serving`). Binds 127.0.0.1 unless told; SIGTERM stops accepting, finishes the requests in flight and
exits 0."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from fastbert.cli import shared
from fastbert.common.resolve import UserError

if TYPE_CHECKING:
    from fastbert.serving import ServeSettings


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The `ServeSettings` of the command line, checked."""
    from fastbert.serving import API_KEY_ENV, ServeSettings

    for name in ("max_queue", "max_client_batch_size", "max_body_bytes", "replicas"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    if args.replicas != 1 and not args.ray:
        raise UserError("--replicas needs --ray (one server process holds one model)")
    if args.max_batch_tokens is not None and args.max_batch_tokens < 1:
        raise UserError("--max-batch-tokens must be >= 1")
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be >= 1")
    if args.warmup_seconds < 0:
        raise UserError("--warmup-seconds must be >= 0")
    if args.request_timeout <= 0:
        raise UserError("--request-timeout must be > 0")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must lie in [0, 65535], got {args.port}")
    return ServeSettings(task=args.task, model_dir=args.model, device=args.device, dtype=args.dtype,
                         backend=args.backend, max_batch_tokens=args.max_batch_tokens, max_queue=args.max_queue,
                         max_input_length=args.max_input_length, max_client_batch_size=args.max_client_batch_size,
                         request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
                         api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, workers=args.workers,
                         warmup=args.warmup, warmup_seconds=args.warmup_seconds)


PORT_HINTS = {
    errno.EADDRINUSE: " (another process listens there: stop it or pick another --port)",
    errno.EADDRNOTAVAIL: " (no network interface of this machine has that --host address)",
    errno.EACCES: " (ports below 1024 need privileges: pick another --port)",
}


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, bound as uvicorn binds one (SO_REUSEADDR, so a port left in TIME_WAIT by a
    stopped server passes): an address in use is refused at once, before the model loads, in one line. Listening
    from here on, not only bound, since another SO_REUSEADDR socket could still bind and listen on a port merely
    bound; a client that connects while the model loads waits in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's backlog
    except OSError as err:
        sock.close()
        hint = PORT_HINTS.get(err.errno, "")
        raise UserError(f"cannot serve on {host_port(host, port)}: {err.strerror}{hint}") from None
    return sock


def check_port_free(host: str, port: int) -> None:
    """`bind_listening_socket`'s check alone, for a server that binds the address itself (Ray Serve's proxy)."""
    if port != 0:
        bind_listening_socket(host, port).close()


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def joins_a_ray_cluster() -> bool:
    """Whether ray.init() will join a running cluster, whose Serve proxy may hold the port already: RAY_ADDRESS names
    one (empty or "local" starts a new one), or `ray start` ran on this machine and left its address file, as Ray
    resolves an address."""
    address = os.environ.get("RAY_ADDRESS", "")
    if address:
        return address != "local"
    temp_dir = os.environ["RAY_TMPDIR"] if "RAY_TMPDIR" in os.environ else os.environ.get("TMPDIR", "/tmp")
    try:
        return bool((Path(temp_dir) / "ray" / "ray_current_cluster").read_text().strip())
    except OSError:
        return False


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or Ctrl-C; 0 after a clean shutdown."""
    if args.host.startswith("[") and args.host.endswith("]"):  # an IPv6 address as a URL writes it
        args.host = args.host[1:-1]
    if args.ray and args.port == 0:
        raise UserError("--port 0 (a free port) is for the plain server: Ray Serve's proxy needs a --port")
    settings = settings_from(args)
    if args.ray:
        if not joins_a_ray_cluster():
            check_port_free(args.host, args.port)
        shared.set_threads(args.threads)
        from fastbert.serving.ray import serve_on_ray

        return serve_on_ray(settings, args.replicas, args.host, args.port, args.threads,
                            url=f"http://{host_port(args.host, args.port)}")
    with bind_listening_socket(args.host, args.port) as sock:  # held from here: nobody takes it while we load
        shared.set_threads(args.threads)
        return serve_plain(args, settings, sock)


def serve_plain(args: argparse.Namespace, settings: ServeSettings, sock: socket.socket) -> int:
    """uvicorn on the bound ``sock`` until SIGTERM or Ctrl-C."""
    import uvicorn

    from fastbert.serving import Service

    service = Service(settings)
    engine = service.engine
    line = shared.model_line(engine.model_dir, engine.config, engine.device, engine.precision)
    port = sock.getsockname()[1]  # --port 0: the port the system picked
    sys.stderr.write(f"fastbert serve: {line}, task {engine.task}, on http://{host_port(args.host, port)}\n")
    # host and port only label uvicorn's own "running on" line: it serves on ``sock``
    server = uvicorn.Server(uvicorn.Config(service.app, host=args.host, port=port, log_level=args.log_level,
                                           access_log=args.log_level == "debug"))
    # uvicorn re-raises the signal that stopped it once it is done; with this handler that re-raise is a no-op, so
    # a drained shutdown exits 0 instead of dying of SIGTERM
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run(sockets=[sock])
    return 0
