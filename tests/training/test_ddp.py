"""Scale-out: an optimized transformers BERT trained with DistributedDataParallel on two CPU processes (gloo)
matches a single-process run on the same global batch (dropout off), and both ranks end with identical weights;
then `fastbert finetune` (fastbert.training.loop's loop) under torchrun against the same run in one process."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")

import fastbert  # noqa: E402

WORLD_SIZE, GLOBAL_BATCH, STEPS, VOCAB = 2, 8, 4, 64
ROOT = Path(__file__).resolve().parents[2]


def _model() -> torch.nn.Module:
    """A seeded tiny BertForSequenceClassification without dropout, through fastbert.optimize."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config).train()
    return fastbert.optimize(model)


def _global_batch(step: int) -> dict[str, torch.Tensor]:
    """GLOBAL_BATCH rows of random ids with different lengths (padding on the right), labels 0..2."""
    generator = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(3, 17, (GLOBAL_BATCH,), generator=generator)
    ids = torch.randint(1, VOCAB, (GLOBAL_BATCH, 16), generator=generator)
    mask = (torch.arange(16) < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask,
            "labels": torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)}


def _train(model: torch.nn.Module, step_model, shard) -> list[float]:
    """STEPS SGD steps on one global batch (so the loss must fall); its mean loss at each step (averaged over ranks
    under DDP). SGD, not Adam: Adam divides by sqrt(v), which turns the rounding noise of a gradient that is zero in
    exact arithmetic (the attention key bias's) into a full-size step, so weights could not be compared."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = step_model(**shard(_global_batch(0))).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        value = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(float(value))
    return losses


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=120))  # a lost peer fails a collective, never hangs it
    try:
        model = _model()
        path = fastbert.explain(model, **_global_batch(0))
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        losses = _train(model, wrapped, lambda b: {k: v.tensor_split(WORLD_SIZE)[rank] for k, v in b.items()})
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.save({"losses": losses, "state": state, "path": path}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # tear down together: a rank leaving first can leave the other waiting in its teardown
    finally:
        dist.destroy_process_group()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


@pytest.mark.slow  # two processes importing transformers: ~30 s here
def test_ddp_two_cpu_ranks_match_one_process_on_the_global_batch(tmp_path):
    context = mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # a hung rank must fail the test, not the whole CI run
            for process in context.processes:
                process.kill()
            pytest.fail("a DDP rank did not finish within 240 s")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
    assert ranks[0]["state"].keys() == ranks[1]["state"].keys()
    for key, tensor in ranks[0]["state"].items():  # DDP: every rank applied the same averaged gradients
        assert torch.equal(tensor, ranks[1]["state"][key]), key

    torch.set_num_threads(1)
    single = _model()
    start = {k: v.detach().clone() for k, v in single.state_dict().items()}
    losses = _train(single, single, lambda b: b)
    for step, (theirs, ours) in enumerate(zip(ranks[0]["losses"], losses, strict=True)):
        assert abs(theirs - ours) <= 1e-5 * abs(ours), (step, theirs, ours)
    assert losses[-1] < losses[0]  # it trained
    for key, tensor in single.state_dict().items():
        if tensor.is_floating_point():
            assert _relative(ranks[0]["state"][key], tensor) <= 1e-5, key
    assert any(not torch.equal(start[k], v) for k, v in single.state_dict().items())
    assert "fastbert's path" in ranks[0]["path"], ranks[0]["path"]  # DDP trained fastbert's kernels, not a fallback


def _tiny_checkpoint(directory: Path, minilm_dir: str) -> str:
    """A tiny random BERT without dropout, with all-MiniLM-L6-v2's tokenizer."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    transformers.BertModel(config).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(Path(minilm_dir) / name, directory / name)
    return str(directory)


@pytest.mark.slow
def test_finetune_under_torchrun_matches_one_process(tmp_path, minilm_dir):
    checkpoint = _tiny_checkpoint(tmp_path / "tiny", minilm_dir)
    command = ["finetune", "--task", "pair", "--model", checkpoint, "--max-steps", "5", "--batch-size", "8",
               "--train-limit", "48", "--eval-limit", "32", "--learning-rate", "1e-3", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, launcher in (("single", [sys.executable, "-m", "fastbert.cli"]),
                           ("ddp", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                    f"--nproc-per-node={WORLD_SIZE}", "-m", "fastbert.cli"])):
        out = tmp_path / name
        done = subprocess.run([*launcher, *command, "-o", str(out)], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in records if not r.get("eval")],
                      json.loads((out / "results.json").read_text()))
    (single_losses, single), (ddp_losses, ddp) = runs["single"], runs["ddp"]
    assert len(ddp_losses) == len(single_losses) == 5
    for theirs, ours in zip(ddp_losses, single_losses, strict=True):
        assert abs(theirs - ours) <= 1e-5 * abs(ours), (ddp_losses, single_losses)
    assert "fastbert's path" in ddp["path"], ddp["path"]
    assert ddp["held_out"] == single["held_out"]
    assert ddp["evaluation"]["accuracy"] == single["evaluation"]["accuracy"]
    weights = [transformers.AutoModel.from_pretrained(tmp_path / name / "model").state_dict() for name in runs]
    for key, tensor in weights[0].items():
        # The key bias's gradient is zero in exact arithmetic (it shifts a query's scores by a constant; softmax
        # ignores it): AdamW turns the rounding noise into steps of ~1e-8 that differ between the runs.
        if tensor.is_floating_point() and not key.endswith("attention.self.key.bias"):
            assert _relative(weights[1][key], tensor) <= 1e-5, key
