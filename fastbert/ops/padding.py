"""Padding removal and restoration: the encoder runs every token-wise op on [total_tokens, H].

`varlen_from_mask` turns a [B, S] key padding mask into the packed description (flat indices of kept tokens,
int32 `cu_seqlens` [B+1], `max_seqlen`); `unpad_tokens` gathers kept rows, `pad_tokens` scatters them back with
zeros at padded positions. A mask may have holes anywhere (left padding included): kept tokens keep their order
(a model with sliding-window layers runs a mask with holes padded instead: `has_gaps`).

`token_buckets` and `fill_rows` give packed batches a few row counts: `fill_rows` appends filler sequences of pad
slots up to the next bucket. The CUDA graphs capture one graph per bucket (`fastbert.cuda_graphs`); on a CPU,
oneDNN builds (JIT-compiles) a GEMM primitive for each row count it has not seen, which costs a bfloat16 GEMM of
MiniLM's width 4 to 20 times its run, and buffers of every size fragment the heap, so a server whose batches all
differ in size pays on every forward (`fastbert.model.FastBertModel.encode_tokens` fills to ``ROW_BUCKETS`` there).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VarlenBatch:
    """A padded batch described in packed form.

    indices: int64 [T] flat positions (b * S + s) of the kept tokens, or None when nothing is padded.
    cu_seqlens: int32 [B + 1] cumulative lengths; max_seqlen: longest sequence; batch, seqlen: the padded shape.
    first_padded: a row's position 0 is padding (left padding, or a row without tokens): what a head reading
    position 0 reads there is computed by the padded form only.
    """

    indices: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    seqlen: int
    first_padded: bool = False

    @property
    def total_tokens(self) -> int:
        return self.batch * self.seqlen if self.indices is None else int(self.indices.numel())


def varlen_from_mask(mask: torch.Tensor | None, batch: int, seqlen: int, device: torch.device) -> VarlenBatch:
    """Packed description of a [B, S] bool mask (True = real token); None means nothing is padded."""
    if mask is None or bool(mask.all()):
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen
        return VarlenBatch(None, cu, seqlen, batch, seqlen)
    lengths = mask.sum(dim=1, dtype=torch.int32)
    cu = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    padded_first = (~mask[:, 0]).sum(dtype=torch.int32)
    longest, first_padded = torch.stack((lengths.max(), padded_first)).tolist()  # one read back for both
    return VarlenBatch(indices, cu, longest, batch, seqlen, first_padded > 0)


def has_gaps(mask: torch.Tensor) -> bool:
    """Whether a row of the [B, S] bool mask has padding between two of its tokens (a hole, not padding at either
    end): packed, such a row's tokens stand closer than their positions say, which a sliding window measures."""
    starts = mask[:, 0].int() + (mask[:, 1:] & ~mask[:, :-1]).sum(dim=1)  # runs of tokens per row
    return bool((starts > 1).any())


def first_position_padded(mask: torch.Tensor) -> bool:
    """Whether a row of the [B, S] mask (nonzero = token) starts with padding: left padding, or a row without
    tokens. A head that reads position 0 (the pooler, the first-token classifiers) reads a padded position there,
    which transformers computes and the padding-free form does not."""
    return not bool(mask[:, 0].all())


def first_token_beyond(mask: torch.Tensor, reach: int) -> bool:
    """Whether a row of the [B, S] mask has no token within ``reach`` positions of position 0 (none at all
    included): a sliding window of half-width ``reach`` around position 0 then holds no real key."""
    window = mask[:, : reach + 1] != 0
    return not bool(window.any(dim=1).all())


def unpad_tokens(x: torch.Tensor, varlen: VarlenBatch) -> torch.Tensor:
    """[B, S, ...] -> [T, ...] (a view when nothing is padded)."""
    flat = x.reshape(varlen.batch * varlen.seqlen, *x.shape[2:])
    return flat if varlen.indices is None else flat.index_select(0, varlen.indices)


def pad_tokens(x: torch.Tensor, varlen: VarlenBatch) -> torch.Tensor:
    """[T, ...] -> [B, S, ...] with zeros at padded positions."""
    if varlen.indices is None:
        return x.reshape(varlen.batch, varlen.seqlen, *x.shape[1:])
    out = x.new_zeros(varlen.batch * varlen.seqlen, *x.shape[1:])
    out.index_copy_(0, varlen.indices, x)
    return out.view(varlen.batch, varlen.seqlen, *x.shape[1:])


