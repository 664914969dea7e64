"""Where embeddings go: one file (`FileOutput`, or stdout for JSONL) or a resumable directory of shards with a
manifest (`ShardedOutput`, read back by `read_output`). Both have ``write``, ``rows_done``, ``close`` and
``describe``, so `fastbert.embedding.run` drives either."""

from __future__ import annotations

import fcntl
import json
import os
import re
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastbert.common.resolve import UserError, check_dir_creatable
from fastbert.embedding.formats import NpyWriter, encode, import_pyarrow, jsonl_bytes, parquet_table, write_fully
from fastbert.embedding.stats import EmbedStats
from fastbert.files import is_temporary, replace_atomic, temporary_path, write_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


def own_descriptor(path: str | os.PathLike) -> int | None:
    """The descriptor N of this process that ``path`` names: /dev/stdout, /dev/stderr, /dev/fd/N, /proc/self/fd/N,
    or a link to one of them; else None. Opening such a path opens its file anew (on Linux), so opening it to write
    with O_TRUNC empties the file the shell opened for appending (``-o /dev/stdout >> results.jsonl``); writing
    through the descriptor itself writes where and as the shell said, as stdout does."""
    current = os.path.abspath(path)
    for _ in range(40):  # links followed at most (the system's own limit)
        current = os.path.join(os.path.realpath(os.path.dirname(current)), os.path.basename(current))
        found = re.fullmatch(r"/proc/(\d+)(?:/task/\d+)?/fd/(\d+)|/dev/fd/(\d+)", current)
        if found:  # another process's descriptor is a path like any other
            ours = found[1] is None or found[1] in (str(os.getpid()), os.path.basename(os.path.realpath("/proc/self")))
            return int(found[2] or found[3]) if ours else None
        try:
            target = os.readlink(current)
        except OSError:  # not a link: a file like any other
            return None
        current = os.path.join(os.path.dirname(current), target)
    return None


def is_stream(path: str | os.PathLike) -> bool:
    """Whether the output ``path`` is written as a stream, as stdout is, rather than as a file of its own: a
    descriptor of this process (`own_descriptor`), a named pipe, a terminal or another device, a socket. Such an
    output is never opened to check it (a named pipe's reader would see its end), never emptied nor replaced, and
    takes JSONL only."""
    if own_descriptor(path) is not None:
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:  # none yet (a new file), or one that cannot be reached: opening it says
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_stream(path: str | os.PathLike, output_format: str) -> None:
    """UserError unless the stream output ``path`` (`is_stream`) can take ``output_format`` and be written."""
    if output_format != "jsonl":
        why = ("its header is rewritten after every window" if output_format == "npy" else
               "it is written aside and moved over the file when complete")
        raise UserError(f"cannot write {path}: {output_format} output needs a regular file given by its own name, "
                        f"-o FILE ({why}); a stream (stdout, a pipe, a device) takes JSONL")
    descriptor = own_descriptor(path)
    if descriptor is None:
        check_named_stream(path)
        return
    try:
        flags = fcntl.fcntl(descriptor, fcntl.F_GETFL)
    except OSError:
        raise UserError(f"cannot write {path}: this process has no descriptor {descriptor} open") from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise UserError(f"cannot write {path}: descriptor {descriptor} is open for reading only")


def release_reader(path: str | os.PathLike) -> None:
    """If ``path`` is a named pipe this process never opened (the run stopped before its first rows): open and close
    it without waiting, so that a reader waiting on it sees its end instead of waiting for ever (no reader, or not a
    named pipe: nothing to do)."""
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader (ENXIO), or gone
        pass


def check_named_stream(path: str | os.PathLike) -> None:
    """UserError unless the stream ``path`` (not a descriptor of this process) can be opened to write: a socket
    cannot be opened at all, a block device is a disk, and a character device is opened here and closed again
    (``/dev/tty`` without a terminal); a named pipe is not opened (its reader would see its end)."""
    mode = os.stat(path).st_mode
    if stat.S_ISSOCK(mode):
        raise UserError(f"cannot write {path}: it is a socket, which cannot be opened as a file; write to stdout and "
                        f"pipe it to the socket (e.g. -o - | socat - UNIX-CONNECT:{path})")
    if stat.S_ISBLK(mode):  # a disk or a partition: its contents would be overwritten
        raise UserError(f"cannot write {path}: it is a block device (a disk); give a file's name")
    if not os.access(path, os.W_OK):
        raise UserError(f"cannot write {path}: permission denied")
    if stat.S_ISCHR(mode):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY))
        except OSError as err:
            raise UserError(f"cannot write {path}: {err.strerror or err}") from None


