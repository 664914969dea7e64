"""CUDA-graph replay of a FastBertModel for repeated input shapes (small-batch latency on a GPU).

What is checked where: on CPU, the padded static forward it captures, against the model (tests/test_cuda_graphs.py);
on an H200, capture and replay of BERT-base fp16 at five shapes (benchmarks/gpu_check.py's timing phase, in
benchmarks/results/h200-gpu-check as ``fastbert_triton_cudagraph``: timed, outputs not compared). Replayed outputs
against the eager model, and the bound on kept graphs, are the `gpu`-marked test's (not part of that H200 run).

How: a batch [B, S] is padded up to a bucket (B to a power of two, S to the smallest of ``seq_buckets`` >= S),
copied into that bucket's static input buffers, and the bucket's graph replays the padded path of the encoder
(key padding mask, no padding removal: the packed path has data-dependent shapes, which a graph cannot hold).
Each bucket is captured once, after two warm-up runs (Triton compiles and autotunes outside the capture).
Memory stays bounded however many shapes arrive: at most ``max_graphs`` graphs are kept (least recently used
evicted), all allocating from one shared memory pool. Longer inputs than the largest bucket run eagerly.
Limits: inference only; input_ids (not inputs_embeds); no hidden states output; outputs are copies.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from fastbert.model import EncoderOutput, FastBertModel, normalize_attention_mask
from fastbert.ops.padding import varlen_from_mask

DEFAULT_SEQ_BUCKETS = (16, 32, 64, 128, 256, 512)


def encode_padded(model: FastBertModel, input_ids: torch.Tensor, mask: torch.Tensor,
                  token_type_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The encoder on a padded [B, S] batch with no host synchronisation (capturable): returns
    (last_hidden_state [B, S, H] zero at padding, pooler_output [B, H] or None). mask: bool [B, S]."""
    batch, seqlen = input_ids.shape
    device = input_ids.device
    positions = model.default_position_ids(input_ids, batch, seqlen, device)
    if token_type_ids is None and model.config.type_vocab_size:
        token_type_ids = torch.zeros_like(input_ids)
    varlen = varlen_from_mask(None, batch, seqlen, device)
    types = token_type_ids.reshape(-1) if token_type_ids is not None else None
    x = model.encode_tokens(input_ids.reshape(-1), positions.reshape(-1), types, varlen, mask)[-1]
    hidden = x.view(batch, seqlen, -1) * mask[..., None].to(x.dtype)
    return hidden, model.pool(hidden)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    mask: torch.Tensor
    token_type_ids: torch.Tensor | None
    hidden: torch.Tensor
    pooled: torch.Tensor | None


class CudaGraphEncoder:
    """Callable like ``model(input_ids, attention_mask, token_type_ids)``, replaying one CUDA graph per bucket."""

    def __init__(self, model: FastBertModel, seq_buckets: tuple[int, ...] = DEFAULT_SEQ_BUCKETS,
                 max_graphs: int = 8):
        if max_graphs < 1:
            raise ValueError("max_graphs must be >= 1")
        limit = model.config.max_position_embeddings - (model.config.position_offset or 0)
        self.model = model.eval()
        self.seq_buckets = tuple(sorted(b for b in seq_buckets if b <= limit)) or (limit,)
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple[int, int, bool], _Captured] = OrderedDict()
        self.pool = None

    def bucket(self, batch: int, seqlen: int) -> tuple[int, int] | None:
        """(padded batch, padded seq) for this shape, or None when seqlen exceeds the largest bucket."""
        seq = next((b for b in self.seq_buckets if b >= seqlen), None)
        if seq is None:
            return None
        return 1 << max(0, (batch - 1).bit_length()), seq

    def _capture(self, batch: int, seqlen: int, with_types: bool, device) -> _Captured:
        ids = torch.full((batch, seqlen), self.model.config.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros(batch, seqlen, dtype=torch.bool, device=device)
        mask[:, 0] = True
        types = torch.zeros_like(ids) if with_types else None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                encode_padded(self.model, ids, mask, types)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, pooled = encode_padded(self.model, ids, mask, types)
        return _Captured(graph, ids, mask, types, hidden, pooled)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None) -> EncoderOutput:
        if input_ids.device.type != "cuda":
            raise RuntimeError(f"CudaGraphEncoder needs CUDA tensors, got {input_ids.device}")
        batch, seqlen = input_ids.shape
        shape = self.bucket(batch, seqlen)
        if shape is None:
            return self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        mask = normalize_attention_mask(attention_mask, batch, seqlen)
        if self.model.validate_inputs:
            positions = self.model.default_position_ids(input_ids, batch, seqlen, input_ids.device)
            self.model.validate_ids(input_ids, positions, token_type_ids)
        key = (*shape, token_type_ids is not None)
        captured = self.graphs.pop(key, None)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                self.graphs.popitem(last=False)  # least recently used: its graph and buffers are freed
            captured = self._capture(*shape, token_type_ids is not None, input_ids.device)
        self.graphs[key] = captured
        captured.input_ids.fill_(self.model.config.pad_token_id)
        captured.input_ids[:batch, :seqlen].copy_(input_ids)
        captured.mask.zero_()
        if mask is None:
            captured.mask[:batch, :seqlen].fill_(True)
        else:
            captured.mask[:batch, :seqlen].copy_(mask)
        if captured.token_type_ids is not None:
            captured.token_type_ids.zero_()
            captured.token_type_ids[:batch, :seqlen].copy_(token_type_ids)
        captured.graph.replay()
        hidden = captured.hidden[:batch, :seqlen].clone()
        pooled = captured.pooled[:batch].clone() if captured.pooled is not None else None
        return EncoderOutput(hidden, pooled)
