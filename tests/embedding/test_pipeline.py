"""fastbert.embedding.run and `fastbert embed` end to end: one output row per input row in each format, input
errors with line numbers that keep the rows before them, progress and truncation warnings, bounded memory, and the
same numbers on a Ray cluster."""

import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastbert import cli
from fastbert.embedding import EmbedStats, InputError, Progress, Row, run, skip_rows, truncation_note
from fastbert.embedding.pipeline import cut_at_first_blank

ROOT = Path(__file__).resolve().parents[2]


class CountingEmbedder:
    """An embedder of row numbers: each text's embedding is [its line, 0]."""

    def embed(self, texts, lines):
        vectors = np.array([[line, 0.0] if text is not None else [np.nan, np.nan]
                            for text, line in zip(texts, lines, strict=True)], dtype=np.float32)
        present = sum(text is not None for text in texts)
        return vectors, EmbedStats(rows=len(texts), embedded=present, null_rows=len(texts) - present)


class ListOutput:
    def __init__(self):
        self.ids, self.vectors = [], []

    def write(self, ids, embeddings, stats):
        self.ids += ids
        self.vectors.append(embeddings)


def _rows(texts):
    return iter([Row(i, i, t) for i, t in enumerate(texts, start=1)])


# ------------------------------------------------------------------------------------------------------ run
def test_run_writes_every_row_in_order_window_by_window():
    output = ListOutput()
    stats = run(CountingEmbedder(), _rows(["a", None, "c", "d", "e"]), output, window_rows=2)
    assert output.ids == [1, 2, 3, 4, 5] and [len(v) for v in output.vectors] == [2, 2, 1]
    assert (stats.rows, stats.embedded, stats.null_rows) == (5, 4, 1)


def test_run_on_blank_error_writes_the_rows_before_and_raises_with_the_line():
    output = ListOutput()
    with pytest.raises(InputError, match="line 4: blank text"):
        run(CountingEmbedder(), _rows(["a", "b", "c", None, "e"]), output, window_rows=3, blank="error")
    assert output.ids == [1, 2, 3]
    assert cut_at_first_blank([Row(1, 1, "a")]) == ([Row(1, 1, "a")], None)


class TokenizingEmbedder(CountingEmbedder):
    """A counting embedder whose tokenizer keeps nothing of "~" (as BERT's keeps nothing of a lone accent)."""

    def kept_nothing(self, texts):
        return ["nothing the tokenizer keeps (~)" if text == "~" else None for text in texts]


def test_run_counts_the_invisible_texts_and_on_blank_error_says_why_it_stops():
    """A text of only invisible characters (the reader made it null, with why) or one the tokenizer keeps nothing
    of is a blank text: a null row, counted apart for the note, or where --on-blank error stops, saying why."""
    def rows():
        return iter([Row(1, 1, "a"), Row(2, 2, None, "only invisible characters (U+200B ZERO WIDTH SPACE)"),
                     Row(3, 3, None), Row(4, 4, "~"), Row(5, 5, "e")])

    output = ListOutput()
    stats = run(TokenizingEmbedder(), rows(), output, window_rows=2)
    assert output.ids == [1, 2, 3, 4, 5] and np.isnan(np.concatenate(output.vectors)[[1, 2, 3]]).all()
    assert (stats.rows, stats.embedded, stats.null_rows, stats.invisible, stats.invisible_lines) == (5, 2, 3, 2, [2, 4])
    with pytest.raises(InputError, match=r"^line 2: blank text: only invisible characters \(U\+200B ZERO WIDTH "
                                         r"SPACE\) \(--on-blank error\)$"):
        run(TokenizingEmbedder(), rows(), ListOutput(), blank="error")
    with pytest.raises(InputError, match=r"^line 4: blank text: nothing the tokenizer keeps \(~\) \(--on-blank"):
        run(TokenizingEmbedder(), iter([Row(1, 1, "a"), Row(4, 4, "~")]), ListOutput(), blank="error")
    from fastbert.embedding import invisible_rows_note

    note = invisible_rows_note(stats)
    assert note.startswith("2 texts (lines 2, 4) held only invisible characters (zero-width, format or control "
                           "characters) or nothing the tokenizer keeps: they are blank, null rows")
    assert invisible_rows_note(EmbedStats(invisible=1, invisible_lines=[7])).startswith("1 text (line 7) held")
    kept = EmbedStats.from_counts(stats.counts())  # a manifest keeps them, so a resumed run's note still has them
    assert (kept.invisible, kept.invisible_lines) == (2, [2, 4])
    assert EmbedStats.from_counts({"rows": 3}).invisible == 0  # a manifest written before counted none