class FileOutput:
    """One output file (or stdout for JSONL), written as windows arrive. Same interface as `ShardedOutput`:
    ``write``, ``rows_done``, ``close``, ``describe``.

    JSONL and .npy are written in place and are valid after every window (the .npy header is rewritten with the
    row count), so a reader can follow a long run and a killed run keeps its rows so far. Parquet is valid only
    once closed (a row group per window), so it is written under `fastbert.files.temporary_path` and moved over
    ``path`` by `close`: a killed run leaves the file that was there before, never a broken one. A file is
    replaced only when the first rows are written (or a run without rows completes): a run that fails or stops
    before leaves the file that was there.

    ``path`` None or "-" is stdout; a path `is_stream` (/dev/stdout, /dev/fd/N, a named pipe, a device) is
    written as a stream, never emptied nor replaced: a descriptor of this process through the descriptor itself
    (``-o /dev/stdout >> log`` appends to log), another stream opened without truncating. Both take JSONL only."""

    def __init__(self, path: str | None, output_format: str, dimension: int, dtype: np.dtype,
                 string_ids: bool = False):
        path = None if path == "-" else path  # '-' is stdout, as it is stdin for the input
        self.path, self.format, self.dimension, self.dtype = path, output_format, dimension, np.dtype(dtype)
        self.string_ids, self.rows_done = string_ids, 0
        self.streamed = path is not None and is_stream(path)
        self.written = None if path is None or self.streamed or output_format != "parquet" else temporary_path(path)
        self.created = False  # whether the writability check created ``path`` (removed if nothing is written)
        self.stream = self._stdout() if path is None else None
        self._npy = self._parquet = None
        if self.streamed:
            check_stream(path, output_format)
        elif path is not None:
            self._check_writable()

    def _stdout(self) -> Any:
        if self.format != "jsonl":
            raise UserError(f"{self.format} output needs --output FILE (stdout takes JSONL only)")
        return sys.stdout.buffer

    def _check_writable(self) -> None:
        """UserError now, before any work, when ``path`` cannot be written; an existing file is left as it is."""
        existed = os.path.lexists(self.path)
        try:
            open(self.path, "ab").close()  # appends nothing: an existing file keeps its bytes and its time
        except OSError as err:
            raise UserError(f"cannot write {self.path}: {err.strerror}") from err
        self.created = not existed

    def _open(self) -> None:
        """Open ``path`` (or, Parquet, its temporary name) for writing, emptying it: at the first rows. A stream
        is neither emptied nor created: a descriptor of this process is written through a copy of it (where the
        shell put it: appending with ``>>``, after what was written before), another stream is opened as it is
        (a named pipe waits here for its reader)."""
        if self.streamed:
            descriptor = own_descriptor(self.path)
            fd = os.dup(descriptor) if descriptor is not None else os.open(self.path, os.O_WRONLY)
            self.stream = os.fdopen(fd, "wb")  # closed in close()
            return
        mode = "w+b" if self.format == "npy" else "wb"  # .npy: the header is rewritten in place
        self.stream = open(self.written or self.path, mode)  # closed in close()
        self._npy = NpyWriter(self.stream, self.dimension, self.dtype) if self.format == "npy" else None

    def write(self, ids: Sequence[int | str], embeddings: np.ndarray, stats: EmbedStats | None = None) -> None:
        """Append one window's rows (``stats`` is for `ShardedOutput`'s manifest; a file does not record it)."""
        kept = None
        try:
            if self.stream is None:
                self._open()
            if self.format != "parquet" and self.stream.seekable():
                kept = self.stream.seek(0, os.SEEK_END)  # (a .npy writer stands after its header)
            self._append(ids, embeddings)
        except OSError as err:  # a full disk: the error names no file, the message should
            if kept is not None:
                self._cut_to(kept)  # no cut-off line or row: the rows before this window stay a valid file
            raise self._naming_the_file(err) from None

    def _cut_to(self, size: int) -> None:
        try:
            self.stream.truncate(size)
            if self._npy is not None:
                self._npy.stream.seek(0, os.SEEK_END)
        except OSError:  # what the disk still buffers may fail again: the error above is the one to report
            pass

    def _naming_the_file(self, err: OSError) -> OSError:
        if err.errno is None:  # no system error to attach a file name to (io.UnsupportedOperation, a short write)
            return OSError(f"{self.describe()}: {err}")
        if err.filename is None:
            err.filename = self.describe()
        return err

    def _append(self, ids: Sequence[int | str], embeddings: np.ndarray) -> None:
        if self.format == "jsonl":
            write_fully(self.stream, jsonl_bytes(ids, embeddings))
            self.stream.flush()
        elif self.format == "npy":
            self._npy.append(embeddings)
        else:
            table = parquet_table(ids, embeddings, self.dtype, self.string_ids)
            self._parquet_writer(table).write_table(table)
        self.rows_done += len(ids)

    def _parquet_writer(self, table: Any) -> Any:
        """The Parquet writer, opened with ``table``'s schema on first use."""
        if self._parquet is None:
            self._parquet = import_pyarrow().parquet.ParquetWriter(self.stream, table.schema)
        return self._parquet

    def close(self, stats: EmbedStats | None = None) -> None:
        """Finish the file (whether or not the run completed: what was written stays valid). ``stats`` None: the
        run stopped early; without rows, it leaves the file that was there (and removes one it created)."""
        if self.stream is None:
            if stats is None:
                if self.created:
                    Path(self.path).unlink(missing_ok=True)
                if self.streamed and own_descriptor(self.path) is None:
                    release_reader(self.path)
                return
            self._open()  # a completed run without rows: a valid, empty file
        try:
            self._finish()
        except OSError as err:
            if self.written is not None:  # a full disk: no temporary file stays behind
                Path(self.written).unlink(missing_ok=True)
            raise self._naming_the_file(err) from None

    def _finish(self) -> None:
        if self.format == "parquet":
            if self._parquet is None:  # no rows: still a valid, empty file
                self._parquet_writer(parquet_table([], np.zeros((0, self.dimension), dtype=np.float32), self.dtype,
                                                   self.string_ids))
            self._parquet.close()
        if self.stream is sys.stdout.buffer:
            self.stream.flush()
            return
        self.stream.close()
        if self.written is not None:
            replace_atomic(self.written, self.path)

    def describe(self) -> str:
        """Where the rows went, for messages."""
        return self.path or "stdout"


