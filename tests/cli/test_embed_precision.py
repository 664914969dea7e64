"""`fastbert embed --dtype int8 | auto`: int8 GEMMs on CPU, and the CPU's precision chosen by auto (with its
reason, once); the errors are one line."""

import json

import pytest
import torch

from fastbert import cli, quantization

TEXTS = ("A cat is sleeping on the sofa.", "A kitten naps on the couch.",
         "The stock market fell sharply after the announcement.", "x")


def _vectors(capsys, *options):
    code = cli.main(["embed", *options, *TEXTS])
    out, err = capsys.readouterr()
    assert code == 0, err
    return torch.tensor([json.loads(line)["embedding"] for line in out.splitlines()]), err


def test_embed_int8_is_close_to_float32(capsys):
    reference, _ = _vectors(capsys, "--dtype", "float32")
    int8, _ = _vectors(capsys, "--dtype", "int8")
    assert int8.shape == reference.shape == (len(TEXTS), 384)
    assert float((int8 * reference).sum(-1).min()) > 0.99
    assert float((int8 - reference).abs().max()) > 0  # int8 did run: not the float32 numbers


def test_embed_auto_says_what_it_chose_and_why(capsys, monkeypatch):
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    with pytest.warns(UserWarning, match="dtype auto for embeddings: (float32|bfloat16)") as record:
        _vectors(capsys, "--dtype", "auto")
    expected = "bfloat16" if quantization.auto_cpu_dtype()[0] == torch.bfloat16 else "float32"
    assert sum("dtype auto" in str(w.message) for w in record) == 1 and expected in str(record[0].message)


def test_embed_auto_with_fast_native_bfloat16_runs_bfloat16(capsys, monkeypatch):
    monkeypatch.setattr(quantization, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "amx_bf16"))
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    reference, _ = _vectors(capsys, "--dtype", "float32")
    with pytest.warns(UserWarning, match="bfloat16: the CPU has AMX tiles"):
        auto, _ = _vectors(capsys, "--dtype", "auto")
    assert float((auto * reference).sum(-1).min()) > 0.99 and not torch.equal(auto, reference)


@pytest.mark.parametrize("command, dtype", [("embed", "auto"), ("serve", "auto"), ("check", None), ("bench", None)])
def test_embed_and_serve_default_to_auto_and_the_others_keep_theirs(command, dtype):
    assert cli.build_parser().parse_args([command]).dtype == dtype


def test_embed_without_dtype_runs_autos_choice_and_float32_stays_exact(capsys, monkeypatch):
    monkeypatch.setattr(quantization, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "amx_bf16"))
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    exact, _ = _vectors(capsys, "--dtype", "float32")
    with pytest.warns(UserWarning, match="dtype auto for embeddings: bfloat16"):
        default, _ = _vectors(capsys)
    assert float((default * exact).sum(-1).min()) > 0.99 and not torch.equal(default, exact)
    again, _ = _vectors(capsys, "--dtype", "float32")
    assert torch.equal(again, exact)


def test_embed_unknown_dtype_is_one_line(capsys):
    code = cli.main(["embed", "--dtype", "int4", "hello"])
    _, err = capsys.readouterr()
    assert code != 0 and "int4" in err and "int8" in err and "Traceback" not in err


def test_auto_is_announced_as_one_plain_line_and_a_file_path_text_gets_a_note(tmp_path, capsys, monkeypatch):
    """The CLI prints fastbert's warnings as their own line (no source path); a TEXT that names a file is embedded
    as text, with a note pointing at -i. (pytest records warnings instead of showing them: shown here as Python
    shows them outside pytest, through warnings.formatwarning.)"""
    import sys
    import warnings

    from fastbert import quantization
    from fastbert.cli import main

    monkeypatch.setattr(quantization, "_ANNOUNCED", set())  # announced once per process: not yet, here
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # main installs its own
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A man is eating food.\nHello world\n")
    out = tmp_path / "out.jsonl"
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["embed", str(corpus), "-o", str(out), "--dtype", "auto"]) == 0
    err = capsys.readouterr().err
    assert f"note: TEXT '{corpus}' names a file" in err
    assert "fastbert: dtype auto for embeddings: " in err
    assert "embedder.py" not in err and "UserWarning" not in err
    assert len(out.read_text().splitlines()) == 1
