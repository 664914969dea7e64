"""fastbert.bench.workloads: fixed and variable-length batches, padded where masked."""

import torch

from fastbert.bench import workloads
from fastbert.config import FastBertConfig


def test_make_workloads_fixed_and_varlen():
    made = workloads.make_workloads([1, 5], [32], varlen=True, seed=3)
    names = [w.name for w in made]
    assert names == ["b1 s32", "b5 s32", "varlen b5 s<=32"]  # no varlen batch of one sequence
    fixed, varlen = made[1], made[2]
    assert fixed.lengths == [32] * 5 and fixed.tokens == 160
    assert len(varlen.lengths) == 5 and max(varlen.lengths) == 32 and min(varlen.lengths) >= 4
    assert varlen.tokens == sum(varlen.lengths) < 160


def test_workload_inputs_pad_where_masked():
    config = FastBertConfig(model_type="roberta", vocab_size=50, hidden_size=8, num_hidden_layers=1,
                            num_attention_heads=2, intermediate_size=16, pad_token_id=1)
    workload = workloads.Workload("w", 3, 6, [6, 2, 4], True)
    batch = workload.inputs(config, torch.device("cpu"))
    assert batch["attention_mask"].sum(dim=1).tolist() == [6, 2, 4]
    real = batch["attention_mask"].bool()
    assert bool((batch["input_ids"][~real] == 1).all())
    assert not bool((batch["input_ids"][real] == 1).any())
