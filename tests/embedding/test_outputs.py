"""fastbert.embedding.outputs: single files valid as documented, sharded runs that resume after a real SIGKILL
with no row missing or repeated, and read back like a single file."""

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastbert.common.resolve import UserError
from fastbert.embedding import MANIFEST, EmbedStats, FileOutput, ShardedOutput, read_output
from fastbert.files import temporary_path

ROOT = Path(__file__).resolve().parents[2]


def _rows(count: int, dimension: int = 4, null_at: int | None = None) -> np.ndarray:
    vectors = np.random.default_rng(count).standard_normal((count, dimension)).astype(np.float32)
    if null_at is not None:
        vectors[null_at] = np.nan
    return vectors


# ------------------------------------------------------------------------------------------------ single file
def test_npy_file_loads_with_the_rows_so_far_after_every_window(tmp_path):
    path = tmp_path / "out.npy"
    output = FileOutput(str(path), "npy", 4, np.float32)
    first, second = _rows(3), _rows(5)
    output.write([1, 2, 3], first)
    np.testing.assert_array_equal(np.load(path), first)
    output.write([4, 5, 6, 7, 8], second)
    output.close()
    np.testing.assert_array_equal(np.load(path), np.concatenate([first, second]))
    assert output.rows_done == 8


def test_parquet_file_replaces_the_old_one_only_when_closed(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "out.parquet"
    path.write_bytes(b"the previous version")
    output = FileOutput(str(path), "parquet", 4, np.float16, string_ids=True)
    output.write(["a", "b"], _rows(2, null_at=1))
    assert path.read_bytes() == b"the previous version"  # a run killed now leaves the old file whole
    output.close()
    table = pq.read_table(path)
    assert table.column("id").to_pylist() == ["a", "b"]
    assert table.column("embedding").to_pylist()[1] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def _load(path: Path, output_format: str) -> int:
    """The rows in an output file."""
    if output_format == "npy":
        return len(np.load(path))
    if output_format == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).num_rows
    return len(path.read_text().splitlines())


@pytest.mark.parametrize("output_format", ["jsonl", "npy", "parquet"])
def test_a_completed_run_without_rows_writes_a_valid_empty_file(output_format, tmp_path):
    path = tmp_path / f"empty.{output_format}"
    path.write_bytes(b"the previous version")
    output = FileOutput(str(path), output_format, 4, np.float32)
    output.close(EmbedStats())
    assert _load(path, output_format) == 0


@pytest.mark.parametrize("output_format", ["jsonl", "npy", "parquet"])
def test_a_run_that_stops_before_its_first_rows_leaves_the_file_that_was_there(output_format, tmp_path):
    """A bad first row or an early Ctrl-C: "nothing was written", and the previous output is whole; a file the run
    created is removed."""
    path = tmp_path / f"out.{output_format}"
    previous = FileOutput(str(path), output_format, 4, np.float32)
    previous.write([1, 2, 3], _rows(3))
    previous.close(EmbedStats())
    before = path.read_bytes()
    FileOutput(str(path), output_format, 4, np.float32).close()  # stopped (stats None) with no rows
    assert path.read_bytes() == before and _load(path, output_format) == 3
    new = tmp_path / f"new.{output_format}"
    FileOutput(str(new), output_format, 4, np.float32).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


