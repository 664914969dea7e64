"""fastbert.serving.engines: a checkpoint without a tokenizer is refused when the engine loads (it used to be served
with transformers' empty tokenizer, every text read as [CLS] [UNK] [SEP])."""

from __future__ import annotations

import shutil

import pytest

from fastbert.common.resolve import UserError
from fastbert.serving.engines import PairTokenizer, checkpoint_has_mlm_head, load_engine
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
