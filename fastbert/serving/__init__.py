"""`fastbert serve`: an embedding, rerank and classification server with token-budget dynamic batching.

- `engines`: the tokenizer and model of a task (``embed``: `fastbert.embedding.Embedder`; ``rerank`` /
  ``classify``: a sequence-classification checkpoint), texts in, rows out;
- `batcher`: the bounded queue and the one worker thread that owns the model and batches requests by tokens;
- `schemas`: the request bodies (pydantic) and the checks of their texts;
- `metrics`: the Prometheus metrics; `app`: the FastAPI app over a `Service` (engine + batcher + metrics);
- `ray`: the same service as a Ray Serve deployment (imported on its own since it needs Ray).

The command is `fastbert.cli.serve`; docs/serving.md shows the endpoints."""

from fastbert.serving.app import API_KEY_ENV, ServeSettings, Service, settings_dict
from fastbert.serving.batcher import Batcher, QueueFull
from fastbert.serving.engines import TASKS, load_engine

__all__ = ["API_KEY_ENV", "TASKS", "Batcher", "QueueFull", "ServeSettings", "Service", "load_engine",
           "settings_dict"]
