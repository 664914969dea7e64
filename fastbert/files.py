"""Writing files so that a crash or a power cut leaves the old version or the new one, never half of either: the one
atomic writer that checkpoints, embedding shards, manifests and every result file use.

A new version is written beside the old one under a temporary name (`TMP_PREFIX`), flushed to disk, renamed over
it, and the directory is flushed too, since the rename itself lives in the directory and is lost without it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TMP_PREFIX = ".tmp-"  # what a writer was writing when it stopped; safe to delete (`is_temporary`)
TRASH_PREFIX = ".trash-"  # what a removal was removing when it stopped; safe to delete


def temporary_path(path: str | os.PathLike) -> Path:
    """A name beside ``path`` to write its next version under (this process's own)."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")


def is_temporary(path: Path) -> bool:
    """Whether ``path`` is a leftover of an interrupted write or removal."""
    return path.name.startswith((TMP_PREFIX, TRASH_PREFIX))


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """Flush every file under ``directory`` and every directory's entries."""
    for root, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def replace_atomic(written: str | os.PathLike, path: str | os.PathLike) -> None:
    """Move a finished file or directory ``written`` (see `temporary_path`) over ``path``, flushed: after a crash
    ``path`` is either its old version or ``written`` whole. A directory already at ``path`` is removed first."""
    written, path = Path(written), Path(path)
    if written.is_dir():
        fsync_tree(written)
        if path.exists():
            remove_dir(path)
    os.replace(written, path)
    fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` (str is written as UTF-8) atomically."""
    path = Path(path)
    written = temporary_path(path)
    try:
        with open(written, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        replace_atomic(written, path)
    except BaseException:  # a full disk, an interrupt: no partial file is left behind
        written.unlink(missing_ok=True)
        raise


def remove_dir(path: str | os.PathLike) -> None:
    """Remove a directory tree, renaming it out of the way first so that an interrupted removal never leaves a
    partial directory under its name."""
    path = Path(path)
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
