"""Embedding a corpus: texts stream in, one embedding per input row streams out, in input order.

The pieces, each usable on its own (`fastbert embed` and `fastbert.embedding.ray` put them together):

- `read_rows`: a text file (one text per line), JSONL with a text field, or stdin, read lazily. Every input line
  is one `Row`; a blank text is a row with ``text=None`` (its result is an explicit null), never a skipped line.
  Input that cannot be read (bad UTF-8, bad JSON, a missing or non-string field) raises `InputError` naming the
  line.
- `Embedder`: tokenizer + fastbert model. `Embedder.embed(texts)` tokenizes a window of texts, sorts them by
  length, cuts batches by a token budget (``max_batch_tokens`` = batch size x longest sequence of the batch), runs
  the padding-free encoder, pools (mean or cls), normalises, and returns the rows in the order given.
- Writers: JSONL (``{"id", "embedding"}``), ``.npy`` (float32 or float16; a null row is NaN), Parquet (``id``
  and ``embedding`` columns; a null row is null). `ShardedOutput` writes one file per window into a directory with
  a manifest, each file and the manifest written atomically, so a run killed at any moment resumes
  (`run(resume=True)`) with no row missing or repeated.
- `run`: the loop over windows of rows with a progress line and a summary; memory is bounded by the window
  (``window_rows`` texts and their embeddings), not by the corpus.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastbert.common.resolve import UserError
from fastbert.common.text import mean_pool
from fastbert.files import write_atomic

FORMATS = ("jsonl", "npy", "parquet")
POOLINGS = ("mean", "cls")
MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 16384}


class InputError(UserError):
    """A row of the input that cannot be embedded (the message names its line)."""


class NonFiniteEmbedding(ValueError):
    """Rows (indices into the texts given) whose embedding holds NaN or Inf."""

    def __init__(self, rows: list[int]):
        super().__init__(f"non-finite embeddings at rows {rows[:10]}")
        self.rows = rows


# ------------------------------------------------------------------------------------------------------ input
@dataclass
class Row:
    """One input line: ``line`` is its 1-based line number, ``id`` the id written with its embedding (the JSONL
    id field's value, else the line number), ``text`` None for a blank text (its embedding is null)."""

    line: int
    id: int | str
    text: str | None


class ByteCounter:
    """Wraps a binary stream and counts the bytes read (the progress line's fraction of a file)."""

    def __init__(self, stream):
        self.stream = stream
        self.bytes_read = 0

    def __iter__(self) -> Iterator[bytes]:
        for line in self.stream:
            self.bytes_read += len(line)
            yield line


def open_input(path: str) -> tuple[ByteCounter, int | None, str]:
    """The byte stream of ``path`` ('-' for stdin), its size when known, and a name for messages."""
    if path == "-":
        return ByteCounter(sys.stdin.buffer), None, "<stdin>"
    if not os.path.exists(path):
        raise UserError(f"input file {path} does not exist")
    if os.path.isdir(path):
        raise UserError(f"input {path} is a directory, not a file")
    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed by read_rows' caller through the generator's end
    except OSError as err:
        raise UserError(f"cannot read input file {path}: {err.strerror}") from err
    size = os.fstat(stream.fileno()).st_size
    return ByteCounter(stream), (size if size > 0 else None), path


def read_rows(lines: Iterable[bytes], input_format: str = "text", text_field: str = "text",
              id_field: str | None = None, name: str = "<input>") -> Iterator[Row]:
    """Rows of a text or JSONL input, lazily. ``lines``: raw lines (bytes, with or without their newline).

    text: one text per line, a blank line is a null row. jsonl: one JSON object per line whose ``text_field`` is a
    string (blank or null: a null row); ``id_field``, when given, names each row's id (else the line number). A
    blank JSONL line is a null row too, so line numbers and rows stay aligned. Anything else raises `InputError`
    with ``name:line``."""
    if input_format not in ("text", "jsonl"):
        raise ValueError(f"input format must be 'text' or 'jsonl', got {input_format!r}")
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise InputError(f"{name}:{number}: not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 4]!r});"
                             " re-encode the file as UTF-8") from err
        line = line.rstrip("\r\n")
        if number == 1:
            line = line.removeprefix("\ufeff")  # a byte order mark is not part of the first text
        if input_format == "text":
            yield Row(number, number, line if line.strip() else None)
            continue
        if not line.strip():
            yield Row(number, number, None)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{name}:{number}: not valid JSON ({err.msg} at column {err.colno})") from err
        if not isinstance(record, dict):
            raise InputError(f"{name}:{number}: expected a JSON object, got {type(record).__name__}")
        if text_field not in record:
            raise InputError(f"{name}:{number}: the object has no field {text_field!r} (fields: "
                             f"{', '.join(list(record)[:8]) or 'none'}); choose one with --field")
        text = record[text_field]
        if text is not None and not isinstance(text, str):
            raise InputError(f"{name}:{number}: field {text_field!r} holds {type(text).__name__}, not a string")
        row_id: int | str = number
        if id_field is not None:
            if id_field not in record:
                raise InputError(f"{name}:{number}: the object has no id field {id_field!r}")
            value = record[id_field]
            if not isinstance(value, (int, str)) or isinstance(value, bool):
                raise InputError(f"{name}:{number}: id field {id_field!r} must be a string or an integer, got "
                                 f"{type(value).__name__}")
            row_id = value
        yield Row(number, row_id, text if text and text.strip() else None)


# ---------------------------------------------------------------------------------------------------- embedder
@dataclass
class EmbedStats:
    """Counts over a run (or one `Embedder.embed` call)."""

    rows: int = 0
    embedded: int = 0
    null_rows: int = 0
    truncated: int = 0
    tokens: int = 0
    batches: int = 0
    truncated_lines: list[int] = field(default_factory=list)  # the first few, for the warning

    def add(self, other: EmbedStats) -> None:
        for name in ("rows", "embedded", "null_rows", "truncated", "tokens", "batches"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.truncated_lines.extend(other.truncated_lines[: max(0, 10 - len(self.truncated_lines))])


def sentence_transformers_head(model_dir: str) -> tuple[str | None, bool | None]:
    """The pooling ("mean" or "cls") and normalisation a sentence-transformers checkpoint declares
    (``modules.json``: its Pooling module's ``config.json``, a Normalize module), None where it declares nothing.
    A pooling fastbert does not implement (max, mean-sqrt-len, weighted mean, last token) raises UserError."""
    path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(path):
        return None, None
    try:
        with open(path) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None, None
    types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(t.endswith(".Normalize") for t in types)
    pooling = None
    for module in modules:
        if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
            try:
                with open(os.path.join(model_dir, module.get("path", ""), "config.json")) as f:
                    settings = json.load(f)
            except (OSError, ValueError):
                break
            modes = sorted(k.removeprefix("pooling_mode_") for k, v in settings.items()
                           if k.startswith("pooling_mode_") and v is True)
            if modes == ["mean_tokens"]:
                pooling = "mean"
            elif modes == ["cls_token"]:
                pooling = "cls"
            else:
                raise UserError(f"{model_dir} pools with {', '.join(modes) or 'nothing'} (sentence-transformers' "
                                "1_Pooling); fastbert embed pools mean or cls: give --pooling to choose one")
    return pooling, normalize


def default_max_length(model_dir: str, model_limit: int) -> int:
    """sentence-transformers' ``max_seq_length`` when the checkpoint has one (all-MiniLM-L6-v2: 256), else the
    model's position limit."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                value = json.load(f).get("max_seq_length")
        except (OSError, ValueError):
            value = None
        if isinstance(value, int) and value > 0:
            return min(value, model_limit)
    return model_limit


class Embedder:
    """A checkpoint's tokenizer and fastbert model, embedding lists of texts with token-budget batching.

    pooling: "mean" (over real tokens) or "cls" (the first token's vector); normalize: L2-normalise each embedding;
    both default to what the checkpoint's sentence-transformers files declare (``modules.json``, ``1_Pooling``,
    a Normalize module), else mean and normalised. max_length: tokens per text after truncation (default: the
    checkpoint's sentence-transformers ``max_seq_length``, else the model's limit); a longer text is truncated and
    counted.
    max_batch_tokens: a batch holds at most this many tokens counted padded (texts x longest text of the batch;
    texts are sorted by length first, so padding is small); default `DEFAULT_BATCH_TOKENS` of the device, at least
    max_length. max_batch_size caps the texts per batch."""

    def __init__(self, model_dir: str | None = None, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, backend: str = "auto", pooling: str | None = None,
                 normalize: bool | None = None, max_length: int | None = None, max_batch_tokens: int | None = None,
                 max_batch_size: int | None = None, load_model: bool = True):
        import fastbert
        from fastbert.common.resolve import resolve_device, resolve_dtype, resolve_model

        self.model_dir, self.config = resolve_model(model_dir)
        if pooling is None or normalize is None:
            declared_pooling, declared_normalize = sentence_transformers_head(self.model_dir) if pooling is None else (
                pooling, None)
            pooling = pooling or declared_pooling or "mean"
            normalize = normalize if normalize is not None else (
                declared_normalize if declared_normalize is not None else True)
        if pooling not in POOLINGS:
            raise UserError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        # A Ray driver (load_model=False) may name a device only its actors have.
        self.device = (resolve_device(None if device is None else str(device)) if load_model
                       else torch.device(str(device) if device is not None else "cpu"))
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).replace("torch.", "")
        self.dtype = resolve_dtype(dtype or "float32", self.device)
        model_limit = self.config.max_position_embeddings - (self.config.position_offset or 0)
        self.max_length = default_max_length(self.model_dir, model_limit) if max_length is None else max_length
        if not 1 <= self.max_length <= model_limit:
            raise UserError(f"--max-length must lie in [1, {model_limit}] for this model, got {self.max_length}")
        if max_batch_tokens is None:  # CPU: smaller batches stay in cache (4096 measured ~6 % faster than 8192 on
            # all-MiniLM-L6-v2, 2 cores); GPU: bigger batches fill the device. Never below one longest text.
            max_batch_tokens = max(DEFAULT_BATCH_TOKENS[self.device.type], self.max_length)
        if max_batch_tokens < self.max_length:
            raise UserError(f"--max-batch-tokens ({max_batch_tokens}) must be at least --max-length "
                            f"({self.max_length}): one text of the longest kind must fit in a batch")
        if max_batch_size is not None and max_batch_size < 1:
            raise UserError("--batch-size must be >= 1")
        self.pooling, self.normalize = pooling, normalize
        self.max_batch_tokens, self.max_batch_size = max_batch_tokens, max_batch_size
        self.dimension = self.config.hidden_size
        self.uses_token_types = bool(self.config.type_vocab_size)
        self.model = None  # a Ray driver (load_model=False) reads the settings and width only: the actors hold models
        if load_model:
            try:
                self.model = fastbert.from_pretrained(self.model_dir, dtype=self.dtype, device=self.device,
                                                      backend=backend).eval()
            except ValueError as err:  # CheckpointError, an unsupported family
                raise UserError(f"{self.model_dir}: {err}") from err
        self._load_tokenizer()

    def _load_tokenizer(self) -> None:
        path = os.path.join(self.model_dir, "tokenizer.json")
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(path)
            except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
                raise UserError(f"{path} is not a tokenizer file the tokenizers library can read ({err})") from err
            tokenizer.no_padding()
            tokenizer.enable_truncation(max_length=self.max_length)
            self._tokenizer, self._hf_tokenizer = tokenizer, None
            return
        try:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        except Exception as err:  # noqa: BLE001 - any failure means: no usable tokenizer there
            raise UserError(f"{self.model_dir} has no tokenizer.json and transformers cannot load a tokenizer from "
                            f"it ({type(err).__name__})") from err
        self._tokenizer = None

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each text (special tokens added, truncated to max_length) and whether it was truncated."""
        if self._tokenizer is not None:
            encodings = self._tokenizer.encode_batch(list(texts))
            return [e.ids for e in encodings], [bool(e.overflowing) for e in encodings]
        full = self._hf_tokenizer(list(texts), truncation=False)["input_ids"]
        cut = self._hf_tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        return cut, [len(ids) > self.max_length for ids in full]

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of the texts, longest first, cut into batches of at most max_batch_tokens padded tokens."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        for index in order:
            longest = lengths[current[0]] if current else lengths[index]
            full = self.max_batch_size is not None and len(current) >= self.max_batch_size
            if current and (full or (len(current) + 1) * longest > self.max_batch_tokens):
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
        return batches

    def _forward(self, token_lists: Sequence[list[int]]) -> torch.Tensor:
        """Pooled (and normalised) embeddings [n, H] float32 on the CPU of one batch of token lists."""
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(tokens) for tokens in token_lists], batch_first=True,
                                              padding_value=self.config.pad_token_id)
        lengths = torch.tensor([len(tokens) for tokens in token_lists])
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0].float()
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            else:
                pooled = mean_pool(hidden, inputs["attention_mask"], normalize=self.normalize)
        return pooled.cpu()

    def embed(self, texts: Sequence[str | None], lines: Sequence[int] | None = None) -> tuple[np.ndarray, EmbedStats]:
        """Embeddings [len(texts), H] float32 in the order given; a None text gives a row of NaN (a null result).
        ``lines`` (the texts' line numbers) name truncated texts in the stats and rows in errors. A real text whose
        embedding is not finite (an overflow in float16, say) raises `InputError` naming its lines."""
        try:
            embeddings, stats, per_row = self.embed_rows(texts)
        except NonFiniteEmbedding as err:
            named = [lines[i] if lines is not None else i + 1 for i in err.rows]
            raise InputError(f"line{'s' if len(named) > 1 else ''} {', '.join(map(str, named[:10]))}: the embedding "
                             f"is not finite (NaN or Inf; with --dtype float16 try float32)") from err
        cut = np.flatnonzero(per_row["truncated"])
        stats.truncated_lines = [(lines[i] if lines is not None else int(i) + 1) for i in cut[:10]]
        return embeddings, stats

    def embed_rows(self, texts: Sequence[str | None]) -> tuple[np.ndarray, EmbedStats, dict[str, np.ndarray]]:
        """`embed`, plus per row: ``tokens`` (int64, 0 for a null row) and ``truncated`` (bool)."""
        stats = EmbedStats(rows=len(texts))
        out = np.full((len(texts), self.dimension), np.nan, dtype=np.float32)
        per_row = {"tokens": np.zeros(len(texts), dtype=np.int64), "truncated": np.zeros(len(texts), dtype=bool)}
        present = [i for i, text in enumerate(texts) if text is not None]
        stats.null_rows = len(texts) - len(present)
        if not present:
            return out, stats, per_row
        token_lists, truncated = self.tokenize([texts[i] for i in present])
        lengths = [len(ids) for ids in token_lists]
        for batch in self.batches(lengths):
            out[[present[i] for i in batch]] = self._forward([token_lists[i] for i in batch]).numpy()
            stats.batches += 1
        bad = [present[i] for i in range(len(present)) if not np.isfinite(out[present[i]]).all()]
        if bad:  # a NaN would read as a null row, and NaN/Inf is not JSON: never write one as an embedding
            raise NonFiniteEmbedding(bad)
        per_row["tokens"][present] = lengths
        per_row["truncated"][present] = truncated
        stats.embedded, stats.tokens, stats.truncated = len(present), sum(lengths), sum(truncated)
        return out, stats, per_row

    def settings(self) -> dict:
        """What determines the numbers written (a resumed run must match them)."""
        return {"model_dir": os.path.realpath(self.model_dir), "model_config": _config_digest(self.model_dir),
                "dtype": str(self.dtype).replace("torch.", ""), "pooling": self.pooling,
                "normalize": self.normalize, "max_length": self.max_length}


