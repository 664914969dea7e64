"""The ASGI app (FastAPI): TEI's `/embed`, `/rerank`, `/predict`, OpenAI's `/v1/embeddings` (also `/embeddings`),
`/health`, `/info` and `/metrics`, over one `Service` (engine + batcher + metrics).

Every error a client can cause is a 4xx with a message: 413 for a body over the limit (refused before it is read
to the end, let alone parsed), too many inputs or a too-long input without ``truncate``; 415 for a compressed body
(a Content-Encoding); 422 for a body of the wrong shape or not JSON, an empty or blank text (whitespace and
invisible characters only, or nothing the tokenizer keeps: `fastbert embed`'s rule) or text that is not UTF-8; 401
without the API key; 429 with ``Retry-After`` when the queue is full; 503 once the batcher has stopped (under
uvicorn, SIGTERM closes the listening socket first: new connections are refused); 504 past the request timeout.
Errors read as TEI's (``{"error": ..., "error_type": ...}``) on TEI's routes and as OpenAI's
(``{"error": {"message": ...}}``) under ``/v1``."""

from __future__ import annotations

import asyncio
import base64
import gc
import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from fastbert import __version__
from fastbert.common.resolve import UserError, model_name
from fastbert.common.text import plural
from fastbert.common.threads import release_openmp_threads
from fastbert.embedding import DEFAULT_BATCH_TOKENS
from fastbert.serving import schemas
from fastbert.serving.batcher import Batcher, QueueFull, RequestTimeout, ShuttingDown, Timing
from fastbert.serving.engines import BlankInput, EmbedEngine, InputTooLong, check_engine_settings, load_engine
from fastbert.serving.metrics import CONTENT_TYPE, Metrics
from fastbert.serving.warmup import WARMUPS, warm

try:
    import orjson
except ImportError:  # the serve extra installs it; without it the answers are the same, written slower
    orjson = None

API_KEY_ENV = "FASTBERT_API_KEY"
OPEN_PATHS = ("/health",)  # answered without the API key: what a load balancer probes
ROUTES = ("/embed", "/v1/embeddings", "/embeddings", "/rerank", "/predict", "/similarity", "/tokenize", "/decode",
          "/embed_all", "/embed_sparse", "/health", "/info", "/metrics")
# what waits in the batcher's queue: refused at the gate while it is full
QUEUED_ROUTES = frozenset(("/embed", "/v1/embeddings", "/embeddings", "/rerank", "/predict", "/similarity",
                           "/embed_all", "/embed_sparse"))
# exception -> (status, TEI's error_type)
ERRORS: dict[type, tuple[int, str]] = {
    schemas.RequestError: (422, "Validation"), schemas.TooManyInputs: (413, "Validation"),
    InputTooLong: (413, "Validation"), QueueFull: (429, "Overloaded"), ShuttingDown: (503, "Unhealthy"),
    RequestTimeout: (504, "Timeout"),
}


@dataclass
class ServeSettings:
    """What `fastbert serve` is told; None means the model's or the device's default."""

    task: str = "embed"
    model_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str = "auto"
    max_batch_tokens: int | None = None
    max_queue: int = 512  # TEI's max_concurrent_requests: closed-loop clients past it are refused and retry at once
    max_input_length: int | None = None
    max_client_batch_size: int = 32
    request_timeout: float = 30.0
    max_body_bytes: int = 2 * 1024 * 1024
    api_key: str | None = None
    # threads that tokenize requests and write answers, off the event loop and off the model's thread (the
    # tokenizers library and orjson release the GIL); None: 2
    workers: int | None = None
    warmup: str = "quick"  # none, quick or full: the forwards the model's thread runs before /health says ready
    warmup_seconds: float = 60.0  # the warm-up stops after its forward that passes this
    # after the warm-up, leave the objects alive then out of the garbage collector's full scans (`freeze_heap`);
    # undone at shutdown. The CLI's and Ray's servers own their process; False for a Service in a process it shares
    freeze_heap: bool = True


class WrongTask(Exception):
    """An endpoint of another task than the one served (answered 400)."""


