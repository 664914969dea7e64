"""`fastbert tune`: fills the tuning cache with each op's measured choice at the given shapes, reuses it on a second
run, `--clear` empties it, and bad input is one line on stderr."""

from __future__ import annotations

import json

import pytest
import torch

from fastbert import backends, cli
from fastbert.backends import tuning
from fastbert.cli import shared
from tests.helpers import tiny_model


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache directory of the test's own; measuring back off afterwards (tune turns it on in-process)."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path / "cache"))
    tuning.forget()
    threads = torch.get_num_threads()
    yield tmp_path / "cache"
    torch.set_num_threads(threads)
    backends.set_measuring(False)
    tuning.forget()


def _run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def _table_rows(out: str, table: int = 1) -> list[list[str]]:
    """The rows of a printed table (1: the ops', 2: the whole model's; columns split on two or more spaces)."""
    lines = out.split("\n\n")[table].splitlines()[2:]
    return [[cell for cell in line.split("  ") if cell.strip()] for line in lines]


def test_tune_measures_every_op_once_then_reads_the_cache(capsys, cache, tmp_path):
    tiny_model("bert", num_hidden_layers=2).save_pretrained(tmp_path / "model")
    argv = ["tune", "--model", str(tmp_path / "model"), "--device", "cpu", "--batch", "3", "--seq", "7", "--threads",
            "1", "--no-varlen"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    rows = _table_rows(out)
    ops = {row[0].strip() for row in rows}
    assert {"embedding_layernorm", "qkv_projection", "attention", "linear_activation",
            "linear_residual_layernorm"} <= ops
    assert all(row[-1].strip() == "measured now" for row in rows), out
    assert all(row[2].strip() in ("cpp", "onednn", "eager") for row in rows)
    [whole] = _table_rows(out, 2)  # one whole-model class: the per-op table against each backend alone
    assert whole[1].strip() in (backends.MODEL_TABLE, "cpp", "onednn") and whole[-1].strip() == "measured now"
    assert all(f"{name} " in whole[2] for name in (backends.MODEL_TABLE, "cpp", "onednn")), whole
    files = list((cache / "tuning").glob("*.json"))
    assert len(files) == 1 and f"cache: {files[0]} ({len(rows) + 1} shape classes" in out
    stored = json.loads(files[0].read_text())["entries"]
    assert len(stored) == len(rows) + 1 and all(" no-grad t1 " in c for c in stored)
    tuning.forget()  # as a new process would
    code, again, _ = _run(capsys, *argv)
    assert code == 0 and {row[-1].strip() for row in _table_rows(again) + _table_rows(again, 2)} == {"cache"}
    assert json.loads(files[0].read_text())["entries"] == stored


def test_tune_training_adds_the_grad_classes(capsys, cache, tmp_path):
    tiny_model("bert", num_hidden_layers=1).save_pretrained(tmp_path / "model")
    code, out, err = _run(capsys, "tune", "--model", str(tmp_path / "model"), "--batch", "2", "--seq", "5",
                          "--training", "--threads", "1", "--device", "cpu")
    assert code == 0, err
    stored = json.loads(next((cache / "tuning").glob("*.json")).read_text())["entries"]
    assert any(" grad " in c for c in stored) and any(" no-grad " in c for c in stored)
    assert "only candidate" in out  # the LayerNorm ops with dropout: cpp declines dropout, eager alone runs them


def test_tune_clear_empties_the_cache(capsys, cache):
    tuning.record(torch.device("cpu"), "an op class", tuning.Entry("eager", {"eager": 1.0, "cpp": 2.0}, 3))
    assert list((cache / "tuning").glob("*.json"))
    code, out, _ = _run(capsys, "tune", "--clear")
    assert code == 0 and out == f"removed 1 tuning file(s) from {cache / 'tuning'}\n"
    assert not list((cache / "tuning").glob("*.json"))


@pytest.mark.parametrize("argv, message", [
    (["tune", "--seq", "0"], "--batch and --seq values must be positive"),
    (["tune", "--seq", "100000"], "exceeds the model's 512 positions"),
    (["tune", "--model", "/no/such/dir"], "does not exist"),
    (["tune", "--dtype", "int4"], "dtype 'int4' is not supported"),
    (["tune", "--threads", "0"], "--threads must be >= 1"),
    (["tune", "--batch"], "expected at least one argument"),
], ids=["zero-seq", "too-long", "missing-path", "bad-dtype", "no-threads", "usage"])
def test_tune_errors_are_one_line(capsys, cache, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("fastbert: error: ") and message in err, err


def test_tune_refuses_a_cache_it_cannot_write_before_it_measures(capsys, cache, monkeypatch, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(afile / "cache"))
    monkeypatch.setattr(shared, "load_fastbert", lambda *args: pytest.fail("the model loaded before the check"))
    code, out, err = _run(capsys, "tune", "--batch", "1", "--seq", "4")
    assert code == 1 and out == ""
    assert err == f"fastbert: error: the tuning cache {afile}/cache/tuning cannot be written (Not a directory); " \
                  "FASTBERT_CACHE_DIR moves it\n"


def test_tune_refuses_a_forced_backend(capsys, cache, monkeypatch):
    monkeypatch.setenv("FASTBERT_BACKEND", "eager")
    backends.read_environment()
    try:
        code, _, err = _run(capsys, "tune", "--batch", "1", "--seq", "4")
    finally:
        monkeypatch.delenv("FASTBERT_BACKEND")
        backends.read_environment()
    assert code == 1 and err == "fastbert: error: FASTBERT_BACKEND=eager forces a backend: nothing to measure\n"