def _config_digest(model_dir: str) -> str:
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------- writers
def _null_rows(embeddings: np.ndarray) -> np.ndarray:
    return np.isnan(embeddings[:, 0]) if embeddings.shape[1] else np.zeros(len(embeddings), dtype=bool)


def jsonl_bytes(ids: Sequence[int | str], embeddings: np.ndarray) -> bytes:
    """``{"id": ..., "embedding": [...]}`` per row (null for a null row); 9 significant digits, which give back
    float32 values exactly."""
    formatted = np.char.mod("%.9g", embeddings) if embeddings.size else np.empty(embeddings.shape, dtype=str)
    null = _null_rows(embeddings)
    lines = []
    for row_id, values, is_null in zip(ids, formatted, null, strict=True):
        vector = "null" if is_null else "[" + ",".join(values) + "]"
        lines.append(f'{{"id": {json.dumps(row_id)}, "embedding": {vector}}}\n')
    return "".join(lines).encode()


class NpyWriter:
    """A ``.npy`` file [rows, H] written as rows arrive: a header sized for any row count is written first and
    rewritten with the count after every append, so the file loads (with the rows so far) between appends."""

    HEADER_BYTES = 128

    def __init__(self, stream, dimension: int, dtype: np.dtype):
        self.stream, self.dimension, self.dtype, self.rows = stream, dimension, np.dtype(dtype), 0
        self._write_header()

    def _write_header(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, self.dimension)}
        text = repr(header).encode("latin1")
        padding = self.HEADER_BYTES - 10 - len(text) - 1
        self.stream.seek(0)
        self.stream.write(b"\x93NUMPY\x01\x00" + (self.HEADER_BYTES - 10).to_bytes(2, "little") + text
                          + b" " * padding + b"\n")

    def append(self, embeddings: np.ndarray) -> None:
        self.stream.seek(0, io.SEEK_END)
        self.stream.write(np.ascontiguousarray(embeddings, dtype=self.dtype).tobytes())
        self.rows += len(embeddings)
        self._write_header()
        self.stream.flush()


