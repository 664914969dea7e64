"""The output formats' encodings of ids and embeddings: JSONL (``{"id", "embedding"}`` per row), ``.npy``
(float32 or float16; a null row is NaN) and Parquet (``id`` and ``embedding`` columns; a null row is null).

pyarrow is imported when a Parquet table is built (`import_pyarrow`), so the other formats do not need it."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

from fastbert.common.resolve import UserError

FORMATS = ("jsonl", "npy", "parquet")


def null_rows(embeddings: np.ndarray) -> np.ndarray:
    """Which rows are null (a blank text's row: NaN)."""
    return np.isnan(embeddings[:, 0]) if embeddings.shape[1] else np.zeros(len(embeddings), dtype=bool)


def jsonl_bytes(ids: Sequence[int | str], embeddings: np.ndarray) -> bytes:
    """``{"id": ..., "embedding": [...]}`` per row (null for a null row); 9 significant digits, which give back
    float32 values exactly."""
    formatted = np.char.mod("%.9g", embeddings) if embeddings.size else np.empty(embeddings.shape, dtype=str)
    lines = []
    for row_id, values, is_null in zip(ids, formatted, null_rows(embeddings), strict=True):
        vector = "null" if is_null else "[" + ",".join(values) + "]"
        lines.append(f'{{"id": {json.dumps(row_id)}, "embedding": {vector}}}\n')
    return "".join(lines).encode()


def npy_bytes(embeddings: np.ndarray, dtype: np.dtype) -> bytes:
    """A whole ``.npy`` file of ``embeddings`` as ``dtype``."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(embeddings, dtype=dtype))
    return buffer.getvalue()


def write_fully(stream: BinaryIO, data: bytes) -> None:
    """Write all of ``data``. A buffered stream whose reader went away (a closed pipe) or whose disk filled up
    mid-write can return a short count without raising: the rest is written again, which raises the error."""
    view = memoryview(data)
    while view:
        written = stream.write(view)
        if not written:
            raise OSError(f"wrote nothing of the last {len(view)} bytes")
        view = view[written:]


class NpyWriter:
    """A ``.npy`` file [rows, H] written as rows arrive: a header sized for any row count is written first and
    rewritten with the count after every append, so the file loads (with the rows so far) between appends."""

    HEADER_BYTES = 128

    def __init__(self, stream: BinaryIO, dimension: int, dtype: np.dtype):
        self.stream, self.dimension, self.dtype, self.rows = stream, dimension, np.dtype(dtype), 0
        self._write_header()

    def _write_header(self) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.rows, self.dimension)}
        text = repr(header).encode("latin1")
        padding = self.HEADER_BYTES - 10 - len(text) - 1
        self.stream.seek(0)
        write_fully(self.stream, b"\x93NUMPY\x01\x00" + (self.HEADER_BYTES - 10).to_bytes(2, "little") + text
                    + b" " * padding + b"\n")

    def append(self, embeddings: np.ndarray) -> None:
        """Add rows at the end, then rewrite the header with the new count."""
        self.stream.seek(0, io.SEEK_END)
        write_fully(self.stream, np.ascontiguousarray(embeddings, dtype=self.dtype).tobytes())
        self.rows += len(embeddings)
        self._write_header()
        self.stream.flush()


def import_pyarrow() -> Any:
    """pyarrow, with its parquet module loaded; UserError naming the extra to install when it is missing."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise UserError("Parquet output needs pyarrow (pip install 'fastbert[embed]')") from err
    return pyarrow


def parquet_table(ids: Sequence[int | str], embeddings: np.ndarray, dtype: np.dtype, string_ids: bool) -> Any:
    """A pyarrow table: ``id`` (string when ``string_ids``, else int64) and ``embedding`` (list of float32/float16;
    null rows null)."""
    pa = import_pyarrow()
    values = pa.array(np.ascontiguousarray(embeddings, dtype=dtype).reshape(-1))
    offsets = pa.array(np.arange(0, embeddings.size + 1, max(embeddings.shape[1], 1), dtype=np.int32))
    column = pa.ListArray.from_arrays(offsets, values, mask=pa.array(null_rows(embeddings)))
    id_column = pa.array([str(i) for i in ids], pa.string()) if string_ids else pa.array(list(ids), pa.int64())
    return pa.table({"id": id_column, "embedding": column})


def parquet_bytes(ids: Sequence[int | str], embeddings: np.ndarray, dtype: np.dtype, string_ids: bool) -> bytes:
    """A whole Parquet file of `parquet_table`."""
    buffer = io.BytesIO()
    import_pyarrow().parquet.write_table(parquet_table(ids, embeddings, dtype, string_ids), buffer)
    return buffer.getvalue()


def encode(output_format: str, ids: Sequence[int | str], embeddings: np.ndarray, dtype: np.dtype,
           string_ids: bool) -> bytes:
    """A whole file of ``output_format`` (one of `FORMATS`) holding these rows."""
    if output_format == "jsonl":
        return jsonl_bytes(ids, embeddings)
    if output_format == "npy":
        return npy_bytes(embeddings, dtype)
    return parquet_bytes(ids, embeddings, dtype, string_ids)
