"""``fastbert serve``'s options (the command: `fastbert.cli.serve`)."""

from __future__ import annotations

import argparse

from fastbert.cli import parsers


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``fastbert`` parser."""
    parser = subparsers.add_parser(
        "serve", help="an embedding / rerank / classification HTTP server with token-budget dynamic batching",
        description="Serve a checkpoint over HTTP: /embed and /v1/embeddings (task embed), /rerank (task rerank: a "
        "cross-encoder, a sequence-classification checkpoint with one label), /predict (rerank or classify), "
        "/health, /info, /metrics. Requests are batched across clients by a token budget; a full queue answers 429.")
    parsers.add_model_options(parser, dtype="auto")  # the fastest precision this machine runs well
    parser.add_argument("--task", choices=parsers.SERVE_TASKS, default="embed",
                        help="what the server answers (default embed)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--max-batch-tokens", type=int, default=None,
                        help="token budget of one forward (default 4096 on CPU, 16384 on CUDA)")
    parser.add_argument("--max-queue", type=int, default=512,
                        help="requests waiting at most; more are answered 429 at once (default 512)")
    parser.add_argument("--max-input-length", type=int, default=None,
                        help="tokens per input; longer ones are cut with truncate: true, else answered 413 (default: "
                        "the checkpoint's sentence-transformers max_seq_length, else the model's limit)")
    parser.add_argument("--max-client-batch-size", type=int, default=32,
                        help="inputs per request at most; more are answered 413 (default 32)")
    parser.add_argument("--request-timeout", type=float, default=30.0,
                        help="seconds a request may wait for its result, else 504 (default 30)")
    parser.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                        help="request body size limit, refused with 413 before parsing (default 2 MiB)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "FASTBERT_API_KEY environment variable; unset: no key)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--workers", type=int, default=None,
                        help="threads that tokenize requests and write answers, off the event loop and the model's "
                        "thread (default 2)")
    parser.add_argument("--warmup", choices=parsers.WARMUPS, default="quick",
                        help="forwards run before /health says ready (503 until then): none, quick (a few token "
                        "counts, default) or full (more text lengths and token counts)")
    parser.add_argument("--warmup-seconds", type=float, default=60.0,
                        help="stop the warm-up after the forward that passes this many seconds (default 60)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default info)")
    parser.add_argument("--ray", action="store_true",
                        help="serve on a Ray cluster with Ray Serve (needs the ray extra), --replicas copies")
    parser.add_argument("--replicas", type=int, default=1, help="with --ray: replicas of the model (default 1)")
    return parser
