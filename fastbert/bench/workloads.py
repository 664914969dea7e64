"""Benchmark inputs: a `Workload` is one batch of random token ids with given real lengths, padded to one length;
`make_workloads` gives the fixed-shape and variable-length batches of the end-to-end benchmark."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastbert.config import FastBertConfig


@dataclass
class Workload:
    """One batch: ``lengths`` real tokens per sequence, padded to ``seqlen``."""

    name: str
    batch: int
    seqlen: int
    lengths: list[int]
    varlen: bool

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def inputs(self, config: FastBertConfig, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random token ids (never the pad id) at real positions, the pad id elsewhere; mask 1 = real token."""
        generator = torch.Generator().manual_seed(seed)
        low = min(100, config.vocab_size // 2)
        ids = torch.randint(low, config.vocab_size, (self.batch, self.seqlen), generator=generator)
        ids[ids == config.pad_token_id] = (config.pad_token_id + 1) % config.vocab_size
        mask = torch.zeros(self.batch, self.seqlen, dtype=torch.long)
        for row, length in enumerate(self.lengths):
            mask[row, :length] = 1
        ids[mask == 0] = config.pad_token_id
        out = {"input_ids": ids, "attention_mask": mask}
        if getattr(config, "type_vocab_size", 0):  # transformers' configs too: ModernBERT's has no such field
            out["token_type_ids"] = torch.zeros_like(ids)
        return {k: v.to(device) for k, v in out.items()}


def make_workloads(batches: Sequence[int], seqs: Sequence[int], varlen: bool, seed: int = 0) -> list[Workload]:
    """Fixed shapes batch x seq (every token real), and with ``varlen`` one batch per (batch, seq) whose lengths
    are drawn uniformly from [seq/8, seq] (seeded; the longest is seq, so the padded shape is batch x seq)."""
    workloads = []
    for seq in seqs:
        for batch in batches:
            workloads.append(Workload(f"b{batch} s{seq}", batch, seq, [seq] * batch, False))
    if varlen:
        generator = torch.Generator().manual_seed(seed)
        for seq in seqs:
            for batch in batches:
                if batch < 2:
                    continue
                low = max(1, seq // 8)
                lengths = torch.randint(low, seq + 1, (batch,), generator=generator).tolist()
                lengths[0] = seq
                workloads.append(Workload(f"varlen b{batch} s<={seq}", batch, seq, lengths, True))
    return workloads