class Service:
    """One model served: its engine, the batcher whose worker runs it, the metrics, and the ASGI app."""

    def __init__(self, settings: ServeSettings, engine: Any = None):
        if settings.max_queue < 1 or settings.max_client_batch_size < 1 or settings.request_timeout <= 0:
            raise ValueError("max_queue and max_client_batch_size must be >= 1, request_timeout > 0")
        if settings.warmup not in WARMUPS or settings.warmup_seconds < 0 or (settings.workers or 1) < 1:
            raise ValueError(f"warmup must be one of {WARMUPS}, warmup_seconds >= 0, workers >= 1")
        self.settings = settings
        if engine is None and settings.max_batch_tokens is not None:  # refused before the model's slow loading
            batch_budget(settings.max_batch_tokens, check_engine_settings(settings.task, settings.model_dir,
                                                                          settings.max_input_length))
        self.engine = engine or load_engine(settings.task, settings.model_dir, settings.device, settings.dtype,
                                            settings.backend, settings.max_input_length)
        self.max_batch_tokens = batch_budget(settings.max_batch_tokens, self.engine.max_length,
                                             self.engine.device.type)
        release_openmp_threads()  # the model's thread alone keeps OpenMP workers (fastbert.common.threads)
        self.metrics = Metrics(lambda: self.batcher.depth())
        self.batcher = Batcher(self.engine, self.max_batch_tokens, settings.max_queue, observer=self.metrics,
                               warmup=lambda: self.warm_up(settings))
        self.has_mlm_head = self.engine.task == "embed" and self.engine.has_mlm_head()
        self.workers = settings.workers or 2
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="fastbert-io")
        self.app = build_app(self)

    def warm_up(self, settings: ServeSettings) -> None:
        """The model's thread before /health says ready: the warm-up forwards, then `freeze_heap` (if set)."""
        warm(self.engine, self.max_batch_tokens, settings.warmup, settings.warmup_seconds)
        if settings.freeze_heap:
            freeze_heap()

    async def offload(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` in the worker pool: tokenizing and writing answers leave the event loop free to
        accept and parse the next requests, and the model's thread free to run."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, function, *args)

    def require(self, *tasks: str) -> None:
        if self.engine.task not in tasks:
            raise WrongTask(f"this server runs task {self.engine.task!r}; this endpoint needs "
                            f"{' or '.join(repr(t) for t in tasks)} (fastbert serve --task ...)")

    async def rows(self, items: list, truncate: bool, direction: str = "Right", timing: Timing | None = None,
                   originals: list | None = None) -> tuple[np.ndarray, int]:
        """The engine's rows for texts (or pairs) through the batcher, and their token count; a too-long input is
        cut at the end ``direction`` (TEI's truncation_direction) names when ``truncate``; ``timing`` (optional)
        gets the tokenizing, queue and inference seconds. ``originals``: the texts before their prompt, which the
        engine checks for texts its tokenizer keeps nothing of (`BlankInput`; default: ``items``)."""
        self.batcher.reserve()
        began = time.perf_counter()
        try:
            tokens = await self.offload(self.engine.encode, items, truncate, direction.lower(), originals)
        except BaseException:  # a refused input, a cancelled request: its place goes back
            self.batcher.release()
            raise
        if timing is not None:
            timing.tokenization = time.perf_counter() - began
        rows = await self.batcher.infer(tokens, self.settings.request_timeout, reserved=True, timing=timing)
        return rows, sum(len(t) for t in tokens)

    def timed(self, response: Response, timing: Timing, tokens: int, characters: int) -> Response:
        """``response`` with TEI's timing headers: x-total-time (from the handler's start to this answer, written),
        x-tokenization-time, x-queue-time, x-inference-time, x-compute-time (= total), x-compute-tokens,
        x-compute-characters (the inputs' characters, before any prompt; token ids count one each, as TEI's) and
        x-compute-type (device+dtype); times in whole milliseconds, as TEI writes them, for the request as a whole
        (TEI's are averages over a batch request's inputs)."""
        total = milliseconds(time.perf_counter() - timing.start)
        response.headers.update({
            "x-compute-type": f"{self.engine.device.type}+{self.engine.precision}", "x-compute-time": total,
            "x-compute-tokens": str(tokens), "x-compute-characters": str(characters), "x-total-time": total,
            "x-tokenization-time": milliseconds(timing.tokenization), "x-queue-time": milliseconds(timing.queue),
            "x-inference-time": milliseconds(timing.inference)})
        return response

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {"model_id": model_name(engine.model_dir), "model_dir": engine.model_dir, "task": engine.task,
                "family": engine.config.family, "dtype": engine.precision, "device": str(engine.device),
                "backend": self.settings.backend, "dimension": engine.dimension, "labels": engine.labels,
                "prompts": list(engine.prompts),
                "max_input_length": engine.max_length, "max_batch_tokens": self.max_batch_tokens,
                "max_client_batch_size": self.settings.max_client_batch_size, "max_queue": self.settings.max_queue,
                "request_timeout_s": self.settings.request_timeout, "max_body_bytes": self.settings.max_body_bytes,
                "auth": self.settings.api_key is not None, "version": __version__,
                "warmup": self.settings.warmup, "ready": self.batcher.ready.is_set(), "workers": self.workers,
                "pid": os.getpid()}  # tells replicas apart behind a load balancer


def batch_budget(max_batch_tokens: int | None, max_length: int, device_type: str = "cpu") -> int:
    """The token budget of one forward: ``max_batch_tokens``, else the device's default (never below one input of
    ``max_length`` tokens); a UserError for a budget below ``max_length``, as `fastbert embed` refuses one: the
    batcher would run such an input alone, in a forward past the budget."""
    if max_batch_tokens is None:
        return max(DEFAULT_BATCH_TOKENS[device_type], max_length)
    if max_batch_tokens < max_length:
        raise UserError(f"--max-batch-tokens ({max_batch_tokens}) must be at least --max-input-length "
                        f"({max_length}): one input of the longest kind must fit in a forward")
    return max_batch_tokens


def freeze_heap() -> None:
    """Leave every object alive now (the model, torch, transformers, the app: some 300,000 for MiniLM) out of the
    garbage collector's full collections (`gc.freeze`). Each full collection scanned them all, holding the GIL: under
    load they took 100-280 ms each (the threads share 2 cores), stalling the event loop, so that at twice the peak
    load 1 % of the 429s waited ~200 ms. Collected first, so that no garbage is frozen. Process-wide: what is frozen
    is never collected until `gc.unfreeze` (the server's shutdown)."""
    gc.collect()
    gc.freeze()


def build_app(service: Service) -> FastAPI:
    """The FastAPI app of ``service``; its lifespan starts the batcher's worker and, at shutdown (after uvicorn has
    finished the requests in flight), stops it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        release_openmp_threads()  # (if this thread ran torch's parallel loops since: fastbert.common.threads)
        service.batcher.start()  # its model thread warms up first; /health answers 503 until it is done
        yield
        service.batcher.stop()
        if service.settings.freeze_heap:
            gc.unfreeze()  # the service's own cycles (its app, its metrics) can be collected once it is dropped
        service.pool.shutdown(wait=False)

    app = FastAPI(title="fastbert serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    for path, handler in (("/embed", embed), ("/v1/embeddings", openai_embeddings), ("/embeddings", openai_embeddings),
                          ("/rerank", rerank), ("/predict", predict), ("/similarity", similarity),
                          ("/tokenize", tokenize), ("/decode", decode), ("/embed_all", embed_all),
                          ("/embed_sparse", embed_sparse)):
        app.add_api_route(path, handler, methods=["POST"])
    for path, handler in (("/health", health), ("/info", info), ("/metrics", metrics)):
        app.add_api_route(path, handler, methods=["GET"])
    for error in (*ERRORS, WrongTask, RequestValidationError, HTTPException):
        app.add_exception_handler(error, answer_error)
    app.add_middleware(Gate, service=service)
    return app


# ------------------------------------------------------------------------------------------------- routes
def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # not FastAPI's jsonable_encoder, which walks every float and costs more than the forward
    return Response(json_bytes(value), status_code=status, media_type="application/json", headers=headers)


def milliseconds(seconds: float) -> str:
    return str(int(seconds * 1000))


def characters_of(items: list) -> int:
    """The characters of texts, or of (text, text) pairs."""
    return sum(len(text) for item in items for text in ((item,) if isinstance(item, str) else item))


def json_bytes(value: Any) -> bytes:
    """``value`` as JSON; numpy arrays (the rows) as nested lists, a float32 as the shortest text that reads back
    as the same float32 (what TEI writes). orjson writes 32 x 384 floats in well under a millisecond; json.dumps of
    the lists took ~30 times longer, all of it holding the event loop and the GIL while the worker ran forwards."""
    if orjson is not None:
        return orjson.dumps(value, default=as_list, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(value, default=as_list).encode()


def as_list(value: Any) -> Any:
    """What JSON cannot take as it is: a numpy array or scalar (orjson: one it does not write natively)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def normalized(rows: np.ndarray) -> np.ndarray:
    """L2-normalised rows: each over max(its norm, 1e-12), as torch.nn.functional.normalize (what `fastbert embed`
    calls) divides. numpy, not torch: a torch op in a worker thread could start OpenMP workers of its own there,
    which slows the model's thread (`fastbert.common.threads`)."""
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))[:, None]  # in the rows' dtype, as torch sums
    return rows / np.maximum(norms, rows.dtype.type(1e-12))


def embedding_rows(rows: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """The answer's rows: the first ``dimensions`` of each (Matryoshka), then L2-normalised when ``normalize``."""
    if dimensions is not None:
        rows = rows[:, :dimensions]
    return normalized(rows) if normalize else rows


def check_dimensions(dimensions: int | None, engine: EmbedEngine) -> None:
    if dimensions is not None and not 1 <= dimensions <= engine.dimension:
        raise schemas.RequestError(f"dimensions {dimensions}: this model gives 1 to {engine.dimension}")


async def embed(body: schemas.EmbedRequest, request: Request) -> Response:
    """TEI's /embed: one embedding (a list of floats) per input, in order."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("embed")
    check_dimensions(body.dimensions, service.engine)
    texts = schemas.texts_of(body.inputs, service.settings.max_client_batch_size)
    prompted = service.engine.with_prompt(texts, body.prompt_name)
    rows, count = await service.rows(prompted, body.truncate, body.truncation_direction, timing, texts)
    return await service.offload(lambda: service.timed(
        json_response(embedding_rows(rows, body.normalize, body.dimensions)), timing, count, characters_of(texts)))


async def openai_embeddings(body: schemas.OpenAIEmbeddingRequest, request: Request) -> Response:
    """OpenAI's embeddings API: texts or token ids in; floats or base64 (little-endian float32) out; ``dimensions``
    keeps the first dimensions of each embedding (then renormalises it when the model's embeddings are)."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("embed")
    engine: EmbedEngine = service.engine
    check_dimensions(body.dimensions, engine)
    limit = service.settings.max_client_batch_size
    if isinstance(body.input, list) and body.input and isinstance(body.input[0], (int, list)):
        rows_of_ids = [body.input] if isinstance(body.input[0], int) else body.input
        if len(rows_of_ids) > limit:
            raise schemas.TooManyInputs(f"{len(rows_of_ids)} inputs in one request; this server takes at most "
                                        f"{limit} (--max-client-batch-size)")
        service.batcher.check_room()
        tokens = engine.check_ids(rows_of_ids)
        rows = await service.batcher.infer(tokens, service.settings.request_timeout, timing=timing)
        count = given = sum(len(t) for t in tokens)
    else:
        texts = schemas.texts_of(body.input, limit)
        rows, count = await service.rows(texts, body.truncate, body.truncation_direction, timing)
        given = characters_of(texts)
    name = body.model or model_name(engine.model_dir)
    rows = embedding_rows(rows, engine.default_normalize, body.dimensions)
    return await service.offload(lambda: service.timed(openai_answer(rows, body.encoding_format, name, count),
                                                       timing, count, given))


def openai_answer(rows: np.ndarray, encoding_format: str, model: str, count: int) -> Response:
    if encoding_format == "base64":
        vectors: list = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in rows]
    else:
        vectors = list(rows)
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return json_response({"object": "list", "data": data, "model": model,
                          "usage": {"prompt_tokens": count, "total_tokens": count}})


async def similarity(body: schemas.SimilarityRequest, request: Request) -> Response:
    """TEI's /similarity: the cosine similarity of the source sentence to each sentence, in order."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("embed")
    params = body.parameters or schemas.SimilarityParameters()
    schemas.check_text(body.inputs.source_sentence, "source_sentence")
    texts = [body.inputs.source_sentence,
             *schemas.texts_of(body.inputs.sentences, service.settings.max_client_batch_size, field="sentences")]
    prompted = service.engine.with_prompt(texts, params.prompt_name)
    try:
        rows, count = await service.rows(prompted, params.truncate, params.truncation_direction, timing, texts)
    except (InputTooLong, BlankInput) as err:
        raise similarity_input_error(err) from None
    unit = normalized(rows)
    return service.timed(json_response((unit[1:] @ unit[0]).tolist()), timing, count, characters_of(texts))


def similarity_input_error(err: InputTooLong | BlankInput) -> InputTooLong | BlankInput:
    """The engine's error (too long, or nothing the tokenizer keeps) for /similarity's text ``err.index`` (the
    source sentence first, then the sentences), naming it as the body does and as a blank one is named:
    'source_sentence', 'sentences[i]'."""
    return err.named("source_sentence" if err.index == 0 else f"sentences[{err.index - 1}]")


async def tokenize(body: schemas.TokenizeRequest, request: Request) -> Response:
    """TEI's /tokenize: each text's tokens (id, text, special, start, stop), not truncated."""
    service: Service = request.app.state.service
    service.require("embed")
    texts = service.engine.with_prompt(schemas.texts_of(body.inputs, service.settings.max_client_batch_size),
                                       body.prompt_name)
    return json_response(await service.offload(service.engine.tokenize_details, texts, body.add_special_tokens))


async def decode(body: schemas.DecodeRequest, request: Request) -> Response:
    """TEI's /decode: the text of each row of token ids."""
    service: Service = request.app.state.service
    service.require("embed")
    rows = schemas.id_rows(body.ids, service.settings.max_client_batch_size)
    return json_response(await service.offload(service.engine.decode, rows, body.skip_special_tokens))


async def token_level(service: Service, body: schemas.TokenLevelRequest, method: str,
                      timing: Timing) -> tuple[Any, int, int]:
    """The engine's ``method`` (token_embeddings or sparse) on the request's texts, in the model's thread between
    two batches (these forwards are not batched across requests), with their token and character counts."""
    service.require("embed")
    texts = schemas.texts_of(body.inputs, service.settings.max_client_batch_size)
    prompted = service.engine.with_prompt(texts, body.prompt_name)
    service.batcher.check_room()
    began = time.perf_counter()
    tokens = await service.offload(service.engine.encode, prompted, body.truncate, body.truncation_direction.lower(),
                                   texts)
    timing.tokenization = time.perf_counter() - began
    result = await service.batcher.call(getattr(service.engine, method), tokens,
                                        timeout=service.settings.request_timeout, timing=timing)
    return result, sum(len(t) for t in tokens), characters_of(texts)


async def embed_all(body: schemas.TokenLevelRequest, request: Request) -> Response:
    """TEI's /embed_all: each text's token embeddings (the last hidden states, special tokens included)."""
    timing = Timing()
    service: Service = request.app.state.service
    rows, count, given = await token_level(service, body, "token_embeddings", timing)
    return await service.offload(lambda: service.timed(json_response(rows), timing, count, given))


async def embed_sparse(body: schemas.TokenLevelRequest, request: Request) -> Response:
    """TEI's /embed_sparse: SPLADE weights (index, value) per text; needs a checkpoint with a masked-LM head."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("embed")
    if not service.has_mlm_head:
        raise WrongTask(f"/embed_sparse needs a checkpoint with a masked-LM head (SPLADE); {service.engine.model_dir} "
                        "has none")
    pairs, count, given = await token_level(service, body, "sparse", timing)
    answer = [[{"index": int(i), "value": float(v)} for i, v in zip(index, values, strict=True)]
              for index, values in pairs]
    return await service.offload(lambda: service.timed(json_response(answer), timing, count, given))


async def rerank(body: schemas.RerankRequest, request: Request) -> Response:
    """TEI's /rerank: the score of each text for the query, best first, with its index."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("rerank")
    schemas.check_text(body.query, "query")
    texts = schemas.texts_of(body.texts, service.settings.max_client_batch_size)
    pairs = [(body.query, text) for text in texts]
    try:
        logits, count = await service.rows(pairs, body.truncate, body.truncation_direction, timing)
    except BlankInput as err:  # named as the body names it (and a blank one): the query, or the text 'input i'
        raise err.named("query" if err.part == 0 else f"input {err.index}") from None
    scores = logits[:, 0] if body.raw_scores else torch.sigmoid(torch.from_numpy(logits[:, 0])).numpy()
    order = sorted(range(len(texts)), key=lambda i: -float(scores[i]))
    return service.timed(json_response([{"index": i, "score": float(scores[i]),
                                         **({"text": texts[i]} if body.return_text else {})} for i in order]),
                         timing, count, characters_of(pairs))


async def predict(body: schemas.PredictRequest, request: Request) -> Response:
    """TEI's /predict: labels with scores, best first, per text or pair (softmax; sigmoid for one label)."""
    timing = Timing()
    service: Service = request.app.state.service
    service.require("classify", "rerank")
    items, batched = schemas.predict_items(body.inputs, service.settings.max_client_batch_size)
    logits, count = await service.rows(items, body.truncate, body.truncation_direction, timing)
    values = torch.from_numpy(logits)
    if not body.raw_scores:
        values = torch.sigmoid(values) if values.shape[1] == 1 else torch.softmax(values, dim=1)
    labels = service.engine.labels
    answers = [sorted(({"label": labels[j], "score": float(row[j])} for j in range(len(labels))),
                      key=lambda item: -item["score"]) for row in values.tolist()]
    return service.timed(json_response(answers if batched else answers[0]), timing, count, characters_of(items))


async def health(request: Request) -> Response:
    service: Service = request.app.state.service
    if not service.batcher.ready.is_set():  # a readiness probe: not before the warm-up forwards have run
        failed = service.batcher.warmup_error is not None or not service.batcher.thread.is_alive()
        return json_response({"status": "unavailable" if failed else "warming up"}, status=503)
    if not service.batcher.accepting or not service.batcher.thread.is_alive():
        return json_response({"status": "unavailable"}, status=503)
    return json_response({"status": "ok"})


async def info(request: Request) -> Response:
    return json_response(request.app.state.service.info())


async def metrics(request: Request) -> Response:
    return Response(request.app.state.service.metrics.exposition(), media_type=CONTENT_TYPE)


# ------------------------------------------------------------------------------------------------- errors
def error_response(path: str, status: int, message: str, kind: str, headers: dict[str, str] | None = None
                   ) -> Response:
    """An error in the shape of the route's API: OpenAI's under /v1, TEI's elsewhere."""
    if path.startswith("/v1") or path == "/embeddings":
        body: dict = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    else:
        body = {"error": message, "error_type": kind}
    return json_response(body, status=status, headers=headers)


def validation_message(err: RequestValidationError) -> str:
    """pydantic's errors as one line: 'inputs: Input should be a valid string; ...'."""
    parts = []
    for item in err.errors()[:5]:
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        if item.get("type") == "json_invalid":
            parts.append("the body is not valid JSON")
        elif item.get("type") == "missing" and not where:
            parts.append("the body is empty: send a JSON object")
        else:
            parts.append(f"{where or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body"


def read_as_json(content_type: str) -> bool:
    """Whether FastAPI reads a body sent with this Content-Type as JSON: application/json or application/*+json, in
    any case, with any parameters. Any other body fails validation as if it were missing."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def answer_error(request: Request, err: Exception) -> Response:
    path = request.url.path
    if isinstance(err, RequestValidationError):
        message = validation_message(err)
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not read_as_json(content_type):
            message = f"send the body with 'Content-Type: application/json' (it came as {content_type or 'none'}); " \
                      + message
        return error_response(path, 422, message, "Validation")
    if isinstance(err, HTTPException):
        if err.status_code == 400 and isinstance(err.__cause__, RecursionError):
            # FastAPI's answer when json.loads fails other than with a JSONDecodeError: nested deeper than
            # Python's recursion limit lets it parse
            return error_response(path, 422, "the body is not valid JSON: it is nested too deeply to parse",
                                  "Validation")
        return error_response(path, err.status_code, str(err.detail), "Http", headers=err.headers)
    if isinstance(err, WrongTask):
        return error_response(path, 400, str(err), "WrongTask")
    status, kind = next(v for k, v in ERRORS.items() if isinstance(err, k))
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return error_response(path, status, str(err), kind, headers)


# ------------------------------------------------------------------------------------------ the gate
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class Gate:
    """ASGI middleware in front of the routes: the API key (a bearer token compared in constant time), a full queue
    (429) or a stopping server (503) before the body is read or parsed (the refusal costs the event loop, which
    the answers of the admitted requests wait for, as little as it can), the body limit (by Content-Length before
    reading, by bytes while reading) and UTF-8 check before any parsing, and the request metrics (status and
    latency per route)."""

    def __init__(self, app: Callable, service: Service):
        self.app, self.service = app, service
        key = service.settings.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, seen = time.perf_counter(), {"status": 500}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            await send(message)

        path = scope["path"]
        try:
            refusal = self.refuse_unauthorized(scope)
            if refusal is None and path in QUEUED_ROUTES and scope["method"] == "POST":
                refusal = self.refuse_when_full(path)
            body = b""
            if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body, refusal = await self.read_body(scope, receive)
            if refusal is not None:
                await refusal(scope, receive, send_and_note)
            else:
                await self.app(scope, replay(body, receive), send_and_note)
        finally:
            endpoint = path if path in ROUTES else "other"
            self.service.metrics.record_request(endpoint, seen["status"], time.perf_counter() - start)

    def refuse_unauthorized(self, scope: dict) -> Response | None:
        if self.key is None or scope["path"] in OPEN_PATHS:
            return None
        scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        # the scheme is case-insensitive (RFC 9110, 11.1); the key is compared in constant time
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return None
        return error_response(scope["path"], 401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                              "Unauthorized", headers={"WWW-Authenticate": "Bearer"})

    def refuse_when_full(self, path: str) -> Response | None:
        """429 while the queue is full, 503 once stopping: the refusals the handler would give later."""
        try:
            self.service.batcher.check_room()
        except (QueueFull, ShuttingDown) as err:
            status, kind = ERRORS[type(err)]
            return error_response(path, status, str(err), kind, headers={"Retry-After": "1"})
        return None

    async def read_body(self, scope: dict, receive: Receive) -> tuple[bytes, Response | None]:
        """The whole body, or a 413 as soon as it is known to pass the limit; a 415 for a compressed body (any
        Content-Encoding but identity), before it is read; a 422 for a body that is not UTF-8."""
        limit, path = self.service.settings.max_body_bytes, scope["path"]
        headers = dict(scope["headers"])
        encoding = headers.get(b"content-encoding", b"").decode("latin-1").strip()
        if encoding and encoding.lower() != "identity":
            return b"", error_response(path, 415, f"Content-Encoding {encoding} is not supported: send the body "
                                       "uncompressed", "Validation", headers={"Accept-Encoding": "identity"})
        too_big = error_response(path, 413, f"the body is larger than the limit of {plural(limit, 'byte')}",
                                 "Validation")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return b"", too_big
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_big
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as err:
            return b"", error_response(path, 422, f"the body is not valid UTF-8 (byte {err.start})", "Validation")
        return body, None


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then whatever the client sends next (a disconnect)."""
    sent = False

    async def receive_again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def settings_dict(settings: ServeSettings) -> dict[str, Any]:
    """The settings without the API key (what a log line or a results file may show)."""
    return {k: ("***" if k == "api_key" and v else v) for k, v in asdict(settings).items()}
