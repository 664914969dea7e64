"""Pretraining data: the 15% / 80-10-10 masking, NSP 50/50, SOP, dynamic masking."""

from __future__ import annotations

import random

import pytest
import torch

from fastbert.training.masking import (
    IGNORE_INDEX,
    MaskingCollator,
    encode_pair,
    mask_tokens,
    next_sentence_pairs,
    sentence_order_pairs,
)

MASK_ID, VOCAB = 103, 30522


def test_masking_proportions():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 2000, (400, 500), generator=gen)  # 200k tokens, none equal to MASK_ID
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = special[:, -1] = True
    inputs, labels = mask_tokens(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_tokens_mask=special,
                                 generator=gen)
    chosen = labels != IGNORE_INDEX
    eligible = (~special).sum().item()
    assert abs(chosen.sum().item() / eligible - 0.15) < 0.005
    assert not chosen[special].any()
    assert torch.equal(labels[chosen], ids[chosen])
    n = chosen.sum().item()
    masked = (inputs[chosen] == MASK_ID).sum().item() / n
    kept = (inputs[chosen] == ids[chosen]).sum().item() / n
    replaced = 1 - masked - kept
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01 and abs(replaced - 0.1) < 0.01
    assert torch.equal(inputs[~chosen], ids[~chosen])


def test_masking_rejects_bad_input():
    with pytest.raises(TypeError):
        mask_tokens(torch.ones(2, 3), mask_token_id=MASK_ID, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="must match"):
        mask_tokens(torch.ones(2, 3, dtype=torch.long), mask_token_id=MASK_ID, vocab_size=VOCAB,
                    special_tokens_mask=torch.zeros(3, 2, dtype=torch.bool))


def _documents():
    rng = random.Random(1)
    return [[[rng.randrange(1000, 2000) for _ in range(rng.randrange(3, 9))] for _ in range(30)] for _ in range(40)]


def test_next_sentence_pairs_are_half_true_successors():
    docs = _documents()
    pairs = next_sentence_pairs(docs, random.Random(0))
    successors = {(tuple(a), tuple(b)) for doc in docs for a, b in zip(doc, doc[1:], strict=False)}
    positives = [p for p in pairs if p.label == 0]
    assert abs(len(positives) / len(pairs) - 0.5) < 0.05
    assert all((tuple(p.first), tuple(p.second)) in successors for p in positives)
    negatives = [p for p in pairs if p.label == 1]
    assert sum((tuple(p.first), tuple(p.second)) in successors for p in negatives) == 0
    with pytest.raises(ValueError, match="two non-empty documents"):
        next_sentence_pairs(docs[:1], random.Random(0))


def test_sentence_order_pairs_swap_half():
    docs = _documents()
    pairs = sentence_order_pairs(docs, random.Random(0))
    successors = {(tuple(a), tuple(b)) for doc in docs for a, b in zip(doc, doc[1:], strict=False)}
    assert abs(sum(p.label for p in pairs) / len(pairs) - 0.5) < 0.05
    for pair in pairs:
        ordered = (tuple(pair.first), tuple(pair.second)) if pair.label == 0 else (tuple(pair.second),
                                                                                     tuple(pair.first))
        assert ordered in successors


def test_encode_pair_and_dynamic_masking():
    pair = next_sentence_pairs(_documents(), random.Random(3))[0]
    example = encode_pair(pair, cls_id=101, sep_id=102, max_length=12)
    assert len(example["input_ids"]) <= 12 and example["input_ids"][0] == 101
    assert example["input_ids"].count(102) == 2 and example["token_type_ids"][-1] == 1
    example["label"] = pair.label
    collate = MaskingCollator(pad_id=0, mask_token_id=MASK_ID, vocab_size=VOCAB, mlm_probability=0.5, seed=0)
    short = dict(example, input_ids=example["input_ids"][:5], token_type_ids=example["token_type_ids"][:5],
                 special_tokens_mask=example["special_tokens_mask"][:5])
    first, second = collate([example, short]), collate([example, short])
    assert first["input_ids"].shape == first["labels"].shape == first["attention_mask"].shape
    assert not torch.equal(first["labels"], second["labels"])  # a fresh mask each time
    padded = first["attention_mask"] == 0
    assert (first["labels"][padded] == IGNORE_INDEX).all()
    assert (first["labels"][:, 0] == IGNORE_INDEX).all()  # [CLS] is never chosen
    assert first["next_sentence_label"].tolist() == [pair.label, pair.label]