@pytest.mark.parametrize("output_format", ["jsonl", "npy"])
def test_a_window_cut_by_a_full_disk_leaves_the_windows_before_it_whole(output_format, tmp_path, monkeypatch):
    """The disk fills halfway through a window (the first one too): the file holds the windows before it, no
    cut-off line or row, and the error names the file."""
    import errno

    from fastbert.embedding import formats, outputs

    path = tmp_path / f"out.{output_format}"
    output = FileOutput(str(path), output_format, 4, np.float32)
    real_write = formats.write_fully

    def half_then_full(stream, data):
        if len(data) > 200:  # a window's rows, not the .npy header
            real_write(stream, data[: len(data) // 2])
            stream.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(stream, data)

    monkeypatch.setattr(outputs, "write_fully", half_then_full)
    monkeypatch.setattr(formats, "write_fully", half_then_full)
    with pytest.raises(OSError, match="No space left") as failed:
        output.write(list(range(20)), _rows(20))
    assert failed.value.filename == str(path)
    assert _load(path, output_format) == 0
    monkeypatch.setattr(outputs, "write_fully", real_write)
    monkeypatch.setattr(formats, "write_fully", real_write)
    output.write([1, 2, 3], _rows(3))
    monkeypatch.setattr(outputs, "write_fully", half_then_full)
    monkeypatch.setattr(formats, "write_fully", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        output.write(list(range(20)), _rows(20))
    output.close()
    assert _load(path, output_format) == 3


def test_npy_output_to_a_pipe_or_device_is_refused_before_any_work():
    with pytest.raises(UserError, match="npy output needs a regular file"):
        FileOutput("/dev/null", "npy", 4, np.float32)


def test_a_path_that_cannot_be_written_is_an_error_before_any_work(tmp_path):
    with pytest.raises(UserError, match="cannot write .*missing"):
        FileOutput(str(tmp_path / "missing" / "out.npy"), "npy", 4, np.float32)


def test_stdout_takes_jsonl_only():
    with pytest.raises(UserError, match="npy output needs --output FILE"):
        FileOutput(None, "npy", 4, np.float32)
    with pytest.raises(UserError, match="npy output needs --output FILE"):  # '-' is stdout, as for the input
        FileOutput("-", "npy", 4, np.float32)
    assert FileOutput("-", "jsonl", 4, np.float32).describe() == "stdout"


@pytest.fixture
def appended_descriptor(tmp_path):
    """A descriptor of this process open for appending to a file that holds a line already, as the shell's
    ``>> results.jsonl`` leaves stdout: (descriptor, path of the file)."""
    path = tmp_path / "results.jsonl"
    path.write_text('{"id": "from before"}\n')
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND)
    yield descriptor, path
    os.close(descriptor)


@pytest.mark.parametrize("name", ["/dev/fd/{}", "/proc/self/fd/{}", "link"])
def test_a_descriptor_appended_to_is_appended_to_not_emptied(appended_descriptor, tmp_path, name):
    """`-o /dev/stdout >> results.jsonl`: the path reopens the shell's file; opened to write ("wb", O_TRUNC) it lost
    what the user appended to. Written through the descriptor, it keeps it, window after window."""
    descriptor, path = appended_descriptor
    if name == "link":  # a link to one (as /dev/stdout is a link to /proc/self/fd/1)
        (tmp_path / "link").symlink_to(f"/proc/self/fd/{descriptor}")
        name = str(tmp_path / "link")
    output = FileOutput(name.format(descriptor), "jsonl", 4, np.float32)
    assert path.read_text() == '{"id": "from before"}\n'
    output.write([1, 2], _rows(2))
    output.write([3], _rows(1))
    output.close(EmbedStats())
    lines = path.read_text().splitlines()
    assert lines[0] == '{"id": "from before"}' and [json.loads(line)["id"] for line in lines[1:]] == [1, 2, 3]
    os.write(descriptor, b"after\n")  # the descriptor itself stays open, for whoever writes after the run
    assert path.read_text().endswith("after\n")


def test_a_descriptor_appended_to_keeps_what_it_held_when_the_disk_fills(appended_descriptor, monkeypatch):
    """A full disk cuts the window back to where it started: the lines from before the run and its earlier
    windows stay."""
    import errno

    from fastbert.embedding import formats, outputs

    descriptor, path = appended_descriptor
    output = FileOutput(f"/dev/fd/{descriptor}", "jsonl", 4, np.float32)
    output.write([1], _rows(1))
    real_write = formats.write_fully

    def half_then_full(stream, data):
        real_write(stream, data[: len(data) // 2])
        stream.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(outputs, "write_fully", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        output.write(list(range(20)), _rows(20))
    monkeypatch.setattr(outputs, "write_fully", real_write)
    output.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"id": "from before"}' and [json.loads(line)["id"] for line in lines[1:]] == [1]


def test_a_named_pipe_is_written_for_its_reader_not_opened_to_check_it(tmp_path):
    """Opening a named pipe to check it and closing it again gave its reader an end of file at once, and the
    run then waited forever for a reader that had gone."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    writing = threading.Thread(target=lambda: _write_rows(str(fifo)), daemon=True)
    writing.start()
    writing.join(timeout=30)
    if writing.is_alive():  # let the writer's open go (a reader that opens and leaves at once), then fail
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail("writing to a named pipe hung: its reader had been given an end of file when it was checked")
    reader.join(timeout=60)
    assert [json.loads(line)["id"] for line in received[0].decode().splitlines()] == [1, 2]


def test_a_named_pipe_gets_its_end_when_the_run_stops_before_its_first_rows(tmp_path):
    """The pipe is opened at the first rows: a run that failed before them never opened it, and its reader waited
    for ever (``consumer < pipe & fastbert embed -o pipe ...; wait`` deadlocked)."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    output = FileOutput(str(fifo), "jsonl", 4, np.float32)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    time.sleep(0.2)  # the reader waits in its open
    output.close()  # the run stopped early
    reader.join(timeout=10)
    if reader.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the pipe's reader was left waiting")
    assert received == [b""]
    FileOutput(str(fifo), "jsonl", 4, np.float32).close()  # no reader: returns at once


def _write_rows(path: str) -> None:
    output = FileOutput(path, "jsonl", 4, np.float32)
    time.sleep(0.5)  # the model loads (seconds) between the check and the first rows
    output.write([1, 2], _rows(2))
    output.close(EmbedStats())


@pytest.mark.parametrize("output_format", ["npy", "parquet"])
def test_npy_and_parquet_to_stdout_by_any_name_or_a_pipe_are_refused_and_touch_nothing(output_format, tmp_path,
                                                                                        appended_descriptor):
    """They need a file of their own: .npy rewrites its header, Parquet is written aside and moved over the file
    (over /dev/stdout itself: the link would be replaced by a file)."""
    descriptor, path = appended_descriptor
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for name in (f"/dev/fd/{descriptor}", str(fifo)):
        with pytest.raises(UserError, match=f"{output_format} output needs a regular file given by its own name"):
            FileOutput(name, output_format, 4, np.float32)
    assert path.read_text() == '{"id": "from before"}\n' and sorted(p.name for p in tmp_path.iterdir()) == \
        ["pipe", "results.jsonl"]


def test_stdout_by_another_name_is_a_stream_and_regular_files_are_not(tmp_path, appended_descriptor):
    from fastbert.embedding import is_stream, own_descriptor

    descriptor, path = appended_descriptor
    assert own_descriptor(f"/proc/self/fd/{descriptor}") == own_descriptor(f"/dev/fd/{descriptor}") == descriptor
    assert own_descriptor("/dev/stdout") == 1 and own_descriptor("/dev/stderr") == 2
    assert own_descriptor(path) is None and own_descriptor(tmp_path / "new.jsonl") is None
    assert own_descriptor(f"/proc/{os.getppid()}/fd/1") is None  # another process's: a path like any other
    (tmp_path / "link").symlink_to(path)
    assert not is_stream(tmp_path / "link") and not is_stream(path) and not is_stream(tmp_path / "new.jsonl")
    assert is_stream("/dev/null") and is_stream(f"/dev/fd/{descriptor}")
    with pytest.raises(UserError, match="no descriptor 9999 open"):
        FileOutput("/dev/fd/9999", "jsonl", 4, np.float32)
    reading = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(UserError, match=f"descriptor {reading} is open for reading only"):
            FileOutput(f"/dev/fd/{reading}", "jsonl", 4, np.float32)
    finally:
        os.close(reading)


# -------------------------------------------------------------------------------------------------- sharded
@pytest.mark.parametrize("output_format", ["jsonl", "npy", "parquet"])
def test_shards_read_back_in_order_with_null_rows(tmp_path, output_format):
    output = ShardedOutput(str(tmp_path / "run"), output_format, 4, np.float32, {"model": "m"}, resume=False)
    windows = [(list(range(1, 4)), _rows(3, null_at=1)), (list(range(4, 6)), _rows(2))]
    total = EmbedStats()
    for ids, vectors in windows:
        total.add(EmbedStats(rows=len(ids)))
        output.write(ids, vectors, total)
    output.close(total)
    ids, vectors = read_output(tmp_path / "run")
    assert ids == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(vectors, np.concatenate([v for _, v in windows]), rtol=0, atol=1e-6)
    manifest = json.loads((tmp_path / "run" / MANIFEST).read_text())
    assert manifest["complete"] and manifest["stats"]["rows"] == 5
    assert [s["first_row"] for s in manifest["shards"]] == [0, 3]


def test_resuming_removes_what_a_killed_write_left(tmp_path):
    directory = tmp_path / "run"
    output = ShardedOutput(str(directory), "npy", 4, np.float32, {"model": "m"}, resume=False)
    output.write([1, 2], _rows(2), EmbedStats(rows=2))
    leftover = temporary_path(directory / "part-000001.npy")
    leftover.write_bytes(b"half a shard")
    resumed = ShardedOutput(str(directory), "npy", 4, np.float32, {"model": "m"}, resume=True)
    assert not leftover.exists()
    assert (resumed.rows_done, resumed.stats().rows) == (2, 2)


def test_a_run_resumes_with_its_input_spelled_another_way_but_not_with_another_input(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    source, other = tmp_path / "in.txt", tmp_path / "other.txt"
    source.write_text("one\n")
    other.write_text("one\n")
    (tmp_path / "link.txt").symlink_to(source)
    directory = str(tmp_path / "run")
    output = ShardedOutput(directory, "npy", 4, np.float32, {"input": "in.txt"}, resume=False)  # recorded relative
    monkeypatch.chdir(tmp_path)
    output.write([1], _rows(1), EmbedStats(rows=1))
    for spelled in ("in.txt", "./in.txt", str(source), "sub/../in.txt", "link.txt"):
        assert ShardedOutput(directory, "npy", 4, np.float32, {"input": spelled}, resume=True).rows_done == 1
    for changed in ("other.txt", "-", "missing.txt"):
        with pytest.raises(UserError, match=f"input was 'in.txt', now '{changed}'"):
            ShardedOutput(directory, "npy", 4, np.float32, {"input": changed}, resume=True)


@pytest.mark.slow  # ~15 s here
def test_sharded_output_resumes_after_sigkill_without_missing_or_repeated_rows(tiny_dir, tmp_path, sentences,
                                                                              write_lines, embed_cli):
    source = write_lines(tmp_path / "in.txt", sentences[:2400])
    complete, killed = tmp_path / "complete", tmp_path / "killed"
    args = ["-i", str(source), "--model", tiny_dir, "--window-rows", "100", "--format", "npy"]
    embed_cli(*args, "--output-dir", str(complete))
    proc = subprocess.Popen([sys.executable, "-m", "fastbert.cli", "embed", *args, "--output-dir", str(killed)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = killed / MANIFEST
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(manifest.read_text())
    assert not state["complete"] and 3 <= len(state["shards"]) < 24  # killed mid-run
    resumed = embed_cli(*args, "--output-dir", str(killed), "--resume")
    assert f"resuming after row {len(state['shards']) * 100:,}" in resumed.stderr
    ids_a, vectors_a = read_output(complete)
    ids_b, vectors_b = read_output(killed)
    assert ids_b == ids_a == list(range(1, 2401))
    np.testing.assert_array_equal(vectors_b, vectors_a)
    assert json.loads(manifest.read_text())["complete"]
    assert json.loads(manifest.read_text())["stats"]["rows"] == 2400
    again = embed_cli(*args, "--output-dir", str(killed), "--resume")
    assert "nothing to resume" in again.stderr


@pytest.mark.parametrize("output_format", ["jsonl", "parquet", "npy"])
def test_sharded_output_in_each_format_reads_back_like_a_single_file(tiny_dir, tmp_path, output_format, write_lines,
                                                                     embed_cli):
    rows = [json.dumps({"text": f"text number {i}" if i % 9 else "", "key": f"doc-{i}"}) for i in range(23)]
    source = write_lines(tmp_path / "in.jsonl", rows)
    embed_cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / "single.npy"))
    embed_cli("-i", str(source), "--model", tiny_dir, "--id-field", "key", "--output-dir", str(tmp_path / "run"),
              "--format", output_format, "--window-rows", "10")
    ids, vectors = read_output(tmp_path / "run")
    assert ids == [f"doc-{i}" for i in range(23)]
    assert len(json.loads((tmp_path / "run" / MANIFEST).read_text())["shards"]) == 3
    # null rows are NaN in both (assert_allclose compares NaN positions); other windows batch differently
    np.testing.assert_allclose(vectors, np.load(tmp_path / "single.npy"), rtol=0, atol=1e-6)


def test_resume_refuses_other_settings_and_an_existing_run(tiny_dir, tmp_path, write_lines, embed_cli):
    source = write_lines(tmp_path / "in.txt", ["one", "two", "three"])
    out = tmp_path / "run"
    embed_cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out))
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out), check=False)
    assert proc.returncode == 1 and "already holds a run" in proc.stderr
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out), "--resume", "--pooling", "cls",
                     check=False)
    assert proc.returncode == 1 and "pooling was 'mean', now 'cls'" in proc.stderr


