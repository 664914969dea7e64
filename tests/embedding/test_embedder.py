"""`fastbert embed` and `fastbert.embedding.embedder`: row alignment, input errors with line numbers, token-budget
batching, the output formats, resuming after a real SIGKILL, bounded memory, and agreement with
sentence-transformers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastbert import cli
from fastbert.embedding import embedder as embedding
from fastbert.training.corpus import cpython_sentences

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, minilm_dir):
    """A random 2-layer BERT (H 32) with all-MiniLM-L6-v2's tokenizer: fast enough for corpus-sized inputs."""
    import shutil

    import transformers

    directory = tmp_path_factory.mktemp("tiny-embedder")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config).eval().save_pretrained(directory)
    shutil.copy(os.path.join(minilm_dir, "tokenizer.json"), directory)
    return str(directory)


@pytest.fixture(scope="module")
def sentences():
    return list(cpython_sentences(limit=3000))


def _write_lines(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _cli(*argv, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


# ----------------------------------------------------------------------------------------------------- reading
def test_text_rows_keep_every_line_blank_ones_as_null():
    rows = list(embedding.read_rows([b"\xef\xbb\xbfone\r\n", b"\n", b"   \n", b"two\n", b"three"]))
    assert [(r.line, r.id, r.text) for r in rows] == [(1, 1, "one"), (2, 2, None), (3, 3, None), (4, 4, "two"),
                                                      (5, 5, "three")]


def test_jsonl_rows_with_field_and_id():
    lines = [b'{"body": "a text", "key": "doc-1"}\n', b'{"body": "", "key": 7}\n', b'\n',
             b'{"body": null, "key": "x"}\n']
    rows = list(embedding.read_rows(lines, "jsonl", "body", "key"))
    assert [(r.id, r.text) for r in rows] == [("doc-1", "a text"), (7, None), (3, None), ("x", None)]


@pytest.mark.parametrize("line, message", [
    (b"\xff\xfe bad bytes\n", "demo.txt:2: not valid UTF-8"),
], ids=["bad-utf8"])
def test_unreadable_text_line_names_its_line(line, message):
    rows = embedding.read_rows([b"fine\n", line, b"later\n"], name="demo.txt")
    assert next(rows).text == "fine"
    with pytest.raises(embedding.InputError, match=message):
        next(rows)


@pytest.mark.parametrize("line, message", [
    (b'{"other": "x"}', "in.jsonl:2: the object has no field 'text'"),
    (b'{"text": 3}', "in.jsonl:2: field 'text' holds int"),
    (b'{"text": "x"', "in.jsonl:2: not valid JSON"),
    (b'["text"]', "in.jsonl:2: expected a JSON object"),
], ids=["missing-field", "not-a-string", "bad-json", "not-an-object"])
def test_invalid_jsonl_row_names_its_line(line, message):
    rows = embedding.read_rows([b'{"text": "ok"}\n', line], "jsonl", name="in.jsonl")
    assert next(rows).text == "ok"
    with pytest.raises(embedding.InputError, match=message):
        next(rows)


# ----------------------------------------------------------------------------------------------------- batching
def test_batches_respect_the_token_budget_and_cover_every_text_once(tiny_dir):
    embedder = embedding.Embedder(tiny_dir, max_batch_tokens=200, max_batch_size=7)
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 128, size=300)]
    batches = embedder.batches(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(300))
    for batch in batches:
        assert len(batch) <= 7
        assert len(batch) * max(lengths[i] for i in batch) <= 200 or len(batch) == 1
    assert all(lengths[b[0]] >= lengths[c[0]] for b, c in zip(batches, batches[1:], strict=False))  # longest first


