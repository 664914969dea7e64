"""fastbert.embedding.checkpoint: the pooling, normalisation and max length a checkpoint's sentence-transformers
files declare."""

import json

import pytest

from fastbert.common.resolve import UserError
from fastbert.embedding import default_max_length, sentence_transformers_head


def _write_modules(directory, pooling_modes: dict | None, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling_modes is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, **{f"pooling_mode_{k}": v for k, v in pooling_modes.items()}}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize("modes, normalize, expected", [
    ({"mean_tokens": True, "cls_token": False}, True, ("mean", True)),
    ({"cls_token": True, "mean_tokens": False}, False, ("cls", False)),
    (None, True, (None, True)),
], ids=["mean-normalized", "cls", "no-pooling-module"])
def test_the_declared_head_is_read(tmp_path, modes, normalize, expected):
    _write_modules(tmp_path, modes, normalize)
    assert sentence_transformers_head(str(tmp_path)) == expected


def test_no_sentence_transformers_files_declare_nothing(tmp_path):
    assert sentence_transformers_head(str(tmp_path)) == (None, None)
    (tmp_path / "modules.json").write_text("{not json")
    assert sentence_transformers_head(str(tmp_path)) == (None, None)


def test_a_pooling_fastbert_does_not_implement_is_refused(tmp_path):
    _write_modules(tmp_path, {"mean_tokens": True, "max_tokens": True}, True)
    with pytest.raises(UserError, match="pools with max_tokens, mean_tokens"):
        sentence_transformers_head(str(tmp_path))


def test_max_length_is_the_declared_one_within_the_models_limit(tmp_path):
    assert default_max_length(str(tmp_path), 512) == 512
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    assert default_max_length(str(tmp_path), 512) == 256
    assert default_max_length(str(tmp_path), 128) == 128
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": None}))
    assert default_max_length(str(tmp_path), 512) == 512
