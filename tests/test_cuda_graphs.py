"""fastbert.cuda_graphs: the capturable padded forward and the bucketing, on CPU; capture and replay only on a GPU
(`gpu` marker)."""

from __future__ import annotations

import copy

import pytest
import torch

import fastbert
from fastbert.cuda_graphs import CudaGraphEncoder, encode_padded
from tests.helpers import padded_batch, rel_err, tiny_model


def _fast_model(family: str, backend: str):
    optimized = fastbert.optimize(copy.deepcopy(tiny_model(family)), backend=backend)
    return optimized.base_model._fastbert.build.fast


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_encode_padded_matches_the_model(family):
    model = _fast_model(family, "eager")
    ids, mask = padded_batch(3, 9, pad_id=model.config.pad_token_id)
    with torch.inference_mode():
        expected = model(ids, attention_mask=mask)
        hidden, pooled = encode_padded(model, ids, mask.bool(), None)
    assert rel_err(hidden, expected.last_hidden_state) < 1e-5
    assert rel_err(pooled, expected.pooler_output) < 1e-5


def test_buckets_and_cpu_refusal():
    runner = CudaGraphEncoder(_fast_model("bert", "eager"), seq_buckets=(8, 16, 32, 64), max_graphs=2)
    assert runner.seq_buckets == (8, 16, 32)  # tiny models have 40 positions
    assert runner.bucket(3, 9) == (4, 16)
    assert runner.bucket(1, 8) == (1, 8)
    assert runner.bucket(2, 33) is None
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        runner(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.gpu
def test_graph_replay_matches_eager_and_stays_bounded():
    model = _fast_model("bert", "triton").cuda()
    runner = CudaGraphEncoder(model, seq_buckets=(8, 16, 32), max_graphs=2)
    for batch, seqlen in [(3, 9), (1, 5), (2, 16), (3, 9), (4, 30)]:
        ids, mask = padded_batch(batch, seqlen)
        ids, mask = ids.cuda(), mask.cuda()
        with torch.inference_mode():
            expected = model(ids, attention_mask=mask).last_hidden_state
        assert rel_err(runner(ids, mask).last_hidden_state, expected) < 1e-4
        assert len(runner.graphs) <= 2
