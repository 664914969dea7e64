"""fastbert.serving.engines: a checkpoint without a tokenizer is refused when the engine loads (it used to be served
with transformers' empty tokenizer, every text read as [CLS] [UNK] [SEP])."""

from __future__ import annotations

import shutil

import pytest

from fastbert.common.resolve import UserError
from fastbert.serving.engines import PairTokenizer, load_engine


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