def test_resume_refuses_an_id_field_run_that_wrote_blank_lines_as_rows(tiny_dir, tmp_path, write_lines, embed_cli):
    source = write_lines(tmp_path / "in.jsonl", ['{"text": "one", "id": "a"}', "", '{"text": "two", "id": "b"}'])
    out = tmp_path / "run"
    args = ["-i", str(source), "--model", tiny_dir, "--output-dir", str(out), "--id-field", "id"]
    embed_cli(*args)
    embed_cli(*args, "--resume")  # the same version: resumed (nothing left to do)
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["settings"]["blank_jsonl_lines"]  # as fastbert 0.1.0 wrote it: a blank line was a null row
    (out / MANIFEST).write_text(json.dumps(manifest))
    proc = embed_cli(*args, "--resume", check=False)
    assert proc.returncode == 1 and f"--resume: {out} was started by fastbert 0.1.0 with --id-field" in proc.stderr


def test_a_resumed_run_reports_this_run_and_every_truncated_line(tiny_dir, tmp_path, write_lines, embed_cli):
    texts = ["one", "long " * 50, "three", "four", "five", "six", "seven", "long " * 60, "nine"]
    good = [json.dumps({"text": t}) for t in texts]
    source = write_lines(tmp_path / "in.jsonl", good[:6] + ['{"txt": "a broken row"}'])
    args = ["-i", str(source), "--model", tiny_dir, "--output-dir", str(tmp_path / "run"), "--window-rows", "4",
            "--max-length", "16"]
    stopped = embed_cli(*args, check=False)
    assert stopped.returncode == 1 and "6 rows before it were written" in stopped.stderr
    write_lines(source, good)  # the input mended: resume after its 6 rows
    resumed = embed_cli(*args, "--resume")
    assert "9 rows (3 this run, 6 before)" in resumed.stderr, resumed.stderr
    assert "2 texts were longer than 16 tokens and were truncated (lines 2, 8)" in resumed.stderr
    assert " 0 texts/s" not in resumed.stderr.replace(",", "")


