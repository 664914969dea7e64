"""What a model's frozen features say about `fastbert finetune --task pair` (is sentence B the one after A).

For each model directory: encode every training and held-out pair of the task (`fastbert.training.finetune.pair_task`,
seed 0) once as a pair (`[CLS] A [SEP] B [SEP]`) and each sentence alone (mean-pooled, normalised), then fit a
logistic regression (L-BFGS, L2 1e-2, standardised features) on the training pairs and report its held-out accuracy
for four feature sets: the pair's [CLS] state, the mean of the pair's token states, the sentence embeddings
[u, v, |u - v|, u * v], and their cosine alone. Used for the distillation results (benchmarks/results/
cpu-2core-distill/README.md, run 3) to tell what a student's representations hold from what fine-tuning makes of
them.

    .venv/bin/python benchmarks/pair_probe.py teacher=DIR student=DIR [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

import fastbert
from fastbert.common.text import mean_pool
from fastbert.training.finetune import Example, pair_task

FEATURES = ("cls", "mean", "sep", "cos")


def encode(model, tokenizer, examples: list[Example], batch_size: int = 64) -> dict[str, torch.Tensor]:
    """The four feature sets of ``examples`` (see the module docstring)."""
    found: dict[str, list[torch.Tensor]] = {"cls": [], "mean": [], "u": [], "v": []}
    with torch.inference_mode():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            batch = tokenizer([e.text for e in chunk], [e.text_pair for e in chunk], truncation=True,
                              max_length=128, padding=True, return_tensors="pt")
            hidden = model(**batch).last_hidden_state
            found["cls"].append(hidden[:, 0])
            found["mean"].append(mean_pool(hidden, batch["attention_mask"], normalize=False))
            for key, texts in (("u", [e.text for e in chunk]), ("v", [e.text_pair for e in chunk])):
                alone = tokenizer(texts, truncation=True, max_length=128, padding=True, return_tensors="pt")
                found[key].append(mean_pool(model(**alone).last_hidden_state, alone["attention_mask"]))
    u, v = torch.cat(found["u"]), torch.cat(found["v"])
    return {"cls": torch.cat(found["cls"]), "mean": torch.cat(found["mean"]),
            "sep": torch.cat([u, v, (u - v).abs(), u * v], 1), "cos": (u * v).sum(1, keepdim=True)}


def probe_accuracy(train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    """Held-out accuracy of a two-class logistic regression fitted on standardised training features."""
    mean, scale = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / scale, (test_x - mean) / scale
    weight = torch.zeros(train_x.shape[1], 2, requires_grad=True)
    bias = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=300)

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(train_x @ weight + bias, train_y) + 1e-2 * (weight ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return float(((test_x @ weight + bias).argmax(1) == test_y).float().mean())


def probe_model(model_dir: str) -> dict[str, float]:
    data = pair_task(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = fastbert.from_pretrained(model_dir)
    train, test = encode(model, tokenizer, data.train), encode(model, tokenizer, data.test)
    train_y = torch.tensor([e.label for e in data.train])
    test_y = torch.tensor([e.label for e in data.test])
    return {name: round(probe_accuracy(train[name], train_y, test[name], test_y), 4) for name in FEATURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", metavar="NAME=DIR")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name, model_dir in (item.split("=", 1) for item in args.models):
        started = time.time()
        results[name] = {"model": model_dir, **probe_model(model_dir), "seconds": round(time.time() - started, 1)}
        print(name, results[name], flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
