"""fastbert.serving.engines: a checkpoint without a tokenizer is refused when the engine loads (it used to be served
with transformers' empty tokenizer, every text read as [CLS] [UNK] [SEP]); a text the tokenizer keeps nothing of is
refused as blank (`BlankInput`), in a pair too, with only such texts tokenized a second time."""

from __future__ import annotations

import shutil

import pytest

from fastbert.common.resolve import UserError
from fastbert.serving.engines import BlankInput, PairTokenizer, checkpoint_has_mlm_head, load_engine
from tests.helpers import save_sharded


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_an_engine_without_a_tokenizer_is_refused(tmp_path, minilm_dir, task):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{minilm_dir}/{name}", tmp_path / name)
    with pytest.raises(UserError, match="has no tokenizer"):
        load_engine(task, str(tmp_path), device="cpu", dtype="float32")


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("max_length", [7, 64])
def test_a_vocabulary_alone_tokenizes_a_mixed_batch_as_the_checkpoints_tokenizer_json(tmp_path, minilm_dir,
                                                                                     max_length, direction):
    for name in ("config.json", "vocab.txt"):
        shutil.copy(f"{minilm_dir}/{name}", tmp_path / name)
    texts = ["a question?", ("a query", "a passage that answers it at some length"), "one more single text here",
             ("short", "pair")]
    slow, fast = PairTokenizer(str(tmp_path), max_length, direction), PairTokenizer(minilm_dir, max_length, direction)
    assert slow.fast is None and fast.fast is not None
    assert slow(texts) == fast(texts)
    assert any(slow(texts)[2]) == (max_length == 7)


@pytest.mark.parametrize("task", ["embed", "classify"])
def test_a_max_input_length_past_the_model_names_the_servers_option_before_the_dtype_is_chosen(monkeypatch, task):
    from fastbert.embedding import Embedder
    from fastbert.serving import engines

    def chosen(*args, **kwargs):
        raise AssertionError("the length was checked after the dtype was chosen (auto measures)")

    monkeypatch.setattr(Embedder, "_precision", chosen)
    monkeypatch.setattr(engines, "resolve_precision", chosen)
    with pytest.raises(UserError, match=r"^--max-input-length must lie in \[[35], 512\] for this model, got 100000$"):
        load_engine(task, None, device="cpu", dtype="auto", max_length=100_000)


@pytest.mark.parametrize("task, length, specials, what, least", [
    ("embed", 2, 2, "a text", 3), ("classify", 4, 3, "a pair of texts", 5), ("rerank", 1, 3, "a pair of texts", 5),
    ("embed", 0, 2, "a text", 3), ("classify", 0, 3, "a pair of texts", 5)])
def test_a_max_input_length_without_room_beside_the_special_tokens_is_refused_first(monkeypatch, task, length, specials,
                                                                                  what, least):
    """A classifier's requests may hold pairs: [CLS] a [SEP] b [SEP] needs a token of each text."""
    from fastbert.embedding import Embedder
    from fastbert.serving import engines

    def chosen(*args, **kwargs):
        raise AssertionError("the length was checked after the dtype was chosen (auto measures)")

    monkeypatch.setattr(Embedder, "_precision", chosen)
    monkeypatch.setattr(engines, "resolve_precision", chosen)
    message = (f"--max-input-length must lie in \\[{least}, 512\\] for this model, got {length}: the tokenizer adds "
               f"{specials} special tokens to {what}")
    with pytest.raises(UserError, match=f"^{message}$"):
        load_engine(task, None, device="cpu", dtype="auto", max_length=length)