def test_embeddings_come_back_in_input_order_and_do_not_depend_on_the_batch(tiny_dir, sentences):
    embedder = embedding.Embedder(tiny_dir, max_batch_tokens=256)
    texts = sentences[:40] + [None] + sentences[40:60]
    together, stats = embedder.embed(texts)
    alone = np.stack([embedder.embed([t])[0][0] if t is not None else np.full(32, np.nan, np.float32)
                      for t in texts])
    np.testing.assert_allclose(together, alone, rtol=0, atol=2e-6)
    assert np.isnan(together[40]).all() and not np.isnan(np.delete(together, 40, axis=0)).any()
    assert (stats.rows, stats.embedded, stats.null_rows) == (61, 60, 1)
    assert stats.batches > 1


def test_long_texts_are_truncated_and_counted(tiny_dir):
    embedder = embedding.Embedder(tiny_dir, max_length=16)
    long_text = " ".join(["word"] * 50)
    vectors, stats = embedder.embed(["short one", long_text, long_text + " more"], lines=[10, 11, 12])
    assert (stats.truncated, stats.truncated_lines) == (2, [11, 12])
    np.testing.assert_allclose(vectors[1], vectors[2], atol=1e-6)  # both cut to the same 16 tokens


def test_matches_sentence_transformers_encode(minilm_dir, sentences):
    from sentence_transformers import SentenceTransformer

    texts = sentences[100:164] + ["word " * 400]  # one text longer than max_seq_length (256)
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, convert_to_numpy=True,
                                                                      normalize_embeddings=True)
    ours, stats = embedding.Embedder(minilm_dir).embed(texts)
    assert stats.truncated == 1
    np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-6)


# ---------------------------------------------------------------------------------------------------------- CLI
def test_cli_text_file_to_each_format_one_row_per_line(tiny_dir, tmp_path, sentences):
    lines = sentences[:30] + [""] + sentences[30:45]
    source = _write_lines(tmp_path / "in.txt", lines)
    for name in ("out.jsonl", "out.npy", "out.parquet"):
        proc = _cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / name), "--window-rows", "8")
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


