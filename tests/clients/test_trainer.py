"""transformers Trainer: `predict` and `evaluate` with an optimized BertForSequenceClassification (the real MiniLM
encoder, a seeded head) against the untouched model, with and without labels, fastbert's path on every batch.

With labels the Trainer passes ``num_items_in_batch`` to the model (which hands it on to the encoder): fastbert
must take those calls too, not fall back to transformers' code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import transformers

from tests.helpers import NLI_LABELS, TEXTS, assert_close, minilm_head_model, optimized_copy, run_both

EXAMPLES = [*TEXTS, "Ok", "The new library opened in 1998 and holds more than two million books.", "Rain again?"]
BATCH = 4
BATCHES = math.ceil(len(EXAMPLES) / BATCH)
LABEL_CASES = {"with-labels": True, "without-labels": False}


@pytest.fixture(scope="module")
def classifier_pair(minilm_dir):
    """Its own pair: the Trainer may set the model's mode and device, so it shares none with other tests."""
    reference = minilm_head_model(minilm_dir, transformers.BertForSequenceClassification, seed=21,
                                  id2label=NLI_LABELS, label2id={v: k for k, v in NLI_LABELS.items()})
    return reference, optimized_copy(reference)


def _dataset(tokenizer, labels: bool) -> list[dict]:
    """Tokenized examples, unpadded (the Trainer's default collator pads each batch)."""
    rows = []
    for index, text in enumerate(EXAMPLES):
        row = dict(tokenizer(text))
        if labels:
            row["labels"] = index % len(NLI_LABELS)
        rows.append(row)
    return rows


def _trainer(model, tokenizer, out_dir) -> transformers.Trainer:
    args = transformers.TrainingArguments(output_dir=str(out_dir), per_device_eval_batch_size=BATCH, report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, processing_class=tokenizer, compute_metrics=_metrics)


def _metrics(prediction: transformers.EvalPrediction) -> dict:
    logits = np.asarray(prediction.predictions)
    return {"accuracy": float((logits.argmax(-1) == prediction.label_ids).mean()), "logit_sum": float(logits.sum())}


def _numbers(metrics: dict) -> dict:
    """The metrics that depend on the model (no runtimes or throughputs)."""
    timing = ("runtime", "per_second", "preparation_time")
    return {k: v for k, v in metrics.items() if not any(t in k for t in timing)}


@pytest.mark.parametrize("labels", LABEL_CASES.values(), ids=LABEL_CASES.keys())
def test_predict(classifier_pair, tokenizer, tmp_path, labels):
    dataset = _dataset(tokenizer, labels)
    expected, actual = run_both(lambda model: _trainer(model, tokenizer, tmp_path).predict(dataset),
                                *classifier_pair, forwards=BATCHES)
    assert actual.predictions.shape == expected.predictions.shape == (len(EXAMPLES), len(NLI_LABELS))
    assert_close(actual.predictions, expected.predictions, "predicted logits")
    if labels:
        np.testing.assert_array_equal(actual.label_ids, expected.label_ids)
    else:
        assert actual.label_ids is None and expected.label_ids is None
    want, got = _numbers(expected.metrics), _numbers(actual.metrics)
    assert got.keys() == want.keys()
    assert ("test_loss" in want) == labels
    for name in want:
        assert_close(got[name], want[name], name)


@pytest.mark.parametrize("labels", LABEL_CASES.values(), ids=LABEL_CASES.keys())
def test_evaluate(classifier_pair, tokenizer, tmp_path, labels):
    dataset = _dataset(tokenizer, labels)
    expected, actual = run_both(lambda model: _trainer(model, tokenizer, tmp_path).evaluate(dataset),
                                *classifier_pair, forwards=BATCHES)
    want, got = _numbers(expected), _numbers(actual)
    assert got.keys() == want.keys()
    if labels:
        assert {"eval_loss", "eval_accuracy", "eval_logit_sum"} <= want.keys()
    for name in want:
        assert_close(got[name], want[name], name)


def test_train_fine_tunes_through_fastbert(minilm_dir, tokenizer, tmp_path):
    """`Trainer.train` on an optimized model: every training forward on fastbert's path, the logged losses and the
    fine-tuned weights those of the untouched model trained alike (dropout off: both sides deterministic; SGD)."""
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    reference = minilm_head_model(minilm_dir, transformers.BertForSequenceClassification, seed=21,
                                  id2label=NLI_LABELS, label2id={v: k for k, v in NLI_LABELS.items()}, **no_dropout)
    optimized = optimized_copy(reference)
    dataset = _dataset(tokenizer, labels=True)
    steps = 3

    def train(model):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(id(model))), max_steps=steps,
                                              per_device_train_batch_size=BATCH, learning_rate=0.05, logging_steps=1,
                                              report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                                              seed=5, optim="sgd")
        # (SGD: Adam turns the rounding noise of near-zero gradients, e.g. the key bias's, into full-size steps)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    expected, actual = run_both(train, reference, optimized, forwards=steps)
    assert len(actual) == len(expected) == steps
    assert_close(actual, expected, "training losses")
    assert expected[-1] != expected[0], "the model did not train"
    for (name, got), (_, want) in zip(optimized.named_parameters(), reference.named_parameters(), strict=True):
        assert_close(got.detach(), want.detach(), name, tol=1e-4)