def test_run_stops_at_an_input_error_after_the_rows_before_it():
    def rows():
        yield from _rows(["a", "b", "c"])
        raise InputError("in.txt:4: broken")

    output = ListOutput()
    with pytest.raises(InputError, match="in.txt:4"):
        run(CountingEmbedder(), rows(), output, window_rows=2)
    assert output.ids == [1, 2, 3]


def test_run_continues_the_counts_of_a_resumed_run_and_skip_rows_checks_the_input():
    rows = _rows(["a", "b", "c"])
    skip_rows(rows, 1)
    stats = run(CountingEmbedder(), rows, ListOutput(), initial=EmbedStats(rows=1, embedded=1))
    assert (stats.rows, stats.embedded) == (3, 3)
    with pytest.raises(Exception, match="fewer rows than the 5 already written"):
        skip_rows(_rows(["a"]), 5)


def test_a_resumed_run_counts_this_run_apart_from_the_earlier_part():
    earlier = EmbedStats(rows=2, embedded=2, tokens=20)
    stream = io.StringIO()
    progress = Progress(total_bytes=None, enabled=True, stream=stream, initial=earlier)
    stats = run(CountingEmbedder(), _rows(["a", "b", "c"]), ListOutput(), window_rows=2, progress=progress,
                initial=earlier)
    assert (stats.rows, stats.embedded) == (5, 5)
    assert (earlier.rows, earlier.embedded) == (2, 2)  # the earlier part's counts, not the running total
    rates = [int(rate.replace(",", "")) for rate in re.findall(r"([\d,]+) texts/s", stream.getvalue())]
    assert rates and rates[-1] > 0


class BatchReportingEmbedder(CountingEmbedder):
    """Reports each text as a batch done, and records what the progress stream held by then."""

    def __init__(self, stream):
        self.stream, self.seen_after_first_batch = stream, None

    def embed(self, texts, lines, on_batch=None):
        for index in range(len(texts)):
            on_batch(1, 3)
            if index == 0:
                self.seen_after_first_batch = self.stream.getvalue()
        return super().embed(texts, lines)


def test_the_progress_line_appears_after_the_first_batch_not_the_first_window():
    stream = io.StringIO()
    embedder = BatchReportingEmbedder(stream)
    progress = Progress(total_bytes=100, enabled=True, stream=stream, log_every=3600)
    read = [0]

    def rows():  # 25 bytes a row; the window is read whole before its first batch
        for row in _rows(["a", "b", "c", "d"]):
            read[0] += 25
            yield row

    stats = run(embedder, rows(), ListOutput(), window_rows=4, progress=progress, bytes_read=lambda: read[0])
    # the fraction is that of the rows embedded, not of the bytes read ahead: 1 of the window's 4 rows
    assert "fastbert embed: [######..................]  25%  1 rows" in embedder.seen_after_first_batch
    assert "ETA" in embedder.seen_after_first_batch
    assert stats.rows == 4
    assert stream.getvalue().splitlines()[-1].startswith("fastbert embed: [" + "#" * 24 + "] 100%  4 rows")


def test_the_truncation_note_names_every_counted_line_or_how_many_it_leaves_out():
    assert truncation_note(EmbedStats(truncated=2, truncated_lines=[3, 9])) == "lines 3, 9"
    assert truncation_note(EmbedStats(truncated=12, truncated_lines=list(range(1, 11)))) == \
        "lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 and 2 more"
    assert truncation_note(EmbedStats(truncated=4)) == "their lines were not recorded"
    kept = EmbedStats.from_counts(EmbedStats(truncated=1, truncated_lines=[7]).counts())
    assert kept.truncated_lines == [7]  # a manifest keeps them, so a resumed run can still name them