def test_cli_bad_row_stops_with_its_line_and_keeps_earlier_rows(tiny_dir, tmp_path):
    rows = [json.dumps({"text": f"row {i}"}) for i in range(10)] + ['{"txt": "oops"}'] + ['{"text": "after"}']
    source = _write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.npy"
    proc = _cli("-i", str(source), "--model", tiny_dir, "-o", str(out), "--window-rows", "4", check=False)
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
def test_cli_errors_are_one_line(tiny_dir, tmp_path, argv, message):
    source = _write_lines(tmp_path / "in.txt", ["first", "", "third"])
    argv = [str(source) if a == "IN" else str(tmp_path / a) if a == "out.csv" else a for a in argv]
    if "--model" not in argv:
        argv += ["--model", tiny_dir]
    proc = _cli(*argv, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_cli_stops_quietly_when_the_reader_of_stdout_goes_away(tiny_dir, tmp_path, sentences):
    source = _write_lines(tmp_path / "in.txt", sentences[:400])
    proc = subprocess.run(f"{sys.executable} -m fastbert.cli embed -i {source} --model {tiny_dir} --window-rows 50 "
                          "| head -n 2", shell=True, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert len(proc.stdout.splitlines()) == 2
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_cli_warns_about_truncation_and_shows_progress(tiny_dir, tmp_path):
    source = _write_lines(tmp_path / "in.txt", ["short", "long " * 100, "short again"])
    proc = _cli("-i", str(source), "--model", tiny_dir, "--max-length", "8", "--progress", "-o",
                str(tmp_path / "o.jsonl"))
    assert "1 texts were longer than 8 tokens and were truncated (lines 2)" in proc.stderr
    assert "fastbert embed: [########################] 100%" in proc.stderr  # the final progress line
    assert "tokens/s" in proc.stderr


# ------------------------------------------------------------------------------------------------- resumable
def test_sharded_output_resumes_after_sigkill_without_missing_or_repeated_rows(tiny_dir, tmp_path, sentences):
    source = _write_lines(tmp_path / "in.txt", sentences[:2400])
    complete, killed = tmp_path / "complete", tmp_path / "killed"
    args = ["-i", str(source), "--model", tiny_dir, "--window-rows", "100", "--format", "npy"]
    _cli(*args, "--output-dir", str(complete))
    proc = subprocess.Popen([sys.executable, "-m", "fastbert.cli", "embed", *args, "--output-dir", str(killed)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = killed / embedding.MANIFEST
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = json.loads(manifest.read_text())
    assert not state["complete"] and 3 <= len(state["shards"]) < 24  # killed mid-run
    resumed = _cli(*args, "--output-dir", str(killed), "--resume")
    assert f"resuming after row {len(state['shards']) * 100:,}" in resumed.stderr
    ids_a, vectors_a = embedding.read_output(complete)
    ids_b, vectors_b = embedding.read_output(killed)
    assert ids_b == ids_a == list(range(1, 2401))
    np.testing.assert_array_equal(vectors_b, vectors_a)
    assert json.loads(manifest.read_text())["complete"]
    assert json.loads(manifest.read_text())["stats"]["rows"] == 2400
    again = _cli(*args, "--output-dir", str(killed), "--resume")
    assert "nothing to resume" in again.stderr


@pytest.mark.parametrize("output_format", ["jsonl", "parquet", "npy"])
def test_sharded_output_in_each_format_reads_back_like_a_single_file(tiny_dir, tmp_path, output_format):
    rows = [json.dumps({"text": f"text number {i}" if i % 9 else "", "key": f"doc-{i}"}) for i in range(23)]
    source = _write_lines(tmp_path / "in.jsonl", rows)
    _cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / "single.npy"))
    _cli("-i", str(source), "--model", tiny_dir, "--id-field", "key", "--output-dir", str(tmp_path / "run"),
         "--format", output_format, "--window-rows", "10")
    ids, vectors = embedding.read_output(tmp_path / "run")
    assert ids == [f"doc-{i}" for i in range(23)]
    assert len(json.loads((tmp_path / "run" / embedding.MANIFEST).read_text())["shards"]) == 3
    # null rows are NaN in both (assert_allclose compares NaN positions); other windows batch differently
    np.testing.assert_allclose(vectors, np.load(tmp_path / "single.npy"), rtol=0, atol=1e-6)


def test_resume_refuses_other_settings_and_an_existing_run(tiny_dir, tmp_path):
    source = _write_lines(tmp_path / "in.txt", ["one", "two", "three"])
    out = tmp_path / "run"
    _cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out))
    proc = _cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out), check=False)
    assert proc.returncode == 1 and "already holds a run" in proc.stderr
    proc = _cli("-i", str(source), "--model", tiny_dir, "--output-dir", str(out), "--resume", "--pooling", "cls",
                check=False)
    assert proc.returncode == 1 and "pooling was 'mean', now 'cls'" in proc.stderr


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
def test_peak_memory_does_not_grow_with_the_corpus(tiny_dir, tmp_path, sentences):
    small = _write_lines(tmp_path / "small.txt", (sentences * 7)[:20_000])
    large = _write_lines(tmp_path / "large.txt", (sentences * 67)[:200_000])
    small_peak = _peak_rss_mb(tiny_dir, small, tmp_path / "small.npy")
    large_peak = _peak_rss_mb(tiny_dir, large, tmp_path / "large.npy")
    assert np.load(tmp_path / "large.npy", mmap_mode="r").shape == (200_000, 32)
    assert large_peak <= small_peak + PEAK_RSS_GROWTH_MB, (small_peak, large_peak)