def varlen_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position within its sequence) of each of the `total` packed tokens."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_index = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                        output_size=total)
    position = torch.arange(total, device=cu_seqlens.device) - cu_seqlens[:-1].long()[seq_index]
    return seq_index, position


FILLER_CHUNK = 64  # pad slots per filler sequence: attention over them stays cheap


def token_buckets(largest: int = 16384, smallest: int = 16, growth: float = 1.25,
                  multiple: int = 16) -> tuple[int, ...]:
    """Token counts from ``smallest`` to ``largest``, each about ``growth`` times the one before, rounded up to a
    multiple of ``multiple`` (GEMM tiles): at most 1 - 1 / growth of a bucket is padding, past the first few. The
    powers of four between them are buckets too: they are the edges of `auto`'s shape classes
    (`fastbert.backends.tuning.bucket`), so filling a batch to its bucket never moves it into the next class (where
    `auto` would time it again, as if it were a batch four times larger)."""
    if smallest < 1 or largest < smallest or growth <= 1.0 or multiple < 1:
        raise ValueError(f"token_buckets needs 1 <= smallest <= largest, growth > 1, multiple >= 1; got "
                         f"smallest={smallest}, largest={largest}, growth={growth}, multiple={multiple}")
    buckets, size = {largest}, smallest
    while size < largest:
        buckets.add(size)
        size = max(size + 1, math.ceil(size * growth))
        size = -(-size // multiple) * multiple
    edge = 1
    while edge < largest:
        if edge > smallest:
            buckets.add(edge)
        edge *= 4
    return tuple(sorted(buckets))


# CPU row buckets: every count below 16, then 81 sizes up to 16384 (57 up to the CPU batch budget of 4096); filler:
# none below 16 rows (a short query filled to 16 rows ran 1.1-1.4x slower: benchmarks/short_queries_cpu.py), under
# 16 rows below 256, at most about a tenth of a batch past 256 rows, 7 % past 1024 (steps of about 1/16, rounded up
# to multiples of 16)
ROW_BUCKETS = tuple(range(1, 16)) + token_buckets(16384, growth=1.0625)


@dataclass
class FilledRows:
    """Packed inputs followed by filler sequences: ``rows`` real rows first, then pad slots; ``varlen`` holds the
    real sequences and the fillers (its batch counts both, its seqlen is its max_seqlen)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    types: torch.Tensor | None
    varlen: VarlenBatch
    rows: int


def fill_rows(tokens: torch.Tensor, positions: torch.Tensor, types: torch.Tensor | None, varlen: VarlenBatch,
              pad_token: int, sizes: tuple[int, ...] = ROW_BUCKETS,
              chunk: int = FILLER_CHUNK) -> FilledRows | None:
    """The packed rows (``tokens``: ids [T] or vectors [T, E]; ``varlen``: their sequences) grown to the smallest
    of ``sizes`` that holds them by filler sequences of pad slots (id ``pad_token``, or a zero vector; position 0,
    type 0), each at most ``chunk`` long and no longer than the longest real sequence (at least 16), so that the
    attention's longest sequence stays what it was. A filler is a sequence of its own, so a pad slot attends only
    to pad slots and nothing reaches a real row. None when T is a size already or past the largest."""
    total = tokens.shape[0]
    index = bisect.bisect_left(sizes, total)
    if index == len(sizes) or sizes[index] == total:
        return None
    extra = sizes[index] - total
    chunk = min(chunk, max(varlen.max_seqlen, 16))
    fillers = -(-extra // chunk)
    device = tokens.device
    pad = (tokens.new_full((extra,), pad_token) if tokens.dim() == 1
           else tokens.new_zeros((extra, *tokens.shape[1:])))
    ends = (torch.arange(1, fillers + 1, dtype=torch.int32, device=device) * chunk).clamp_(max=extra) + total
    longest = max(varlen.max_seqlen, min(chunk, extra))
    return FilledRows(torch.cat([tokens, pad]), torch.cat([positions, positions.new_zeros(extra)]),
                      None if types is None else torch.cat([types, types.new_zeros(extra)]),
                      VarlenBatch(None, torch.cat([varlen.cu_seqlens, ends]), longest,
                                  varlen.cu_seqlens.numel() - 1 + fillers, longest),
                      total)
