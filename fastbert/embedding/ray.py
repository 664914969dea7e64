"""fastbert's corpus embedder on a Ray cluster (Ray Data), for users who outgrow one machine.

`RayEmbedder` is a callable class for ``ray.data.Dataset.map_batches``: Ray starts one per actor, each loads the
model once and then embeds batch after batch of a text column with `fastbert.embedding.Embedder` (token-budget
batching on the padding-free encoder, the numbers `fastbert embed` writes)::

    import ray
    from fastbert.embedding.ray import RayEmbedder

    ray.init(address="auto")                     # a running cluster (`ray start --head` / KubeRay / ...)
    ds = ray.data.read_text("s3://bucket/corpus/", drop_empty_lines=False)
    ds = ds.map_batches(RayEmbedder, fn_constructor_kwargs={"model_dir": "/models/all-MiniLM-L6-v2"},
                        batch_size=2048, concurrency=8, num_cpus=4)    # or num_gpus=1 per actor
    ds.write_parquet("s3://bucket/embeddings/")

The output batch keeps the input columns and adds ``embedding`` (float32 [n, H]; NaN rows for blank texts),
``tokens`` and ``truncated`` per row. Ray is an optional extra (``pip install 'fastbert[ray]'``); this module
imports it only when a class is built.
"""

from __future__ import annotations

import logging
import signal
import threading

import numpy as np

from fastbert.common.resolve import UserError
from fastbert.embedding.embedder import Embedder
from fastbert.embedding.reading import is_blank
from fastbert.embedding.stats import TRUNCATED_LINES_KEPT, EmbedStats


class RayEmbedder:
    """One fastbert model per Ray actor; ``__call__`` embeds a numpy batch's ``text_column``.

    Constructor arguments are `fastbert.embedding.Embedder`'s (model_dir, device, dtype, backend, pooling,
    normalize, max_length, max_batch_tokens, max_batch_size), plus ``text_column`` (default "text"; a null or blank
    value, `fastbert.embedding.reading.is_blank`, gives a NaN row) and ``threads`` (torch intra-op threads per actor;
    default: Ray's CPU share of the actor)."""

    def __init__(self, model_dir: str | None = None, *, text_column: str = "text", threads: int | None = None,
                 **embedder_options):
        import torch

        if threads is None:
            try:
                import ray

                threads = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 0)) or None
            except Exception:  # noqa: BLE001 - outside an actor (tests, local use): leave torch's default
                threads = None
        if threads:
            torch.set_num_threads(threads)
        self.text_column = text_column
        self.embedder = Embedder(model_dir, **embedder_options)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.text_column not in batch:
            raise KeyError(f"RayEmbedder: the batch has no column {self.text_column!r} (columns: {sorted(batch)}); "
                           "pass text_column=...")
        texts = [t if isinstance(t, str) and not is_blank(t) else None for t in batch[self.text_column].tolist()]
        embeddings, stats, per_row = self.embedder.embed_rows(texts)
        out = dict(batch)
        out["embedding"] = embeddings
        out["tokens"] = per_row["tokens"]
        out["truncated"] = per_row["truncated"]
        return out


class RayClusterEmbedder:
    """`fastbert embed --ray`: embeds each window of rows as a Ray dataset mapped by `RayEmbedder` actors, results
    in input order. Each window is its own dataset, so its actors start (and load the model) per window: keep
    windows large (the default with --ray is 16384 rows). It has `fastbert.embedding.Embedder`'s ``embed``,
    ``settings`` and ``dimension``, so `fastbert.embedding.run` (streaming input, output files or resumable
    shards, progress) drives it unchanged; the driver holds one window.

    address: the cluster to join (None: the one RAY_ADDRESS names, else a new local one); actors: how many model
    replicas; cpus_per_actor / gpus_per_actor: the resources Ray reserves for each."""

    def __init__(self, embedder_options: dict, actors: int = 1, address: str | None = None,
                 cpus_per_actor: float = 1.0, gpus_per_actor: float = 0.0, batch_rows: int = 1024):
        try:
            import ray
        except ImportError as err:
            raise UserError("--ray needs Ray (pip install 'fastbert[ray]')") from err
        if actors < 1:
            raise UserError("--ray-actors must be >= 1")
        self.ray = ray
        if not ray.is_initialized():
            keep_sigterm = threading.current_thread() is threading.main_thread()
            handler = signal.getsignal(signal.SIGTERM) if keep_sigterm else None
            ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                     configure_logging=False)
            if handler is not None:  # Ray's own exits at once; the caller's (the CLI's) stops as Ctrl-C does
                signal.signal(signal.SIGTERM, handler)
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # no execution-plan lines per window on stderr
        self.options, self.actors, self.batch_rows = dict(embedder_options), actors, batch_rows
        self.cpus_per_actor, self.gpus_per_actor = cpus_per_actor, gpus_per_actor
        # The driver reads the checkpoint's config only (no model): the width and the settings of the output.
        self.local = Embedder(**{**self.options, "load_model": False})
        self.options["dtype"] = self.local.precision  # every actor runs what the driver resolved ("auto" included)
        self.dimension = self.local.dimension

    def settings(self) -> dict:
        return self.local.settings()

    def kept_nothing(self, texts: list[str]) -> list[str | None]:
        """`Embedder.kept_nothing` with the driver's tokenizer (the actors' own)."""
        return self.local.kept_nothing(texts)

    def embed(self, texts: list[str | None], lines: list[int] | None = None) -> tuple[np.ndarray, EmbedStats]:
        dataset = self.ray.data.from_items([{"text": text or ""} for text in texts])
        pool = self.ray.data.ActorPoolStrategy(size=self.actors)
        mapped = dataset.map_batches(RayEmbedder, fn_constructor_kwargs=self.options, batch_size=self.batch_rows,
                                     batch_format="numpy", compute=pool, num_cpus=self.cpus_per_actor,
                                     num_gpus=self.gpus_per_actor)
        parts, tokens, truncated = [], [], []
        for batch in mapped.iter_batches(batch_size=None, batch_format="numpy"):
            parts.append(np.asarray(batch["embedding"], dtype=np.float32))
            tokens.append(np.asarray(batch["tokens"]))
            truncated.append(np.asarray(batch["truncated"], dtype=bool))
        embeddings = np.concatenate(parts)
        if len(embeddings) != len(texts):
            raise RuntimeError(f"Ray returned {len(embeddings)} rows for {len(texts)} texts")
        cut = np.flatnonzero(np.concatenate(truncated))
        tokens = np.concatenate(tokens)  # 0 for a null row: None, blank, or nothing the tokenizer keeps
        stats = EmbedStats(rows=len(texts), null_rows=int((tokens == 0).sum()), tokens=int(tokens.sum()),
                           truncated=len(cut))
        stats.embedded = stats.rows - stats.null_rows
        stats.truncated_lines = [(lines[i] if lines is not None else int(i) + 1) for i in cut[:TRUNCATED_LINES_KEPT]]
        return embeddings, stats
