"""Padding removal and restoration: the encoder runs every token-wise op on [total_tokens, H].

`varlen_from_mask` turns a [B, S] key padding mask into the packed description (flat indices of kept tokens,
int32 `cu_seqlens` [B+1], `max_seqlen`); `unpad_tokens` gathers kept rows, `pad_tokens` scatters them back with
zeros at padded positions. A mask may have holes anywhere (left padding included): kept tokens keep their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class VarlenBatch:
    """A padded batch described in packed form.

    indices: int64 [T] flat positions (b * S + s) of the kept tokens, or None when nothing is padded.
    cu_seqlens: int32 [B + 1] cumulative lengths; max_seqlen: longest sequence; batch, seqlen: the padded shape.
    """

    indices: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    seqlen: int

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
    return VarlenBatch(indices, cu, int(lengths.max()), batch, seqlen)


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
