"""`fastbert serve` on a Ray cluster: the same `Service` (engine, batcher, routes, metrics) as a Ray Serve
deployment, one per replica; Ray Serve's HTTP proxy spreads requests over the replicas::

    from fastbert.serving import ServeSettings
    from fastbert.serving.ray import application
    from ray import serve

    serve.run(application(ServeSettings(), replicas=2), route_prefix="/")

Each replica builds its `Service` in its own process, and Ray Serve runs the app's lifespan there (which starts the
replica's batcher). Ray is an optional extra (``pip install 'fastbert[ray]'``); this module imports it at once."""

from __future__ import annotations

import signal
import threading
from dataclasses import asdict
from typing import Any

import ray
from ray import serve

from fastbert.common.resolve import UserError
from fastbert.serving.app import ServeSettings, Service, batch_budget
from fastbert.serving.engines import check_engine_settings

APP_NAME = "fastbert"  # the Ray Serve application (and its deployment)


@serve.ingress()
class Replica:
    """One replica: a `Service` built from the settings, with ``threads`` torch threads (None: Ray's CPU share)."""

    def __init__(self, settings: dict[str, Any], threads: int | None = None):
        import torch

        threads = threads or int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0)) or None
        if threads:
            torch.set_num_threads(threads)
        self.service = Service(ServeSettings(**settings))

    def __serve_build_asgi_app__(self):  # the name Ray Serve calls
        return self.service.app


def application(settings: ServeSettings, replicas: int = 1, threads: int | None = None,
                cpus_per_replica: float = 1.0) -> Any:
    """The bound Ray Serve application of ``replicas`` copies of the service (for `serve.run`)."""
    deployment = serve.deployment(Replica, name=APP_NAME, num_replicas=replicas,
                                  max_ongoing_requests=settings.max_queue + 8,
                                  ray_actor_options={"num_cpus": cpus_per_replica})
    return deployment.bind(asdict(settings), threads)


def replica_error(app_name: str) -> str | None:
    """The error a replica of ``app_name`` failed with while it started: the last line of the traceback that Ray
    Serve keeps in the deployment's status, without the exception's module ("UserError: ..."); None if none."""
    application = serve.status().applications.get(app_name)
    for deployment in (application.deployments.values() if application else ()):
        lines = [line.strip() for line in (deployment.message or "").splitlines() if line.strip()]
        if lines and ": " in lines[-1]:
            name, text = lines[-1].split(": ", 1)
            return f"{name.rsplit('.', 1)[-1]}: {text}" if name.replace(".", "").isidentifier() else lines[-1]
    return None


def serve_on_ray(settings: ServeSettings, replicas: int, host: str, port: int, threads: int | None = None,
                 url: str | None = None) -> int:
    """Start Ray (or join the cluster of RAY_ADDRESS), serve on host:port until SIGTERM or Ctrl-C, shut down.
    ``url``: the address the ready line prints (default http://host:port)."""
    # before Ray starts: what a replica would refuse
    length = check_engine_settings(settings.task, settings.model_dir, settings.max_input_length)
    batch_budget(settings.max_batch_tokens, length, "cpu")
    previous = signal.getsignal(signal.SIGTERM)
    ray.init(ignore_reinit_error=True)
    # Ray's own handler (installed by ray.init) aborts the process on SIGTERM; ours, installed before serve.run,
    # turns a SIGTERM at any point after this one (the proxy answers before serve.run returns) into the shutdown.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    serve.start(http_options={"host": host, "port": port})
    try:
        serve.run(application(settings, replicas, threads), name=APP_NAME, route_prefix="/")
    except RuntimeError as err:  # a replica's constructor failed: Ray logged its traceback
        reason = replica_error(APP_NAME) or str(err).splitlines()[0]
        serve.shutdown()
        ray.shutdown()
        signal.signal(signal.SIGTERM, previous)
        raise UserError(f"Ray Serve could not start the replicas: {reason}") from err
    print(f"fastbert serve: {replicas} replica(s) on Ray Serve at {url or f'http://{host}:{port}'}", flush=True)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    serve.shutdown()
    ray.shutdown()
    signal.signal(signal.SIGTERM, previous)
    return 0