def check_run_directory(directory: str | os.PathLike, resume: bool) -> dict[str, Any] | None:
    """UserError unless ``directory`` can take a new run (``resume`` False: it holds none) or holds the manifest of
    one to resume, which is returned (its settings unchecked)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"--output-dir {directory} exists and is not a directory")
    if not resume:
        if (directory / MANIFEST).exists() or any(directory.glob("part-*")):
            raise UserError(f"--output-dir {directory} already holds a run ({MANIFEST} or part-* files); use "
                            "--resume to continue it, or another directory")
        return None
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(f"--resume: {directory} holds no {MANIFEST} (nothing to resume; run without --resume)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as err:  # it is written atomically: this one was not written by fastbert embed
        raise UserError(f"--resume: {path} cannot be read ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("settings"), dict):
        raise UserError(f"--resume: {path} is not the manifest of a fastbert embed run")
    return manifest


def same_input(recorded: str | None, given: str) -> bool:
    """Whether the input a run recorded (a path: as given on its command line by earlier runs, absolute by later
    ones; or '-') is the file ``given`` names now, however it is spelled."""
    if recorded is None or "-" in (recorded, given):
        return recorded == given
    try:
        return os.path.samefile(recorded, given)
    except OSError:  # moved or deleted since: not the same input
        return False


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
        found = check_run_directory(directory, resume)
        if found is not None:
            self.manifest = self._same_settings(found)
        else:
            self.manifest = {"version": MANIFEST_VERSION, "settings": self.settings, "shards": [], "stats": {},
                             "complete": False}
        self.created = not self.directory.exists()  # close() removes it again if the run wrote nothing
        check_dir_creatable(self.directory, "--output-dir")
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.iterdir():
            if is_temporary(leftover):  # a write cut short by a kill
                leftover.unlink()

    def _same_settings(self, found: dict[str, Any]) -> dict[str, Any]:
        """``found``, the manifest of the run to resume, refused if its settings differ from this run's."""
        changed = {k: (found["settings"].get(k), v) for k, v in self.settings.items()
                   if found["settings"].get(k) != v and not (k == "input" and same_input(found["settings"].get(k), v))}
        if changed:
            raise UserError("--resume with other settings than the interrupted run: " + "; ".join(
                f"{k} was {old!r}, now {new!r}" for k, (old, new) in changed.items()))
        return found

    def stats(self) -> EmbedStats:
        """The counts of the shards written so far (where a resumed run starts counting)."""
        return EmbedStats.from_counts(self.manifest["stats"])

    @property
    def rows_done(self) -> int:
        """Rows in the shards written so far."""
        return sum(shard["rows"] for shard in self.manifest["shards"])

    def write(self, ids: Sequence[int | str], embeddings: np.ndarray, stats: EmbedStats) -> None:
        """One shard, then the manifest with the counts so far (``stats``: the whole run's, resumed part included)."""
        index = len(self.manifest["shards"])
        name = f"part-{index:06d}.{self.format}"
        try:
            if self.format == "npy":
                # the ids of a .npy shard: its rows' ids, in a JSON file beside it (written before the manifest)
                write_atomic(self.directory / f"part-{index:06d}.ids.json", json.dumps(list(ids)).encode())
            write_atomic(self.directory / name, encode(self.format, ids, embeddings, self.dtype, self.string_ids))
        except OSError as err:  # a full disk: the error names no file, the message should
            if err.filename is None:
                err.filename = str(self.directory / name)
            raise
        self.manifest["shards"].append({"file": name, "first_row": self.rows_done, "rows": len(ids)})
        self.manifest["stats"] = stats.counts()
        self._save_manifest()

    def close(self, stats: EmbedStats | None = None) -> None:
        """Mark the run complete with its final ``stats``; None (the run stopped early): leave it resumable, or,
        when it wrote nothing into the directory it created, remove that (an empty folder is no run to resume)."""
        if stats is None:
            if self.created and not self.manifest["shards"]:
                try:
                    self.directory.rmdir()
                except OSError:  # something else was put there meanwhile: not ours to remove
                    pass
            return
        self.manifest["stats"] = stats.counts()
        self.manifest["complete"] = True
        self._save_manifest()

    def _save_manifest(self) -> None:
        write_atomic(self.directory / MANIFEST, (json.dumps(self.manifest, indent=1) + "\n").encode())

    def describe(self) -> str:
        """Where the rows went, for messages."""
        return f"{self.directory}/ ({len(self.manifest['shards'])} shards + {MANIFEST})"


