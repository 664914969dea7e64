"""fastbert.embedding.Embedder: embeddings in input order whatever the batching, truncation counted, the
checkpoint's sentence-transformers head followed, agreement with sentence-transformers and transformers, and a
non-finite embedding stopped with its line."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from fastbert.common.resolve import UserError
from fastbert.embedding import Embedder, InputError


def test_batches_follow_the_token_budget_settings(tiny_dir):
    embedder = Embedder(tiny_dir, max_batch_tokens=200, max_batch_size=7)
    lengths = [int(n) for n in np.random.default_rng(0).integers(1, 128, size=300)]
    batches = embedder.batches(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(300))
    assert all(len(batch) <= 7 and (sum(lengths[i] for i in batch) <= 200 or len(batch) == 1)
               for batch in batches)


def test_settings_below_one_longest_text_are_refused(tiny_dir):
    with pytest.raises(UserError, match=r"^--max-length must lie in \[3, 128\] for this model, got 1000$"):
        Embedder(tiny_dir, max_length=1000)
    with pytest.raises(UserError, match="must be at least --max-length"):
        Embedder(tiny_dir, max_length=64, max_batch_tokens=32)
    with pytest.raises(UserError, match="--batch-size must be >= 1"):
        Embedder(tiny_dir, max_batch_size=0)
    with pytest.raises(UserError, match="pooling must be one of"):
        Embedder(tiny_dir, pooling="max")
    assert Embedder(tiny_dir, max_length=64, load_model=False).max_batch_tokens >= 64


def test_every_setting_is_checked_before_auto_measures_or_announces_a_dtype(tiny_dir, monkeypatch):
    def chosen(*args, **kwargs):
        raise AssertionError("a setting was checked after the dtype was chosen")

    monkeypatch.setattr(Embedder, "_precision", chosen)
    for settings, message in [(dict(max_batch_size=0), "--batch-size must be >= 1"),
                              (dict(max_length=64, max_batch_tokens=32), "must be at least --max-length"),
                              (dict(pooling="max"), "pooling must be one of"),
                              (dict(max_length=2), r"must lie in \[3, 128\]")]:
        with pytest.raises(UserError, match=message):
            Embedder(tiny_dir, dtype="auto", **settings)


@pytest.mark.parametrize("vocab_only", [False, True], ids=["tokenizer.json", "vocab.txt"])
def test_a_max_length_without_room_beside_the_special_tokens_is_refused(tiny_dir, minilm_dir, tmp_path, vocab_only):
    """A tokenizer cannot cut a text below its [CLS] and [SEP]: it left every text whole, and a long one failed
    later with a traceback."""
    if vocab_only:  # transformers' tokenizer instead of the tokenizers library's
        for name in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(tiny_dir, name), tmp_path / name)
        shutil.copy(os.path.join(minilm_dir, "vocab.txt"), tmp_path / "vocab.txt")
        tiny_dir = str(tmp_path)
    for too_short in (0, 1, 2):
        with pytest.raises(UserError, match=rf"^--max-length must lie in \[3, 128\] for this model, got {too_short}: "
                                            r"the tokenizer adds 2 special tokens to a text$"):
            Embedder(tiny_dir, max_length=too_short, load_model=False)
    embedder = Embedder(tiny_dir, max_length=3)
    ids, truncated = embedder.tokenize(["word " * 1000, "a"])
    assert [len(row) for row in ids] == [3, 3] and truncated == [True, False]
    assert np.isfinite(embedder.embed(["word " * 1000])[0]).all()


def test_embeddings_come_back_in_input_order_and_do_not_depend_on_the_batch(tiny_dir, sentences):
    embedder = Embedder(tiny_dir, max_batch_tokens=256)
    texts = sentences[:40] + [None] + sentences[40:60]
    together, stats = embedder.embed(texts)
    alone = np.stack([embedder.embed([t])[0][0] if t is not None else np.full(32, np.nan, np.float32)
                      for t in texts])
    np.testing.assert_allclose(together, alone, rtol=0, atol=2e-6)
    assert np.isnan(together[40]).all() and not np.isnan(np.delete(together, 40, axis=0)).any()
    assert (stats.rows, stats.embedded, stats.null_rows) == (61, 60, 1)
    assert stats.batches > 1


def test_blank_texts_are_null_rows_as_blank_lines_are_in_the_cli(tiny_dir, sentences):
    vectors, stats = Embedder(tiny_dir).embed([sentences[0], "", " \t", "\u00a0", None, sentences[1]])
    assert np.isnan(vectors[1:5]).all() and not np.isnan(vectors[[0, 5]]).any()
    assert (stats.rows, stats.embedded, stats.null_rows) == (6, 2, 4)


def test_texts_of_only_invisible_characters_are_null_rows_like_blank_ones(tiny_dir, sentences):
    """They embedded as [CLS] [SEP] alone: one vector shared by all of them, taken for a real result. Texts the
    tokenizer keeps nothing of (a lone accent, which an uncased BERT strips; a private-use character) too. Real
    text in any script, with such characters inside, is embedded."""
    invisible = ["\u200b", "\u200b\u200c", "\x00\x07", "\ufeff", "\u200e", "\u0301", "\ue000"]
    visible = [sentences[0], "\u200bhello\u200c world", "\u202b\u0645\u0631\u062d\u0628\u0627\u202c",
               "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u65e5\u672c\u8a9e", "\ufeffword", "a\u0301"]
    embedder = Embedder(tiny_dir)
    vectors, stats = embedder.embed(visible + invisible + ["", None], lines=list(range(101, 101 + 16)))
    assert not np.isnan(vectors[:7]).any() and np.isnan(vectors[7:]).all()
    assert (stats.rows, stats.embedded, stats.null_rows, stats.invisible) == (16, 7, 9, 7)
    assert stats.invisible_lines == list(range(108, 115))  # the invisible ones, not the empty text nor None
    np.testing.assert_array_equal(vectors[1], embedder.embed(["hello world"])[0][0])  # the same tokens
    assert embedder.kept_nothing(["\u0301", "a\u0301", "\ue000", "x", "\u200b"]) == [
        "nothing the tokenizer keeps (U+0301 COMBINING ACUTE ACCENT)", None,
        "nothing the tokenizer keeps (U+E000)", None, "nothing the tokenizer keeps (U+200B ZERO WIDTH SPACE)"]


@pytest.mark.parametrize("texts, message", [
    ("How old are you?", "not a single string: embed\\(\\[text\\]\\)"),
    (["fine", 3], "text 2 is a int, not a string"),
    ([b"bytes"], "text 1 is a bytes, not a string"),
])
def test_texts_that_are_not_a_list_of_strings_are_a_type_error(tiny_dir, texts, message):
    with pytest.raises(TypeError, match=message):
        Embedder(tiny_dir).embed(texts)


def test_embed_reports_each_batch_as_it_is_done(tiny_dir, sentences):
    embedder = Embedder(tiny_dir, max_batch_size=8)
    reported = []
    _, stats = embedder.embed(sentences[:20] + [None], on_batch=lambda texts, tokens: reported.append((texts, tokens)))
    assert len(reported) == stats.batches == 3
    assert sum(texts for texts, _ in reported) == 20 and sum(tokens for _, tokens in reported) == stats.tokens


def test_long_texts_are_truncated_and_counted(tiny_dir):
    embedder = Embedder(tiny_dir, max_length=16)
    long_text = " ".join(["word"] * 50)
    vectors, stats = embedder.embed(["short one", long_text, long_text + " more"], lines=[10, 11, 12])
    assert (stats.truncated, stats.truncated_lines) == (2, [11, 12])
    np.testing.assert_allclose(vectors[1], vectors[2], atol=1e-6)  # both cut to the same 16 tokens


def test_matches_sentence_transformers_encode(minilm_dir, sentences):
    from sentence_transformers import SentenceTransformer

    texts = sentences[100:164] + ["word " * 400]  # one text longer than max_seq_length (256)
    reference = SentenceTransformer(minilm_dir, device="cpu").encode(texts, convert_to_numpy=True,
                                                                      normalize_embeddings=True)
    ours, stats = Embedder(minilm_dir).embed(texts)
    assert stats.truncated == 1
    np.testing.assert_allclose(ours, reference, rtol=0, atol=5e-6)


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
    embedder = Embedder(str(tmp_path))
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
    embedder = Embedder(str(directory))
    assert (embedder.pooling, embedder.normalize) == ("cls", False)
    np.testing.assert_allclose(embedder.embed(texts)[0], reference, rtol=0, atol=2e-5)
    pooling_config.update(pooling_mode_cls_token=False, pooling_mode_max_tokens=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    with pytest.raises(UserError, match="pools with max_tokens"):
        Embedder(str(directory))
    assert Embedder(str(directory), pooling="mean").pooling == "mean"


def test_a_non_finite_embedding_stops_with_its_line(tiny_dir):
    embedder = Embedder(tiny_dir)
    original = embedder.embed_batch

    def overflowing(token_lists):
        out = original(token_lists).clone()
        out[-1, 3] = float("inf")  # the shortest text of the batch: "b"
        return out

    embedder.embed_batch = overflowing
    with pytest.raises(InputError, match="line 12: the embedding is not finite"):
        embedder.embed(["a longer text here", "b"], lines=[11, 12])
