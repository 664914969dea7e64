"""Real text for `fastbert demo`, `check` and `embed`: sample English sentences, a tokenizer wrapper that pads a
batch for a checkpoint, and sentence-transformers' mean pooling. `tokenizers` and transformers are imported when a
tokenizer is built, so importing this module stays cheap."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from fastbert.common.resolve import UserError
from fastbert.config import FastBertConfig

# Varied English sentences for the demo and `fastbert check`: short and long, questions, numbers, punctuation.
SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A kitten was resting in the sun by the window.",
    "How do I reset my password if I no longer have access to my email?",
    "The central bank raised interest rates by a quarter of a percentage point on Wednesday.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She played a Chopin nocturne at the recital, and the audience stood up to applaud.",
    "Heavy rain is expected across the north of the country this weekend.",
    "Is it safe to eat raw cookie dough?",
    "The new library opened in 1998 and holds more than two million books.",
    "Transformers process every token of a sentence in parallel with self-attention.",
    "He forgot his umbrella, so he arrived at the office soaking wet.",
    "Our team shipped the release two days ahead of schedule.",
    "Mount Everest is 8,849 metres high.",
    "Please remember to water the tomatoes while I am away.",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Why do leaves change colour in autumn?",
]

# Files of a saved slow tokenizer (transformers builds an empty one from a directory holding none of them).
TOKENIZER_FILES = {"tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model"}


def plural(count: int, word: str, plural_form: str | None = None) -> str:
    """``count`` (with thousands separators) and ``word``, plural unless the count is one: '1 row', '2,048 rows'."""
    return f"{count:,} {word if count == 1 else plural_form or word + 's'}"


def per_second(count: float, elapsed: float) -> str:
    """A rate for a summary line: whole numbers, one decimal below 10 (a short run is not '0 texts/s')."""
    rate = count / elapsed if elapsed > 0 else 0.0
    return f"{rate:,.0f}" if rate >= 10 else f"{rate:.1f}"


def read_tokenizer_file(model_dir: str) -> Any:
    """The checkpoint's tokenizer.json through the tokenizers library (padding and truncation as the file says), or
    None without one; UserError for a file the library cannot read (it raises a bare Exception)."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:
        raise UserError(f"{path} is not a tokenizer file the tokenizers library can read ({err})") from err


def has_tokenizer_files(model_dir: str) -> bool:
    """Whether ``model_dir`` holds any of a tokenizer's files (tokenizer.json, `TOKENIZER_FILES`), readable or not."""
    names = set(os.listdir(model_dir)) if os.path.isdir(model_dir) else set()
    return bool(names & (TOKENIZER_FILES | {"tokenizer.json"}))


def load_auto_tokenizer(model_dir: str, label: str | None = None, **kwargs: Any) -> Any:
    """transformers' AutoTokenizer of a checkpoint directory (``kwargs`` passed on). UserError, naming the directory
    as ``label``, where transformers fails or builds an empty tokenizer, as it does silently for a directory without
    tokenizer files or with a tokenizer_config.json alone: no token but special or added ones, which would turn
    every text into [CLS] [UNK] [SEP]."""
    from transformers import AutoTokenizer

    label = label or model_dir
    if not has_tokenizer_files(model_dir):
        raise UserError(f"{label} has no tokenizer (none of tokenizer.json, {', '.join(sorted(TOKENIZER_FILES))})")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, **kwargs)
    except Exception as err:  # any failure means: no usable tokenizer in that directory
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        raise UserError(f"{label}: transformers cannot load a tokenizer from it ({reason})") from err
    # a count of all tokens would pass an empty vocabulary with added tokens; a probe text would refuse a real one
    # of another alphabet (amino acids, k-mers)
    ordinary = set(tokenizer.get_vocab()) - set(tokenizer.all_special_tokens) - set(tokenizer.get_added_vocab())
    if not ordinary:
        raise UserError(f"{label}: its tokenizer has no vocabulary, only special or added tokens ({len(tokenizer)}): "
                        "is vocab.txt, vocab.json or the sentencepiece model missing?")
    return tokenizer


def special_tokens_added(tokenizer: Any, pair: bool = False) -> int:
    """How many special tokens a tokenizer (the tokenizers library's or transformers') adds to one text, or to a
    pair: 2 for BERT's [CLS] ... [SEP], 3 for a pair."""
    return tokenizer.num_special_tokens_to_add(pair)  # both libraries name the argument differently


def check_max_length(max_length: int, tokenizer: Any, limit: int, option: str, pair: bool = False) -> None:
    """A `UserError` unless ``max_length`` lies between the model's ``limit`` and the least that leaves a token of a
    text (of each text of a pair) beside the tokenizer's special tokens: a tokenizer cannot truncate below them, and
    would leave every text whole instead."""
    specials = special_tokens_added(tokenizer, pair)
    least = specials + (2 if pair else 1)
    if not least <= max_length <= limit:
        what = "a pair of texts" if pair else "a text"
        why = f": the tokenizer adds {specials} special tokens to {what}" if max_length < least else ""
        raise UserError(f"{option} must lie in [{least}, {limit}] for this model, got {max_length}{why}")


class TextEncoder:
    """Tokenizes sentences for a checkpoint: its tokenizer.json through `tokenizers` (padding to the longest),
    else transformers' AutoTokenizer."""

    def __init__(self, model_dir: str, config: FastBertConfig):
        self.config = config
        self.max_length = config.token_positions
        self.tokenizer = read_tokenizer_file(model_dir)
        if self.tokenizer is not None:
            self.tokenizer.enable_padding(pad_id=config.pad_token_id, pad_token=self._pad_token())
            truncation = self.tokenizer.truncation
            limit = min(truncation["max_length"], self.max_length) if truncation else self.max_length
            self.tokenizer.enable_truncation(max_length=limit)
            self.hf_tokenizer = None
        else:
            self.hf_tokenizer = load_auto_tokenizer(model_dir)
            self.tokenizer = None

    def _pad_token(self) -> str:
        token = self.tokenizer.id_to_token(self.config.pad_token_id)
        return token if token is not None else "[PAD]"

    def __call__(self, texts: Sequence[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """input_ids, attention_mask [B, S] (and token_type_ids when the model has token types), padded to the
        longest sentence."""
        if self.tokenizer is not None:
            encodings = self.tokenizer.encode_batch(list(texts))
            batch = {"input_ids": torch.tensor([e.ids for e in encodings]),
                     "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
                     "token_type_ids": torch.tensor([e.type_ids for e in encodings])}
        else:
            out = self.hf_tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt")
            batch = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"],
                     "token_type_ids": out.get("token_type_ids", torch.zeros_like(out["input_ids"]))}
        if not self.config.type_vocab_size:
            batch.pop("token_type_ids")
        return {k: v.to(device) for k, v in batch.items()}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers' mean pooling: the mean of the token vectors at non-padded
    positions (in fp32), L2-normalised when asked. hidden [B, S, H], attention_mask [B, S] -> [B, H] fp32."""
    mask = attention_mask.to(torch.float32).unsqueeze(-1)
    summed = (hidden.float() * mask).sum(dim=1)
    pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled
