"""fastbert.bench.recording: which backend each op ran on, dispatch restored after."""

import torch

from fastbert import backends
from fastbert.bench import peers, recording


def test_record_backends_counts_every_op_and_restores_dispatch(minilm_dir, bert_ops):
    model = peers.load_fastbert(minilm_dir, backend="eager")
    original = backends.dispatch
    with torch.inference_mode(), recording.record_backends() as seen:
        model(input_ids=torch.tensor([[101, 7592, 2088, 102]]))
    assert backends.dispatch is original
    assert bert_ops <= set(recording.OPS) and set(seen) == bert_ops
    assert seen["attention"]["eager"] == model.config.num_hidden_layers
    assert recording.backends_used(seen) == {op: "eager" for op in bert_ops}