def npy_bytes(embeddings: np.ndarray, dtype: np.dtype) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(embeddings, dtype=dtype))
    return buffer.getvalue()


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise UserError("Parquet output needs pyarrow (pip install 'fastbert[embed]')") from err
    return pyarrow


def parquet_table(ids: Sequence[int | str], embeddings: np.ndarray, dtype: np.dtype, string_ids: bool):
    """A pyarrow table: ``id`` (string when ``string_ids``, else int64) and ``embedding`` (list of float32/float16;
    null rows null)."""
    pa = _pyarrow()
    null = _null_rows(embeddings)
    values = pa.array(np.ascontiguousarray(embeddings, dtype=dtype).reshape(-1))
    offsets = pa.array(np.arange(0, embeddings.size + 1, max(embeddings.shape[1], 1), dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, values, mask=pa.array(null))
    id_column = pa.array([str(i) for i in ids], pa.string()) if string_ids else pa.array(list(ids), pa.int64())
    return pa.table({"id": id_column, "embedding": column})


class FileOutput:
    """One output file (or stdout for JSONL), written as windows arrive. JSONL and .npy are valid after every
    window; Parquet when closed (a row group per window). Same interface as `ShardedOutput`: ``write``,
    ``rows_done``, ``close``, ``describe``."""

    def __init__(self, path: str | None, output_format: str, dimension: int, dtype: np.dtype,
                 string_ids: bool = False):
        self.path, self.format, self.dimension, self.dtype = path, output_format, dimension, np.dtype(dtype)
        self.string_ids, self.rows_done = string_ids, 0
        if path is None:
            if output_format != "jsonl":
                raise UserError(f"{output_format} output needs --output FILE (stdout takes JSONL only)")
            self.stream = sys.stdout.buffer
        else:
            try:
                self.stream = open(path, "w+b" if output_format == "npy" else "wb")  # noqa: SIM115 - closed in close()
            except OSError as err:
                raise UserError(f"cannot write {path}: {err.strerror}") from err
        self._npy = NpyWriter(self.stream, dimension, self.dtype) if output_format == "npy" else None
        self._parquet = None

    def write(self, ids: Sequence[int | str], embeddings: np.ndarray, stats: EmbedStats | None = None) -> None:
        if self.format == "jsonl":
            self.stream.write(jsonl_bytes(ids, embeddings))
            self.stream.flush()
        elif self.format == "npy":
            self._npy.append(embeddings)
        else:
            table = parquet_table(ids, embeddings, self.dtype, self.string_ids)
            if self._parquet is None:
                self._parquet = _pyarrow().parquet.ParquetWriter(self.stream, table.schema)
            self._parquet.write_table(table)
        self.rows_done += len(ids)

    def close(self, stats: EmbedStats | None = None) -> None:
        """Finish the file (whether or not the run completed: what was written stays valid)."""
        if self.format == "parquet":
            if self._parquet is None:  # no rows: still a valid, empty file
                table = parquet_table([], np.zeros((0, self.dimension), dtype=np.float32), self.dtype,
                                      self.string_ids)
                self._parquet = _pyarrow().parquet.ParquetWriter(self.stream, table.schema)
            self._parquet.close()
        if self.stream is not sys.stdout.buffer:
            self.stream.close()
        else:
            self.stream.flush()

    def describe(self) -> str:
        return self.path or "stdout"


class ShardedOutput:
    """A directory of shards, one per window (``part-000000.<format>``), and ``manifest.json``: the settings of
    the run, each shard's first row and row count, the counts so far, and whether the run completed. Each shard,
    then the manifest, is written atomically, so the manifest never names a missing or partial shard: a run killed
    at any moment resumes after the last shard the manifest lists."""

    def __init__(self, directory: str, output_format: str, dimension: int, dtype: np.dtype, settings: dict,
                 resume: bool, string_ids: bool = False):
        self.directory, self.format, self.string_ids = Path(directory), output_format, string_ids
        self.dimension, self.dtype = dimension, np.dtype(dtype)
        self.settings = {**settings, "format": output_format, "output_dtype": self.dtype.name,
                         "dimension": dimension, "string_ids": string_ids}
        manifest_path = self.directory / MANIFEST
        if self.directory.exists() and not self.directory.is_dir():
            raise UserError(f"--output-dir {directory} exists and is not a directory")
        self.manifest = {"version": MANIFEST_VERSION, "settings": self.settings, "shards": [], "stats": {},
                         "complete": False}
        if resume:
            if not manifest_path.is_file():
                raise UserError(f"--resume: {directory} holds no {MANIFEST} (nothing to resume; run without --resume)")
            with open(manifest_path) as f:
                found = json.load(f)
            changed = {k: (found["settings"].get(k), v) for k, v in self.settings.items()
                       if found["settings"].get(k) != v}
            if changed:
                raise UserError("--resume with other settings than the interrupted run: " + "; ".join(
                    f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items()))
            self.manifest = found
        elif manifest_path.exists() or any(self.directory.glob("part-*")):
            raise UserError(f"--output-dir {directory} already holds a run ({MANIFEST} or part-* files); use --resume "
                            "to continue it, or another directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".*.tmp-*"):  # a write cut short by a kill
            leftover.unlink()

    def stats(self) -> EmbedStats:
        """The counts of the shards written so far (where a resumed run starts counting)."""
        known = {k: v for k, v in self.manifest["stats"].items() if k in EmbedStats.__dataclass_fields__}
        return EmbedStats(**known)

    @property
    def rows_done(self) -> int:
        return sum(shard["rows"] for shard in self.manifest["shards"])

    def write(self, ids: Sequence[int | str], embeddings: np.ndarray, stats: EmbedStats) -> None:
        """One shard, then the manifest with the counts so far (``stats``: the whole run's, resumed part included)."""
        index = len(self.manifest["shards"])
        name = f"part-{index:06d}.{self.format}"
        if self.format == "jsonl":
            data = jsonl_bytes(ids, embeddings)
        elif self.format == "npy":
            data = npy_bytes(embeddings, self.dtype)
            # the ids of a .npy shard: its rows' ids, in a JSON file beside it (written before the manifest)
            write_atomic(self.directory / f"part-{index:06d}.ids.json", json.dumps(list(ids)).encode())
        else:
            buffer = io.BytesIO()
            _pyarrow().parquet.write_table(parquet_table(ids, embeddings, self.dtype, self.string_ids), buffer)
            data = buffer.getvalue()
        write_atomic(self.directory / name, data)
        self.manifest["shards"].append({"file": name, "first_row": self.rows_done, "rows": len(ids)})
        self.manifest["stats"] = {k: v for k, v in asdict(stats).items() if k != "truncated_lines"}
        self._save_manifest()

    def close(self, stats: EmbedStats | None = None) -> None:
        """Mark the run complete with its final ``stats``; None (the run stopped early): leave it resumable."""
        if stats is None:
            return
        self.manifest["stats"] = {k: v for k, v in asdict(stats).items() if k != "truncated_lines"}
        self.manifest["complete"] = True
        self._save_manifest()

    def _save_manifest(self) -> None:
        write_atomic(self.directory / MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())

    def describe(self) -> str:
        return f"{self.directory}/ ({len(self.manifest['shards'])} shards + {MANIFEST})"


def read_output(directory: str | os.PathLike) -> tuple[list[int | str], np.ndarray]:
    """The ids and embeddings [rows, H] of a sharded output directory, in input order (null rows are NaN)."""
    directory = Path(directory)
    with open(directory / MANIFEST) as f:
        manifest = json.load(f)
    ids: list[int | str] = []
    parts = []
    for shard in manifest["shards"]:
        path = directory / shard["file"]
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            ids += [r["id"] for r in rows]
            dim = manifest["settings"]["dimension"]
            parts.append(np.array([r["embedding"] if r["embedding"] is not None else [np.nan] * dim for r in rows],
                                  dtype=np.float32).reshape(len(rows), dim))
        elif path.suffix == ".npy":
            parts.append(np.load(path).astype(np.float32))
            ids += json.loads(path.with_name(path.stem + ".ids.json").read_text())
        else:
            table = _pyarrow().parquet.read_table(path)
            ids += table.column("id").to_pylist()
            dim = manifest["settings"]["dimension"]
            parts.append(np.array([v if v is not None else [np.nan] * dim
                                   for v in table.column("embedding").to_pylist()], dtype=np.float32).reshape(-1, dim))
    dimension = manifest["settings"]["dimension"]
    return ids, (np.concatenate(parts) if parts else np.zeros((0, dimension), dtype=np.float32))


# ---------------------------------------------------------------------------------------------------- progress
class Progress:
    """A progress line on stderr: rows, texts/s, tokens/s, and with a known input size the fraction done and an
    ETA. On a terminal it redraws one line (at most 4 times a second); otherwise it prints a line every
    ``log_every`` seconds."""

    def __init__(self, total_bytes: int | None, enabled: bool, stream=None, log_every: float = 10.0,
                 initial: EmbedStats | None = None):
        self.stream = stream or sys.stderr
        # a resumed run: rates and the ETA count this run's work only
        self.initial = initial or EmbedStats()
        self.enabled, self.total_bytes = enabled, total_bytes
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = 0.25 if self.tty else log_every
        self.start = time.perf_counter()
        self.last = 0.0

    def update(self, stats: EmbedStats, bytes_read: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last < self.interval:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        parts = []
        if self.total_bytes:
            fraction = min(bytes_read / self.total_bytes, 1.0)
            filled = int(fraction * 24)
            parts.append(f"[{'#' * filled}{'.' * (24 - filled)}] {fraction:4.0%}")
        parts.append(f"{stats.rows:,} rows")
        parts.append(f"{(stats.embedded - self.initial.embedded) / elapsed:,.0f} texts/s")
        parts.append(f"{(stats.tokens - self.initial.tokens) / elapsed:,.0f} tokens/s")
        if self.total_bytes and 0 < bytes_read < self.total_bytes:
            remaining = elapsed * (self.total_bytes - bytes_read) / bytes_read
            parts.append(f"ETA {int(remaining // 60)}:{int(remaining % 60):02d}")
        line = "fastbert embed: " + "  ".join(parts)
        self.stream.write(("\r" + line + "\033[K") if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------------------- run
def windows(rows: Iterator[Row], size: int) -> Iterator[tuple[list[Row], InputError | None]]:
    """Rows in windows of ``size``; an `InputError` ends the stream after a last window of the rows before it."""
    window: list[Row] = []
    while True:
        try:
            row = next(rows)
        except StopIteration:
            break
        except InputError as err:
            yield window, err
            return
        window.append(row)
        if len(window) == size:
            yield window, None
            window = []
    if window:
        yield window, None


def skip_rows(rows: Iterator[Row], count: int) -> None:
    """Consume ``count`` rows (a resumed run passes over what the manifest says is done)."""
    for _ in range(count):
        try:
            next(rows)
        except StopIteration as err:
            raise UserError(f"--resume: the input has fewer rows than the {count} already written; is it the same "
                            "input?") from err


def run(embedder, rows: Iterator[Row], output, window_rows: int = 2048, progress: Progress | None = None,
        bytes_read=lambda: 0, blank: str = "null", initial: EmbedStats | None = None) -> EmbedStats:
    """Embed ``rows`` window by window into ``output`` (`FileOutput` or `ShardedOutput`), in input order.
    ``embedder``: anything with ``embed(texts, lines) -> (embeddings, EmbedStats)``. blank: "null" (a null row)
    or "error" (stop at the first blank text with its line number). Input errors stop the run after the rows
    before them are written; they are raised after."""
    if window_rows < 1:
        raise UserError("--window-rows must be >= 1")
    total = initial or EmbedStats()
    pending_error: InputError | None = None
    for window, error in windows(rows, window_rows):
        if blank == "error":
            for position, row in enumerate(window):
                if row.text is None:
                    window, error = window[:position], InputError(f"line {row.line}: blank text (--on-blank error)")
                    break
        if window:
            embeddings, stats = embedder.embed([r.text for r in window], [r.line for r in window])
            total.add(stats)
            output.write([r.id for r in window], embeddings, total)
            if progress is not None:
                progress.update(total, bytes_read())
        if error is not None:
            pending_error = error
            break
    if progress is not None:
        progress.update(total, bytes_read(), force=True)
        progress.close()
    if pending_error is not None:
        raise pending_error
    return total