def test_progress_line_shows_rows_rates_and_the_fraction_read():
    stream = io.StringIO()
    progress = Progress(total_bytes=100, enabled=True, stream=stream)
    progress.update(EmbedStats(rows=7, embedded=7, tokens=70), bytes_read=50, force=True)
    progress.close()
    line = stream.getvalue()
    assert line.startswith("fastbert embed: [############............]  50%") and "7 rows" in line
    assert "texts/s" in line and "tokens/s" in line and "ETA" in line


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_text_file_to_each_format_one_row_per_line(tiny_dir, tmp_path, sentences, write_lines, embed_cli):
    lines = sentences[:30] + [""] + sentences[30:45]
    source = write_lines(tmp_path / "in.txt", lines)
    for name in ("out.jsonl", "out.npy", "out.parquet"):
        proc = embed_cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / name), "--window-rows", "8")
        assert "46 rows" in proc.stderr and "45 embedded, 1 null" in proc.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records] == list(range(1, 47))
    assert records[30]["embedding"] is None
    from_jsonl = np.array([r["embedding"] if r["embedding"] else [np.nan] * 32 for r in records], dtype=np.float32)
    from_npy = np.load(tmp_path / "out.npy")
    np.testing.assert_array_equal(from_npy, from_jsonl)  # %.9g gives float32 values back exactly
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("id").to_pylist() == list(range(1, 47))
    column = table.column("embedding").to_pylist()
    assert column[30] is None
    np.testing.assert_array_equal(np.array(column[:30], dtype=np.float32), from_npy[:30])


def test_cli_stdin_jsonl_with_ids_and_float16(tiny_dir, tmp_path):
    data = "".join(json.dumps({"t": f"sentence number {i}", "key": f"k{i}"}) + "\n" for i in range(5))
    out = tmp_path / "e.npy"
    proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "--input-format", "jsonl", "--field", "t",
                           "--model", tiny_dir, "-o", str(out), "--output-dtype", "float16"], input=data,
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    array = np.load(out)
    assert array.dtype == np.float16 and array.shape == (5, 32)


def test_cli_bad_row_stops_with_its_line_and_keeps_earlier_rows(tiny_dir, tmp_path, write_lines, embed_cli):
    rows = [json.dumps({"text": f"row {i}"}) for i in range(10)] + ['{"txt": "oops"}'] + ['{"text": "after"}']
    source = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.npy"
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "-o", str(out), "--window-rows", "4", check=False)
    assert proc.returncode == 1
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("fastbert: error:")]
    assert len(error_lines) == 1 and "in.jsonl:11: the object has no field 'text'" in error_lines[0]
    assert "Traceback" not in proc.stderr
    assert np.load(out).shape == (10, 32)  # the 10 rows before the bad one, complete and loadable


