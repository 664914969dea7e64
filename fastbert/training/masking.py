"""Pretraining data as in the original recipes: BERT's masked LM + next-sentence pairs, RoBERTa's dynamic masking,
ALBERT's sentence-order pairs.

- Masked LM: 15% of the (non-special, non-padding) tokens are chosen; of those 80% become [MASK], 10% a random
  token, 10% stay unchanged. Labels hold the original id at chosen positions and -100 elsewhere (the ignore
  index of every fastbert/transformers MLM loss).
- NSP: 50% of pairs are (segment, the segment that follows it) with label 0 ("is next"), 50% (segment, a segment
  from another document) with label 1, as BERT and transformers define it.
- SOP (ALBERT): two consecutive segments, in order (label 0) or swapped (label 1), 50/50.
- Dynamic masking (RoBERTa): `MaskingCollator` draws a new mask every time a batch is formed, instead of once when
  the data is written.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    special_tokens_mask: torch.Tensor | None = None,
    mlm_probability: float = 0.15,
    mask_fraction: float = 0.8,
    random_fraction: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of a batch of token ids [..., S]; returns (masked inputs, labels), new tensors.

    special_tokens_mask: bool, True where a token may never be chosen ([CLS], [SEP], padding).
    Random replacements are drawn uniformly from the whole vocabulary, as in BERT.
    """
    if input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"input_ids must be integer ids, got {input_ids.dtype}")
    if not 0.0 <= mlm_probability <= 1.0 or mask_fraction + random_fraction > 1.0:
        raise ValueError("need 0 <= mlm_probability <= 1 and mask_fraction + random_fraction <= 1")
    if special_tokens_mask is not None and special_tokens_mask.shape != input_ids.shape:
        raise ValueError(f"special_tokens_mask {tuple(special_tokens_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")

    def uniform() -> torch.Tensor:
        return torch.rand(input_ids.shape, generator=generator, device=input_ids.device)

    chosen = uniform() < mlm_probability
    if special_tokens_mask is not None:
        chosen &= ~special_tokens_mask.bool()
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    # One draw decides each chosen token's fate: [0, 0.8) mask, [0.8, 0.9) random, [0.9, 1) keep.
    fate = uniform()
    to_mask = chosen & (fate < mask_fraction)
    to_random = chosen & (fate >= mask_fraction) & (fate < mask_fraction + random_fraction)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=input_ids.device,
                               dtype=input_ids.dtype)
    inputs = torch.where(to_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels


@dataclass
class SentencePair:
    """Two segments of token ids and the pair label (NSP: 0 = B follows A; SOP: 0 = in order)."""

    first: list[int]
    second: list[int]
    label: int


def next_sentence_pairs(documents: Sequence[Sequence[Sequence[int]]], rng: random.Random) -> list[SentencePair]:
    """BERT's NSP pairs: for each segment that has a successor, 50% its successor (label 0), 50% a random segment
    of another document (label 1). documents: list of documents, each a list of tokenised segments."""
    if sum(1 for doc in documents if doc) < 2:
        raise ValueError("next-sentence pairs need at least two non-empty documents (random pairs come from another)")
    pairs = []
    for doc_index, doc in enumerate(documents):
        for index in range(len(doc) - 1):
            if rng.random() < 0.5:
                pairs.append(SentencePair(list(doc[index]), list(doc[index + 1]), 0))
                continue
            other = doc_index
            while other == doc_index or not documents[other]:
                other = rng.randrange(len(documents))
            pairs.append(SentencePair(list(doc[index]), list(rng.choice(documents[other])), 1))
    return pairs


def sentence_order_pairs(documents: Sequence[Sequence[Sequence[int]]], rng: random.Random) -> list[SentencePair]:
    """ALBERT's SOP pairs: two consecutive segments of one document, in order (label 0) or swapped (label 1)."""
    pairs = []
    for doc in documents:
        for index in range(len(doc) - 1):
            first, second = list(doc[index]), list(doc[index + 1])
            if rng.random() < 0.5:
                pairs.append(SentencePair(first, second, 0))
            else:
                pairs.append(SentencePair(second, first, 1))
    return pairs


def encode_pair(pair: SentencePair, cls_id: int, sep_id: int, max_length: int) -> dict[str, list[int]]:
    """[CLS] A [SEP] B [SEP] with token types 0/1, the longer segment truncated first to fit max_length."""
    first, second = list(pair.first), list(pair.second)
    while len(first) + len(second) + 3 > max_length:
        (first if len(first) >= len(second) else second).pop()
    ids = [cls_id, *first, sep_id, *second, sep_id]
    types = [0] * (len(first) + 2) + [1] * (len(second) + 1)
    special = [1] + [0] * len(first) + [1] + [0] * len(second) + [1]
    return {"input_ids": ids, "token_type_ids": types, "special_tokens_mask": special}


class MaskingCollator:
    """Pads encoded examples into a batch and masks it afresh on every call (RoBERTa's dynamic masking; BERT's
    static masking is this applied once and saved)."""

    def __init__(self, *, pad_id: int, mask_token_id: int, vocab_size: int, mlm_probability: float = 0.15,
                 seed: int | None = None):
        self.pad_id, self.mask_token_id, self.vocab_size = pad_id, mask_token_id, vocab_size
        self.mlm_probability = mlm_probability
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def __call__(self, examples: Sequence[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("MaskingCollator got an empty batch")
        length = max(len(e["input_ids"]) for e in examples)

        def padded(key: str, fill: int) -> torch.Tensor:
            return torch.tensor([list(e[key]) + [fill] * (length - len(e[key])) for e in examples])

        input_ids = padded("input_ids", self.pad_id)
        attention_mask = torch.tensor([[1] * len(e["input_ids"]) + [0] * (length - len(e["input_ids"]))
                                       for e in examples])
        special = attention_mask == 0
        if all("special_tokens_mask" in e for e in examples):
            special |= padded("special_tokens_mask", 1).bool()
        inputs, labels = mask_tokens(input_ids, mask_token_id=self.mask_token_id, vocab_size=self.vocab_size,
                                     special_tokens_mask=special, mlm_probability=self.mlm_probability,
                                     generator=self.generator)
        batch = {"input_ids": inputs, "attention_mask": attention_mask, "labels": labels}
        if all("token_type_ids" in e for e in examples):
            batch["token_type_ids"] = padded("token_type_ids", 0)
        if all("label" in e for e in examples):
            batch["next_sentence_label"] = torch.tensor([e["label"] for e in examples])
        return batch
