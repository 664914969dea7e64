"""fastbert.common.text: the tokenizer wrapper and mean pooling against sentence-transformers."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import fastbert
from fastbert.common import text
from fastbert.common.resolve import UserError
from fastbert.config import FastBertConfig


def test_mean_pooling_matches_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sat on the mat.", "A much longer sentence, so that the first one is padded in the batch."]
    config = FastBertConfig.from_json_file(f"{minilm_dir}/config.json")
    batch = text.TextEncoder(minilm_dir, config)(texts)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # padding really happens
    with torch.inference_mode():
        hidden = fastbert.from_pretrained(minilm_dir).eval()(**batch).last_hidden_state
    ours = text.mean_pool(hidden, batch["attention_mask"])
    theirs = torch.from_numpy(SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


def _checkpoint_with(tmp_path, minilm_dir, *names: str) -> str:
    """MiniLM's config and weights beside only the named tokenizer files."""
    for name in ("config.json", "model.safetensors", *names):
        shutil.copy(Path(minilm_dir) / name, tmp_path / name)
    return str(tmp_path)


@pytest.mark.parametrize("names, message", [
    ((), "has no tokenizer (none of tokenizer.json, "),
    (("tokenizer_config.json",), "its tokenizer has no vocabulary, only special or added tokens (5): is vocab.txt"),
    (("tokenizer_config.json", "special_tokens_map.json"), "has no vocabulary, only special or added tokens (5)"),
], ids=["no-files", "config-only", "config-and-specials"])
def test_a_tokenizer_without_a_vocabulary_is_refused(tmp_path, minilm_dir, names, message):
    directory = _checkpoint_with(tmp_path, minilm_dir, *names)
    with pytest.raises(UserError, match=re.escape(message)):
        text.load_auto_tokenizer(directory)
    with pytest.raises(UserError, match=re.escape(message)):
        text.TextEncoder(directory, FastBertConfig.from_json_file(f"{directory}/config.json"))


def test_added_tokens_do_not_pass_for_a_vocabulary(tmp_path, minilm_dir):
    directory = _checkpoint_with(tmp_path, minilm_dir, "tokenizer_config.json")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for index in range(40):  # more added tokens than special ones: a count of tokens would take it for a vocabulary
        config.setdefault("added_tokens_decoder", {})[str(5 + index)] = {
            "content": f"<extra_{index}>", "lstrip": False, "normalized": True, "rstrip": False,
            "single_word": False, "special": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=re.escape("has no vocabulary, only special or added tokens (45)")):
        text.load_auto_tokenizer(directory)


def test_a_vocabulary_of_another_alphabet_loads(tmp_path, minilm_dir):
    """Amino acids (ProtBERT's kind of vocabulary): no English word, digit or punctuation in it, still a vocabulary."""
    directory = _checkpoint_with(tmp_path, minilm_dir)
    amino_acids = list("ACDEFGHIKLMNPQRSTVWY")
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *amino_acids]) + "\n")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                                "do_lower_case": False}))
    tokenizer = text.load_auto_tokenizer(directory)
    assert tokenizer("M K T A", add_special_tokens=False)["input_ids"] == [5 + amino_acids.index(a) for a in "MKTA"]


def test_a_vocabulary_alone_loads_and_tokenizes_as_the_fast_tokenizer(tmp_path, minilm_dir):
    from tokenizers import Tokenizer

    tokenizer = text.load_auto_tokenizer(_checkpoint_with(tmp_path, minilm_dir, "vocab.txt"))
    fast = Tokenizer.from_file(f"{minilm_dir}/tokenizer.json")
    fast.no_padding()
    sentence = "Quantum chromodynamics is hard."
    assert tokenizer(sentence)["input_ids"] == fast.encode(sentence).ids


def test_the_label_names_the_directory_in_the_error(tmp_path, minilm_dir):
    with pytest.raises(UserError, match=r"^--teacher X has no tokenizer"):
        text.load_auto_tokenizer(_checkpoint_with(tmp_path, minilm_dir), label="--teacher X")


@pytest.mark.parametrize("vocab_only", [False, True], ids=["tokenizers", "transformers"])
def test_special_tokens_added_and_the_lengths_that_leave_room_for_text(minilm_dir, tmp_path, vocab_only):
    if vocab_only:
        shutil.copy(f"{minilm_dir}/vocab.txt", tmp_path / "vocab.txt")
        shutil.copy(f"{minilm_dir}/config.json", tmp_path / "config.json")
        tokenizer = text.load_auto_tokenizer(str(tmp_path))
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(f"{minilm_dir}/tokenizer.json")
    assert (text.special_tokens_added(tokenizer), text.special_tokens_added(tokenizer, pair=True)) == (2, 3)
    for length in (3, 512):
        text.check_max_length(length, tokenizer, 512, "--max-length")
    text.check_max_length(5, tokenizer, 512, "--max-length", pair=True)
    for length in (0, 2):
        with pytest.raises(UserError, match=rf"^--max-length must lie in \[3, 512\] for this model, got {length}: the "
                                            r"tokenizer adds 2 special tokens to a text$"):
            text.check_max_length(length, tokenizer, 512, "--max-length")
    with pytest.raises(UserError, match=r"^--max-length must lie in \[3, 512\] for this model, got 513$"):
        text.check_max_length(513, tokenizer, 512, "--max-length")
    with pytest.raises(UserError, match=r"^--max-length must lie in \[5, 512\] for this model, got 4: the tokenizer "
                                        "adds 3 special tokens to a pair of texts$"):
        text.check_max_length(4, tokenizer, 512, "--max-length", pair=True)


def test_a_tokenizer_without_special_tokens_needs_room_for_one_token():
    from tokenizers import Tokenizer, models

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert text.special_tokens_added(tokenizer, pair=True) == 0
    text.check_max_length(1, tokenizer, 8, "--max-length")
    with pytest.raises(UserError, match=r"must lie in \[2, 8\] for this model, got 1: the tokenizer adds 0 special"):
        text.check_max_length(1, tokenizer, 8, "--max-length", pair=True)