@pytest.mark.parametrize("argv, message", [
    (["-i", "/nonexistent/file.txt"], "does not exist"),
    (["-i", "IN", "--model", "/nonexistent"], "does not exist"),
    (["-i", "IN", "-o", "out.csv"], "cannot tell the format"),
    (["-i", "IN", "--resume"], "--resume continues an --output-dir run"),
    (["-i", "IN", "--on-blank", "error"], "line 2: blank text"),
], ids=["missing-input", "missing-model", "unknown-format", "resume-without-dir", "blank-is-error"])
def test_cli_errors_are_one_line(tiny_dir, tmp_path, argv, message, write_lines, embed_cli):
    source = write_lines(tmp_path / "in.txt", ["first", "", "third"])
    argv = [str(source) if a == "IN" else str(tmp_path / a) if a == "out.csv" else a for a in argv]
    if "--model" not in argv:
        argv += ["--model", tiny_dir]
    proc = embed_cli(*argv, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("output", [[], ["-o", "/dev/stdout", "--format", "jsonl"]], ids=["stdout", "dev-stdout"])
def test_cli_stops_quietly_when_the_reader_of_stdout_goes_away(tiny_dir, tmp_path, sentences, write_lines, output):
    source = write_lines(tmp_path / "in.txt", sentences[:400])
    proc = subprocess.run(f"{sys.executable} -m fastbert.cli embed -i {source} --model {tiny_dir} --window-rows 50 "
                          f"{' '.join(output)} | head -n 2", shell=True, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert len(proc.stdout.splitlines()) == 2
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr and "Exception" not in proc.stderr


@pytest.mark.parametrize("output", [[], ["-o", "/dev/stdout", "--format", "jsonl"]], ids=["stdout", "dev-stdout"])
def test_a_reader_gone_during_the_only_window_is_not_reported_as_success(tiny_dir, tmp_path, sentences, write_lines,
                                                                         output):
    """One window, bigger than a pipe holds, whose reader goes away after 1,000 bytes: the buffered write returns
    short without raising; the run must not exit 0 saying every row was written."""
    source = write_lines(tmp_path / "in.txt", sentences[:400])
    proc = subprocess.Popen([sys.executable, "-m", "fastbert.cli", "embed", "-i", str(source), "--model", tiny_dir,
                             *output], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.read(1000)
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141
    assert "embedded" not in stderr and "Traceback" not in stderr and "Exception" not in stderr


def _shell(command: str) -> subprocess.CompletedProcess:
    """``command`` in bash, with ``embed`` for ``python -m fastbert.cli embed``."""
    command = command.replace("embed ", f"{sys.executable} -m fastbert.cli embed ")
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_cli_output_to_stdout_by_any_name_goes_where_the_shell_put_stdout(tiny_dir, tmp_path):
    """`-o /dev/stdout >> results.jsonl` emptied results.jsonl: /dev/stdout was opened anew to write, truncating
    the file the shell had opened for appending. Through stdout itself, the rows are appended; so with '-' (stdout,
    as for --input) and /dev/fd/N; a run after an echo into the same redirection keeps the echo's line."""
    results = tmp_path / "results.jsonl"
    results.write_text('{"id": "from before"}\n')
    proc = _shell(f"embed one two --model {tiny_dir} --format jsonl -o /dev/stdout >> {results}")
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in results.read_text().splitlines()] == ["from before", 1, 2]
    # '-' is stdout; JSONL, the one format a stream takes, is the default for all of them
    for output, redirect in (("-", ">>"), ("/dev/fd/3", "3>>"), ("/proc/self/fd/1", ">>")):
        proc = _shell(f"embed one two --model {tiny_dir} -o {output} {redirect} {results}")
        assert proc.returncode == 0, proc.stderr
    header = "echo '{\"id\": \"header\"}'"
    proc = _shell(f"{{ {header}; embed three --model {tiny_dir} -o /dev/stdout; }} > {tmp_path}/new")
    assert proc.returncode == 0, proc.stderr
    ids = [json.loads(line)["id"] for line in results.read_text().splitlines()]
    assert ids == ["from before"] + [1, 2] * 4
    assert [json.loads(line)["id"] for line in (tmp_path / "new").read_text().splitlines()] == ["header", 1]
    assert "1 rows -> /dev/stdout: 1 embedded" in proc.stderr


def test_cli_output_to_a_named_pipe_reaches_its_reader(tiny_dir, tmp_path):
    """The writability check opened the pipe and closed it: its reader saw an end of file at once and left, and
    the run then waited forever for a reader."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        proc = _shell(f"embed one two three --model {tiny_dir} -o {fifo}")
        received = reader.communicate(timeout=60)[0]
    finally:
        reader.kill()
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in received.splitlines()] == [1, 2, 3]


@pytest.mark.parametrize("command, message", [
    ("embed one -o /dev/stdout --format npy >> OUT", "cannot write /dev/stdout: npy output needs a regular file "
     "given by its own name"),
    ("embed one -o /dev/stdout --format parquet >> OUT", "parquet output needs a regular file given by its own"),
    ("embed one -o - --format npy >> OUT", "npy output needs --output FILE or --output-dir (stdout takes JSONL"),
    ("embed -i OUT >> OUT", "stdout is the --input file OUT: the embeddings would be written into the input"),
    ("embed -i OUT -o /dev/stdout >> OUT", "--output /dev/stdout is the --input file OUT: the embeddings would be "
     "written into the input"),
    ("embed one -o /dev/fd/7", "cannot write /dev/fd/7: this process has no descriptor 7 open"),
    ("embed < OUT >> OUT", "stdout is stdin: the embeddings would be written into the input"),
    ("embed -o OUT --format jsonl < OUT", "--output OUT is stdin: writing it would destroy the input"),
    ("embed one -o SOCKET", "cannot write SOCKET: it is a socket, which cannot be opened as a file"),
    ("setsid embed one -o /dev/tty", "cannot write /dev/tty: No such device or address"),
    ("embed one -o - --output-dir RUN", "give --output or --output-dir, not both"),
], ids=["npy", "parquet", "dash-npy", "stdout-is-input", "dev-stdout-is-input", "closed-descriptor",
        "stdin-is-stdout", "stdin-is-output", "socket", "tty-without-a-terminal", "dash-and-output-dir"])
def test_cli_refuses_what_a_stream_cannot_take_before_loading_the_model(tmp_path, command, message):
    """Refused before the model loads (a missing --model is not what they report) and without touching OUT. A
    socket or /dev/tty without a terminal failed only when the first rows were written; '-o -' went unnoticed
    beside --output-dir."""
    out = tmp_path / "out.jsonl"
    out.write_text("one line\n")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "socket"))
    places = {"OUT": str(out), "SOCKET": str(tmp_path / "socket"), "RUN": str(tmp_path / "run")}
    for name, place in places.items():
        command, message = command.replace(name, place), message.replace(name, place)
    try:
        proc = _shell(command + " --model /nonexistent/model")
    finally:
        server.close()
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr
    assert out.read_text() == "one line\n" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("options", ["--model MISSING", "--format npy"], ids=["model-missing", "refused-option"])
def test_cli_a_named_pipes_reader_sees_its_end_when_the_run_does_not_start(tmp_path, options):
    """The pipe was released only by a run that failed after opening its output: a model that did not load, or an
    option refused before it, left the reader waiting for ever."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)  # the reader waits on the pipe before the run checks it
        proc = _shell(f"embed one two {options.replace('MISSING', str(tmp_path / 'missing'))} -o {fifo}")
        received = reader.communicate(timeout=20)[0]
    finally:
        reader.kill()
    assert proc.returncode == 1 and "fastbert: error:" in proc.stderr, proc.stderr
    assert received == ""


def test_cli_texts_of_only_invisible_characters_are_null_rows_and_a_note_says_why(tiny_dir, tmp_path, write_lines,
                                                                                  embed_cli):
    """A zero-width space, joiners, NUL and BEL, a byte order mark, a lone accent: they embedded as [CLS] [SEP],
    a vector like any other. Now blank: null rows as an empty line gives, counted in a note; --on-blank error
    stops at the first, naming its characters. Real text in any script stays."""
    lines = ["first", "\u200b", "\u200b\u200c", "\x00\x07", "\ufeff", "", "   ", "\u0301",
             "\u200bhello\u200c world", "\u202b\u0645\u0631\u062d\u0628\u0627\u202c",
             "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u65e5\u672c\u8a9e", "last"]
    source = write_lines(tmp_path / "in.txt", lines)
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / "out.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in records if r["embedding"] is None] == [2, 3, 4, 5, 6, 7, 8]
    assert "13 rows" in proc.stderr and "6 embedded, 7 null (blank)" in proc.stderr
    assert ("fastbert embed: note: 5 texts (lines 2, 3, 4, 5, 8) held only invisible characters (zero-width, format "
            "or control characters) or nothing the tokenizer keeps: they are blank") in proc.stderr
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "--on-blank", "error", check=False)
    assert proc.returncode == 1 and len(proc.stdout.splitlines()) == 1
    assert ("fastbert: error: line 2: blank text: only invisible characters (U+200B ZERO WIDTH SPACE) (--on-blank "
            "error) (1 row before it was written to stdout and is valid)") in proc.stderr
    jsonl = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "\u200b\u200c"}), json.dumps({"text": "a"})])
    proc = embed_cli("-i", str(jsonl), "--model", tiny_dir, "--on-blank", "error", check=False)
    assert "line 1: blank text: only invisible characters (U+200B ZERO WIDTH SPACE, U+200C ZERO WIDTH " \
           "NON-JOINER)" in proc.stderr
    proc = embed_cli("one", "\u2060", "--model", tiny_dir)
    assert [json.loads(line)["embedding"] is None for line in proc.stdout.splitlines()] == [False, True]
    assert "1 text (line 2) held only invisible characters" in proc.stderr
    proc = embed_cli("--similarity", "one", "\u200b", "--model", "/nonexistent/model", check=False)
    assert "--similarity: a TEXT is blank (TEXT 2: only invisible characters (U+200B ZERO WIDTH SPACE))" in proc.stderr


