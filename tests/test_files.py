"""fastbert.files: atomic writes leave either the old file or the new one, and no temporary file."""

from __future__ import annotations

import errno
import os

import pytest

from fastbert import files


def test_write_atomic_replaces_the_file(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")
    files.write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_a_failed_write_atomic_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    """A full disk (here: fsync failing) or an interrupt mid-write: the old version stays whole, nothing else."""
    path = tmp_path / "part-000001.jsonl"
    path.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["part-000001.jsonl"]
