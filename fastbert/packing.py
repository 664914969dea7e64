"""A packed batch: the sequences of a batch laid end to end, as the encoder runs them, built once on the host.

`PackedBatch.from_token_lists` takes token id lists (a tokenizer's output: no padding) and makes flat ``input_ids``,
``position_ids`` and ``token_type_ids`` [T], ``cu_seqlens`` int32 [B + 1] and the host facts the encoder needs
(``lengths``, ``max_seqlen``, ``position_count``): checked on the host, copied to the device in one transfer each,
so that `fastbert.model.FastBertModel.forward_packed` reads no tensor value back from the device. `from_padded`
converts a [B, S] batch with an attention mask (the drop-in's form) into one, reading the mask once, with the
positions the padded entry gives its real tokens (with left padding, BERT-style positions count the pads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from fastbert.config import FastBertConfig


@dataclass(frozen=True)
class PackedBatch:
    """B sequences, T tokens in all. input_ids, position_ids: int64 [T]; token_type_ids: int64 [T] or None (a
    model without token types); cu_seqlens: int32 [B + 1], sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1];
    lengths: the B lengths, on the host; position_count: one past the highest position id."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    position_count: int

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def total_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch on ``device`` (the host facts stay)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(self, input_ids=move(self.input_ids), position_ids=move(self.position_ids),
                       token_type_ids=move(self.token_type_ids), cu_seqlens=move(self.cu_seqlens))

    @classmethod
    def from_token_lists(cls, config: FastBertConfig, ids: Sequence[Sequence[int]],
                         token_types: Sequence[Sequence[int]] | None = None, device: torch.device | str = "cpu",
                         pin_memory: bool = False) -> PackedBatch:
        """Pack tokenized sequences for ``config``'s model; positions as transformers makes them for the family
        (0..L-1, or RoBERTa's from the padding index). ValueError for an empty batch or sequence, an id outside the
        vocabulary, a type outside the type vocabulary, types for a model without them, or a sequence longer than
        the model's positions."""
        rows = [list(row) for row in ids]
        types = None if token_types is None else [list(row) for row in token_types]
        check_rows(config, rows, types)
        return cls.pack(config, rows, types, [row_positions(config, row) for row in rows], device, pin_memory)

    @classmethod
    def pack(cls, config: FastBertConfig, rows: list[list[int]], types: list[list[int]] | None,
             positions: list[list[int]], device: torch.device | str = "cpu", pin_memory: bool = False) -> PackedBatch:
        """The batch of checked ``rows`` (`check_rows`) with the given ``positions`` (one list per row)."""
        flat_ids = [token for row in rows for token in row]
        flat_positions = [p for row in positions for p in row]
        flat_types = None
        if config.type_vocab_size:
            flat_types = [t for row in types for t in row] if types is not None else [0] * len(flat_ids)
        lengths = tuple(len(row) for row in rows)
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)

        def tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            host = host.pin_memory() if pin_memory and torch.cuda.is_available() else host
            return host.to(device, non_blocking=pin_memory)

        return cls(tensor(flat_ids, torch.long), tensor(flat_positions, torch.long),
                   None if flat_types is None else tensor(flat_types, torch.long), tensor(cu, torch.int32), lengths,
                   max(flat_positions) + 1)

    @classmethod
    def from_padded(cls, config: FastBertConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    token_type_ids: torch.Tensor | None = None) -> PackedBatch:
        """The real tokens of a [B, S] batch (mask 1 = token; right or left padding), read once on the host, each at
        the position the padded entry (`FastBertModel.forward` without position_ids) and transformers give it:
        its column (BERT, DistilBERT, ALBERT, ELECTRA, ModernBERT: left padding shifts the positions), or
        RoBERTa's count of non-pad ids so far past the padding index (pads skipped, as packed). ValueError as
        `from_token_lists`, and for a position beyond the model's position table."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        host_ids = input_ids.detach().cpu()
        mask = attention_mask.detach().cpu().bool()
        positions = padded_position_ids(config, host_ids)
        ids = [row[keep].tolist() for row, keep in zip(host_ids, mask, strict=True)]
        types = None
        if token_type_ids is not None:
            types = [row[keep].tolist() for row, keep in zip(token_type_ids.detach().cpu(), mask, strict=True)]
        check_rows(config, ids, types)
        rows_positions = [row[keep].tolist() for row, keep in zip(positions, mask, strict=True)]
        highest = max(max(row) for row in rows_positions)
        if config.positions == "absolute" and highest >= config.max_position_embeddings:
            raise ValueError(f"position id {highest} (a token's column in the padded batch) needs more than the "
                             f"model's max_position_embeddings={config.max_position_embeddings}")
        return cls.pack(config, ids, types, rows_positions, device=input_ids.device)


def padded_position_ids(config: FastBertConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [B, S] of a padded batch as `FastBertModel.default_position_ids` (and transformers) make them:
    each token's column 0..S-1, padding counted; RoBERTa's (``position_offset``): the count of non-pad ids so far past
    the padding index, the padding index at a pad id."""
    if config.position_offset is None:
        return torch.arange(input_ids.shape[1]).expand(input_ids.shape)
    not_pad = input_ids.ne(config.pad_token_id).long()
    return torch.cumsum(not_pad, dim=1) * not_pad + config.pad_token_id


def row_positions(config: FastBertConfig, row: Sequence[int]) -> list[int]:
    """Position ids of one sequence as transformers makes them: 0..L-1; RoBERTa's (``position_offset``): the count
    of non-pad tokens so far past the padding index, and the padding index at a pad token."""
    if config.position_offset is None:
        return list(range(len(row)))
    pad, positions, count = config.pad_token_id, [], 0
    for token in row:
        count += token != pad
        positions.append(pad + count if token != pad else pad)
    return positions


def check_rows(config: FastBertConfig, rows: list[list[int]], types: list[list[int]] | None) -> None:
    """The checks `PackedBatch.from_token_lists` makes, on the host (see there)."""
    if not rows:
        raise ValueError("a packed batch needs at least one sequence")
    limit = config.token_positions if config.positions == "absolute" else None
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(f"sequence {index} is empty; give at least one token")
        if min(row) < 0 or max(row) >= config.vocab_size:
            raise ValueError(f"sequence {index} holds token ids outside the vocabulary [0, {config.vocab_size})")
        if limit is not None and len(row) > limit:
            raise ValueError(f"sequence {index} has {len(row)} tokens; this model takes at most {limit}")
    if types is None:
        return
    if not config.type_vocab_size:
        raise ValueError(f"{config.model_type} takes no token_type_ids")
    if [len(t) for t in types] != [len(r) for r in rows]:
        raise ValueError("token_type_ids must give one type per token of each sequence")
    if any(min(t) < 0 or max(t) >= config.type_vocab_size for t in types):
        raise ValueError(f"token_type_ids must lie in [0, {config.type_vocab_size})")