def test_cli_warns_about_truncation_and_shows_progress(tiny_dir, tmp_path, write_lines, embed_cli):
    source = write_lines(tmp_path / "in.txt", ["short", "long " * 100, "short again"])
    proc = embed_cli("-i", str(source), "--model", tiny_dir, "--max-length", "8", "--progress", "-o",
                     str(tmp_path / "o.jsonl"))
    assert "1 text was longer than 8 tokens and was truncated (lines 2)" in proc.stderr
    assert "fastbert embed: [########################] 100%" in proc.stderr  # the final progress line
    assert "tokens/s" in proc.stderr


def test_cli_parser_knows_the_corpus_options():
    args = cli.build_parser().parse_args(["embed", "-i", "x.txt", "--output-dir", "d", "--resume", "--pooling", "cls",
                                          "--no-normalize", "--max-batch-tokens", "4096", "--ray"])
    assert (args.input, args.output_dir, args.resume, args.pooling, args.normalize, args.max_batch_tokens,
            args.ray) == ("x.txt", "d", True, "cls", False, 4096, True)


# ------------------------------------------------------------------------------------------------------ memory
PEAK_RSS_GROWTH_MB = 64  # the stated bound: 10x the rows may add at most this much to the peak


def _peak_rss_mb(tiny_dir: str, source: Path, out: Path) -> float:
    code = ("import resource, sys; from fastbert import cli; code = cli.main(sys.argv[1:]); "
            "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, "embed", "-i", str(source), "--model", tiny_dir, "-o",
                           str(out)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stderr.split("PEAK")[-1].split()[0]) / 1024


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_corpus(tiny_dir, tmp_path, sentences, write_lines):
    small = write_lines(tmp_path / "small.txt", (sentences * 7)[:20_000])
    large = write_lines(tmp_path / "large.txt", (sentences * 67)[:200_000])
    small_peak = _peak_rss_mb(tiny_dir, small, tmp_path / "small.npy")
    large_peak = _peak_rss_mb(tiny_dir, large, tmp_path / "large.npy")
    assert np.load(tmp_path / "large.npy", mmap_mode="r").shape == (200_000, 32)
    assert large_peak <= small_peak + PEAK_RSS_GROWTH_MB, (small_peak, large_peak)


