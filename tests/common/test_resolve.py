"""fastbert.common.resolve: what a user names (checkpoint, device, dtype) is checked, and every problem they can fix
is a UserError (one line, no traceback, in the CLI)."""

import json
import threading

import pytest
import torch

from fastbert.common import resolve


def test_resolve_errors_are_user_errors(tmp_path):
    with pytest.raises(resolve.UserError, match="does not exist"):
        resolve.resolve_model(str(tmp_path / "absent"))
    for empty in ("", "  "):  # (an unset shell variable: not the default model in silence)
        with pytest.raises(resolve.UserError, match="model path is empty"):
            resolve.resolve_model(empty)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(resolve.UserError, match="not supported"):
        resolve.resolve_model(str(tmp_path))
    with pytest.raises(resolve.UserError, match="dtype"):
        resolve.resolve_dtype("float64", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(resolve.UserError, match="not present"):
            resolve.resolve_device("cuda")


def test_resolve_device_refuses_devices_that_are_not_there(monkeypatch):
    assert resolve.resolve_device("cpu") == torch.device("cpu")
    assert resolve.resolve_device("cpu:0") == torch.device("cpu:0")
    with pytest.raises(resolve.UserError, match="one CPU device"):
        resolve.resolve_device("cpu:5")
    with pytest.raises(resolve.UserError, match="unknown device"):
        resolve.resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(resolve.UserError, match=r"is not present \(torch sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        resolve.resolve_device("cuda:2")


def test_precision_auto_follows_the_cpu_and_int8_is_for_embed_and_serve(monkeypatch):
    from fastbert import quantization

    cpu = torch.device("cpu")
    monkeypatch.setattr(quantization, "announce_once", lambda message: None)
    assert resolve.resolve_precision(None, cpu) == "float32"
    monkeypatch.setattr(quantization, "cpu_flags", lambda: ("avx512f", "avx512_vnni"))
    assert resolve.resolve_precision("auto", cpu) == "float32"
    monkeypatch.setattr(quantization, "cpu_flags", lambda: ("avx512f", "amx_bf16", "amx_tile"))
    assert resolve.resolve_dtype("auto", cpu) == torch.bfloat16  # announced once per process (quantization tests)
    assert resolve.resolve_precision("int8", cpu) == "int8"
    with pytest.raises(resolve.UserError, match="int8 applies to fastbert embed and fastbert serve"):
        resolve.resolve_dtype("int8", cpu)
    with pytest.raises(resolve.UserError, match="'int4' is not supported"):
        resolve.resolve_precision("int4", cpu)


def test_a_creatable_output_dir_is_checked_without_leaving_it_behind(tmp_path):
    resolve.check_dir_creatable(tmp_path / "a" / "b" / "c", "-o")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    resolve.check_dir_creatable(tmp_path / "kept", "-o")
    assert (tmp_path / "kept").is_dir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(resolve.UserError, match=r"^--out .*afile exists and is not a directory$"):
        resolve.check_dir_creatable(tmp_path / "afile", "--out")
    with pytest.raises(resolve.UserError, match=r"afile/sub: cannot create the directory \(Not a directory\)$"):
        resolve.check_dir_creatable(tmp_path / "afile" / "sub", "--out")


def test_processes_started_together_can_check_the_same_output_dir(tmp_path):
    """torchrun's ranks all check -o at once: a check that created and removed the directory failed one of them."""
    target = tmp_path / "runs" / "pair"
    errors = []

    def check_many_times():
        for _ in range(300):
            try:
                resolve.check_dir_creatable(target, "-o")
            except Exception as err:  # noqa: BLE001 - any failure is the race
                errors.append(err)

    threads = [threading.Thread(target=check_many_times) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and list(tmp_path.iterdir()) == []


def test_a_missing_dir_under_one_that_takes_no_files_is_refused():
    with pytest.raises(resolve.UserError, match=r"^-o /proc/x/y: cannot create the directory in /proc \("):
        resolve.check_dir_creatable("/proc/x/y", "-o")


def test_an_existing_output_dir_no_file_can_be_written_in_is_refused(tmp_path):
    # /proc exists and is a directory, but refuses new files, even to root (chmod would not stop root)
    with pytest.raises(resolve.UserError, match=r"^--output-dir /proc: cannot write in the directory \("):
        resolve.check_dir_creatable("/proc", "--output-dir")
    resolve.check_dir_creatable(tmp_path, "--output-dir")
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_an_existing_output_file_is_judged_by_its_own_permission(monkeypatch, tmp_path):
    resolve.check_file_writable("/dev/null", "--output")  # a device: written, never created (its directory refuses)
    resolve.check_file_writable(tmp_path / "new.jsonl", "--output")
    with pytest.raises(resolve.UserError, match=r"^--output /proc/version: cannot write in /proc \("):
        resolve.check_file_writable("/proc/version", "--output", replaced=True)  # a new file beside it, moved over it
    monkeypatch.setattr(resolve.os, "access", lambda path, mode: False)  # a read-only file (root may write any)
    with pytest.raises(resolve.UserError, match=r"^--output /dev/null: cannot write the file \(permission denied\)$"):
        resolve.check_file_writable("/dev/null", "--output")