# ---------------------------------------------------------------------------------------------------------- ray
@pytest.mark.slow
def test_ray_output_equals_single_process_row_for_row(tiny_dir, tmp_path, sentences):
    pytest.importorskip("ray", reason="Ray is an optional extra")
    source = _write_lines(tmp_path / "in.txt", sentences[:300] + [""] + sentences[300:500])
    _cli("-i", str(source), "--model", tiny_dir, "-o", str(tmp_path / "single.npy"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local cluster (2 CPUs, no dashboard)
    proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", "-i", str(source), "--model", tiny_dir,
                           "-o", str(tmp_path / "ray.npy"), "--ray", "--ray-actors", "2", "--window-rows", "250"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    single, on_ray = np.load(tmp_path / "single.npy"), np.load(tmp_path / "ray.npy")
    assert single.shape == on_ray.shape == (501, 32)
    assert np.isnan(on_ray[300]).all()
    np.testing.assert_allclose(on_ray, single, rtol=0, atol=1e-6)


def test_cli_parser_knows_the_corpus_options():
    args = cli.build_parser().parse_args(["embed", "-i", "x.txt", "--output-dir", "d", "--resume", "--pooling", "cls",
                                          "--no-normalize", "--max-batch-tokens", "4096", "--ray"])
    assert (args.input, args.output_dir, args.resume, args.pooling, args.normalize, args.max_batch_tokens,
            args.ray) == ("x.txt", "d", True, "cls", False, 4096, True)


def test_embeds_a_modernbert_checkpoint_like_transformers(tmp_path, minilm_dir, sentences):
    """Any supported checkpoint directory: a random ModernBERT (rotary, local windows shorter than the texts)."""
    import shutil

    import transformers

    config = transformers.ModernBertConfig(
        vocab_size=30522, hidden_size=64, num_hidden_layers=3, num_attention_heads=2, intermediate_size=96,
        max_position_embeddings=512, local_attention=16, global_attn_every_n_layers=3, pad_token_id=0,
        bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102)
    torch.manual_seed(0)
    transformers.ModernBertModel(config).eval().save_pretrained(tmp_path)
    shutil.copy(os.path.join(minilm_dir, "tokenizer.json"), tmp_path)
    texts = sentences[:24]
    embedder = embedding.Embedder(str(tmp_path))
    ours, _ = embedder.embed(texts)
    model = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = [embedder.tokenize([t])[0][0] for t in texts]
    for row, tokens in enumerate(ids):  # one text at a time: no padding on the reference side
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        expected = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0).numpy()
        np.testing.assert_allclose(ours[row], expected, rtol=0, atol=2e-6)
    assert max(len(t) for t in ids) > 16  # texts longer than the local window


def test_pooling_and_normalisation_default_to_the_checkpoints_sentence_transformers_modules(tmp_path, minilm_dir,
                                                                                            sentences):
    """A CLS-pooled checkpoint (bge-style 1_Pooling) without a Normalize module: the defaults follow it and match
    sentence-transformers' encode; an unsupported pooling is refused unless --pooling is given."""
    import shutil

    from sentence_transformers import SentenceTransformer

    directory = tmp_path / "cls-model"
    shutil.copytree(minilm_dir, directory)
    pooling_config = json.loads((directory / "1_Pooling" / "config.json").read_text())
    pooling_config.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    modules = [m for m in json.loads((directory / "modules.json").read_text()) if "Normalize" not in m["type"]]
    (directory / "modules.json").write_text(json.dumps(modules))
    texts = sentences[:16]
    reference = SentenceTransformer(str(directory), device="cpu").encode(texts, convert_to_numpy=True)
    embedder = embedding.Embedder(str(directory))
    assert (embedder.pooling, embedder.normalize) == ("cls", False)
    np.testing.assert_allclose(embedder.embed(texts)[0], reference, rtol=0, atol=2e-5)
    pooling_config.update(pooling_mode_cls_token=False, pooling_mode_max_tokens=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    with pytest.raises(embedding.UserError, match="pools with max_tokens"):
        embedding.Embedder(str(directory))
    assert embedding.Embedder(str(directory), pooling="mean").pooling == "mean"


def test_a_non_finite_embedding_stops_with_its_line(tiny_dir):
    embedder = embedding.Embedder(tiny_dir)
    original = embedder._forward

    def overflowing(token_lists):
        out = original(token_lists).clone()
        out[-1, 3] = float("inf")  # the shortest text of the batch: "b"
        return out

    embedder._forward = overflowing
    with pytest.raises(embedding.InputError, match="line 12: the embedding is not finite"):
        embedder.embed(["a longer text here", "b"], lines=[11, 12])