# ---------------------------------------------------------------------------------------------------------- ray
@pytest.mark.slow
def test_ray_output_equals_single_process_row_for_row(tiny_dir, tmp_path, sentences, write_lines, embed_cli):
    pytest.importorskip("ray", reason="Ray is an optional extra")
    # a blank line, a zero-width space, a lone accent (the tokenizer keeps nothing of it): null rows on Ray too
    source = write_lines(tmp_path / "in.txt", sentences[:300] + ["", "\u200b", "\u0301"] + sentences[300:500])
    embed_cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / "single.npy"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local cluster (2 CPUs, no dashboard)
    proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "-i", str(source), "--model", tiny_dir,
                           "-o", str(tmp_path / "ray.npy"), "--ray", "--ray-actors", "2", "--window-rows", "250"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "503 rows -> " in proc.stderr and "500 embedded, 3 null (blank)" in proc.stderr
    assert "2 texts (lines 302, 303) held only invisible characters" in proc.stderr
    single, on_ray = np.load(tmp_path / "single.npy"), np.load(tmp_path / "ray.npy")
    assert single.shape == on_ray.shape == (503, 32)
    assert np.isnan(on_ray[300:303]).all()
    np.testing.assert_allclose(on_ray, single, rtol=0, atol=1e-6)
