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
    with pytest.warns(UserWarning, match="dtype auto on CPU: (float32|bfloat16)") as record:
        _vectors(capsys, "--dtype", "auto")
    expected = "bfloat16" if quantization.auto_cpu_dtype()[0] == torch.bfloat16 else "float32"
    assert sum("dtype auto" in str(w.message) for w in record) == 1 and expected in str(record[0].message)


def test_embed_auto_with_native_bfloat16_runs_bfloat16(capsys, monkeypatch):
    monkeypatch.setattr(quantization, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "avx512_bf16"))
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    reference, _ = _vectors(capsys, "--dtype", "float32")
    with pytest.warns(UserWarning, match="bfloat16: the CPU computes it natively"):
        auto, _ = _vectors(capsys, "--dtype", "auto")
    assert float((auto * reference).sum(-1).min()) > 0.99 and not torch.equal(auto, reference)


def test_embed_unknown_dtype_is_one_line(capsys):
    code = cli.main(["embed", "--dtype", "int4", "hello"])
    _, err = capsys.readouterr()
    assert code != 0 and "int4" in err and "int8" in err and "Traceback" not in err