def read_output(directory: str | os.PathLike) -> tuple[list[int | str], np.ndarray]:
    """The ids and embeddings [rows, H] of a sharded output directory, in input order (null rows are NaN)."""
    directory = Path(directory)
    with open(directory / MANIFEST) as f:
        manifest = json.load(f)
    dimension = manifest["settings"]["dimension"]
    ids: list[int | str] = []
    parts = []
    for shard in manifest["shards"]:
        shard_ids, vectors = read_shard(directory / shard["file"], dimension)
        ids += shard_ids
        parts.append(vectors)
    return ids, (np.concatenate(parts) if parts else np.zeros((0, dimension), dtype=np.float32))


def read_shard(path: Path, dimension: int) -> tuple[list[int | str], np.ndarray]:
    """The ids and float32 embeddings [rows, dimension] of one shard of `ShardedOutput` (null rows are NaN)."""
    if path.suffix == ".npy":
        return json.loads(path.with_name(path.stem + ".ids.json").read_text()), np.load(path).astype(np.float32)
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [r["id"] for r in rows], vectors_with_nulls([r["embedding"] for r in rows], dimension)
    table = import_pyarrow().parquet.read_table(path)
    return table.column("id").to_pylist(), vectors_with_nulls(table.column("embedding").to_pylist(), dimension)


def vectors_with_nulls(values: list[list[float] | None], dimension: int) -> np.ndarray:
    """Float32 rows [len(values), dimension] of lists, a None (a null row) as NaN."""
    return np.array([v if v is not None else [np.nan] * dimension for v in values],
                    dtype=np.float32).reshape(len(values), dimension)