def test_a_bad_first_row_leaves_the_previous_output_whole(tiny_dir, tmp_path, write_lines, embed_cli):
    good = write_lines(tmp_path / "good.jsonl", ['{"text": "fine"}', '{"text": "also fine"}'])
    bad = write_lines(tmp_path / "bad.jsonl", ['{"text": {"not": "a string"}}'])
    out = tmp_path / "out.npy"
    embed_cli("-i", str(good), "--model", tiny_dir, "-o", str(out))
    before = out.read_bytes()
    proc = embed_cli("-i", str(bad), "--model", tiny_dir, "-o", str(out), check=False)
    assert proc.returncode == 1 and "nothing was written" in proc.stderr
    assert out.read_bytes() == before


def test_an_error_before_any_row_leaves_no_empty_directory_nor_names_one(tiny_dir, tmp_path, write_lines, embed_cli):
    source = write_lines(tmp_path / "in.jsonl", ['{"txt": "no text field"}'])
    out = tmp_path / "run"
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out), check=False)
    assert proc.returncode == 1 and "in.jsonl:1" in proc.stderr and "nothing was written" in proc.stderr
    assert "0 shards" not in proc.stderr and not out.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a device that is always full)")
def test_a_full_disk_is_an_error_naming_the_file():
    """The system's error names no file when a write fails for space; the message must. (.npy output needs a
    regular file: a device is refused before, `test_npy_output_to_a_pipe_or_device_is_refused_before_any_work`.)"""
    output = FileOutput("/dev/full", "jsonl", 4, np.float32)
    with pytest.raises(OSError, match="No space left on device") as failed:
        output.write([1, 2], _rows(2))
        output.close()
    assert failed.value.filename == "/dev/full"
    with pytest.raises(OSError):  # what is still buffered fails again; the stream is closed all the same
        output.stream.close()


def test_a_block_device_is_refused_and_a_device_that_does_not_open_is_reported(monkeypatch):
    """-o /dev/sda would have written JSONL over a disk; /dev/tty without a terminal failed at the first rows."""
    from fastbert.embedding import check_stream, outputs

    real_stat, real_open = os.stat, os.open
    block = os.stat_result((stat.S_IFBLK | 0o600, *real_stat("/dev/null")[1:]))
    monkeypatch.setattr(outputs.os, "stat", lambda path, *a, **k: block if str(path) == "/dev/disk0" else
                        real_stat(path, *a, **k))
    with pytest.raises(UserError, match="cannot write /dev/disk0: it is a block device"):
        check_stream("/dev/disk0", "jsonl")
    check_stream("/dev/null", "jsonl")  # a character device that opens

    def no_device(path, *args, **kwargs):
        if str(path) == "/dev/null":
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(outputs.os, "open", no_device)
    with pytest.raises(UserError, match="cannot write /dev/null: No such device or address"):
        check_stream("/dev/null", "jsonl")