@pytest.mark.parametrize("task", ["classify", "rerank"])
def test_a_checkpoint_without_a_trained_head_is_not_served(minilm_dir, task):
    with pytest.raises(UserError, match=r"no trained sequence-classification head \(classifier.weight, "
                                        r"classifier.bias missing\)"):
        load_engine(task, minilm_dir, device="cpu", dtype="float32")


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_a_masked_lm_head_is_found_in_the_shards_of_a_checkpoint(safe, tmp_path):
    import transformers

    config = transformers.BertConfig(vocab_size=99, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    for name, model in [("mlm", transformers.BertForMaskedLM(config)), ("base", transformers.BertModel(config))]:
        (tmp_path / name).mkdir()
        save_sharded(model, tmp_path / name, safe)
    assert {p.suffix for p in (tmp_path / "mlm").glob("*-of-*")} == {".safetensors" if safe else ".bin"}
    assert not list((tmp_path / "mlm").glob("*.bin" if safe else "*.safetensors"))
    assert checkpoint_has_mlm_head(str(tmp_path / "mlm"))
    assert not checkpoint_has_mlm_head(str(tmp_path / "base"))


# texts a tokenizer keeps nothing of (an uncased BERT strips accents and drops private-use characters): blank, as in
# `fastbert embed`; before, the server embedded (or scored) each as the special tokens alone
KEPT_NOTHING = [("\u0301", "U+0301 COMBINING ACUTE ACCENT"), ("\ue000", "U+E000"),
                ("\u094d\u0301", "U+094D DEVANAGARI SIGN VIRAMA, U+0301 COMBINING ACUTE ACCENT")]
SCRIPTS = ["\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u200f\u0645\u0631\u062d\u0628\u0627\u200f",
           "\u0915\u094d\u200d\u0937", "\u4e2d\u6587\u6587\u672c", "a\u0301", "\u0301a", "\ufffd?"]


@pytest.fixture(scope="module")
def embed_engine():
    return load_engine("embed", None, device="cpu", dtype="float32")


@pytest.mark.parametrize(("text", "named"), KEPT_NOTHING)
def test_the_embed_engine_refuses_a_text_its_tokenizer_keeps_nothing_of(embed_engine, text, named):
    with pytest.raises(BlankInput) as found:
        embed_engine.encode(["a real text", text], truncate=False)
    assert str(found.value) == (f"input 1 is empty: nothing the tokenizer keeps ({named}); every text needs at "
                                "least one non-blank character")
    prompted = ["query: a real text", "query: " + text]  # the text checked is the one before its prompt
    with pytest.raises(BlankInput, match=r"^input 1 is empty: nothing the tokenizer keeps"):
        embed_engine.encode(prompted, truncate=False, originals=["a real text", text])


def test_the_embed_engine_tokenizes_real_texts_once(embed_engine, monkeypatch):
    """Real texts in any script are served, their ids those `fastbert embed` uses; the tokenizer check tokenizes
    only the texts without a letter, digit or symbol, never every text a second time."""
    calls = []
    tokenize = embed_engine.embedder.tokenize
    monkeypatch.setattr(embed_engine.embedder, "tokenize", lambda texts: calls.append(list(texts)) or tokenize(texts))
    tokens = embed_engine.encode(SCRIPTS, truncate=False)
    assert calls == [SCRIPTS] and [t.ids for t in tokens] == tokenize(SCRIPTS)[0]
    assert all(len(t) > 2 for t in tokens)
    calls.clear()
    with pytest.raises(BlankInput):
        embed_engine.encode([*SCRIPTS, "\u0301"], truncate=False)
    assert calls == [["\u0301"]]  # the suspicious text alone, and nothing embedded


@pytest.mark.parametrize(("text", "named"), KEPT_NOTHING[:2])
def test_the_classify_engine_refuses_a_text_its_tokenizer_keeps_nothing_of_in_a_pair_too(classifier_dir, text,
                                                                                        named):
    engine = load_engine("classify", classifier_dir, device="cpu", dtype="float32")
    why = f"is empty: nothing the tokenizer keeps ({named}); every text needs at least one non-blank character"
    for items, name in (([text], "input 0"), (["a", ("q", text)], "input 1 (the second text of its pair)"),
                        ([(text, "q")], "input 0 (the first text of its pair)")):
        with pytest.raises(BlankInput) as found:
            engine.encode(items, truncate=False)
        assert str(found.value) == f"{name} {why}", items
    pairs = [(text, "q") for text in SCRIPTS]
    assert [len(t) for t in engine.encode([*SCRIPTS, *pairs], truncate=False)] == \
        [len(ids) for ids in engine.tokenizers["right"]([*SCRIPTS, *pairs])[0]]
