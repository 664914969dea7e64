"""fastbert finetune: the labelled sets (real labels, disjoint deterministic splits), the evaluation, a tiny
fine-tune through the CLI end to end, and the CLI's one-line errors."""

from __future__ import annotations

import io
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastbert import cli  # noqa: E402
from fastbert.common.resolve import UserError  # noqa: E402
from fastbert.training import finetune  # noqa: E402
from fastbert.training.corpus import prose_sentences  # noqa: E402
from fastbert.training.finetune import Example, TaskData  # noqa: E402
from tests.helpers import TOKENIZER_FILES, save_tiny_bert  # noqa: E402


@pytest.fixture(scope="module")
def tasks() -> dict[str, TaskData]:
    return {name: finetune.build_task(name) for name in finetune.TASK_NAMES}


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, minilm_dir) -> str:
    """A tiny random BERT (2 layers, H=32) with all-MiniLM-L6-v2's tokenizer, saved as an HF checkpoint."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), minilm_dir)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------------------ datasets
@pytest.mark.parametrize("name", finetune.TASK_NAMES)
def test_splits_are_disjoint_by_source_and_text(tasks, name):
    data = tasks[name]
    assert data.train and data.test
    assert not {e.source for e in data.train} & {e.source for e in data.test}

    def key(e: Example):
        return (e.text, e.text_pair, e.words)

    assert not {key(e) for e in data.train} & {key(e) for e in data.test}
    share = len(data.test) / (len(data.train) + len(data.test))
    assert 0.1 < share < 0.3, share


@pytest.mark.parametrize("name", finetune.TASK_NAMES)
def test_tasks_are_deterministic(tasks, name):
    again = finetune.build_task(name)
    assert again.train == tasks[name].train and again.test == tasks[name].test


def test_pair_partners_depend_on_the_seed(tasks):
    other = finetune.build_task("pair", seed=1)
    assert [e.text for e in other.train] == [e.text for e in tasks["pair"].train]  # the same first sentences
    assert [e.text_pair for e in other.train] != [e.text_pair for e in tasks["pair"].train]


def test_topic_labels_are_the_package_each_sentence_comes_from(tasks):
    data = tasks["topic"]
    by_file: dict[str, set[str]] = {}
    for path, _, doc in finetune.stdlib_docstrings():
        by_file.setdefault(path, set()).update(prose_sentences(doc))
    for example in data.train + data.test:
        assert example.source.split("/")[0] == data.labels[example.label]
        assert example.text in by_file[example.source]
    # every label has held-out sentences, and no label dominates: the baseline is far from trivial
    assert all(count > 20 for count in data.label_counts("test").values())
    assert finetune.majority_baseline(data)["accuracy"] < 0.4


def test_docstrings_of_some_packages_are_those_of_the_whole_library_in_them():
    whole = finetune.stdlib_docstrings()
    some = finetune.stdlib_docstrings(finetune.TOPIC_PACKAGES)
    assert some and len(some) < len(whole)
    assert some == tuple(d for d in whole if d[0].split("/")[0] in finetune.TOPIC_PACKAGES)


def test_pair_labels_follow_the_text(tasks):
    data = tasks["pair"]
    import pydoc_data.topics

    documents = {f"pydoc:{t}": text for t, text in pydoc_data.topics.topics.items()}
    for path, index, doc in finetune.stdlib_docstrings():
        documents[f"{path}#{index}"] = doc
    for example in data.train[:400] + data.test[:400]:
        flat = " ".join(documents[example.source].split())
        if example.label == 0:  # the second sentence comes right after the first in the same text
            assert f"{example.text} {example.text_pair}" in flat
        else:
            assert example.text in flat and f"{example.text} {example.text_pair}" not in flat
    counts = data.label_counts("train")
    assert abs(counts["follows"] - counts["random"]) < 0.1 * len(data.train)


def test_code_words_remove_the_markup_and_label_what_was_inside():
    words, labels = finetune.code_words('The built-in variable "__debug__" is "True" under normal circumstances.')
    assert words == ("The", "built-in", "variable", "__debug__", "is", "True", "under", "normal", "circumstances.")
    assert labels == (0, 0, 0, 1, 0, 1, 0, 0, 0)
    assert finetune.code_words('An odd "quote count.') is None
    assert finetune.code_words("No literal here at all.") is None


def test_code_task_holds_real_sentences_of_the_pydoc_topics(tasks):
    # from the "assert" topic: 'Assignments to "__debug__" are illegal.'
    wanted = (("Assignments", "to", "__debug__", "are", "illegal."), (0, 0, 1, 0, 0))
    found = [(e.words, e.label) for e in tasks["code"].train + tasks["code"].test]
    assert wanted in found
    assert all(len(words) == len(labels) and 1 in labels for words, labels in found)
    counts = tasks["code"].label_counts("test")
    assert counts["code"] > 100 and counts["prose"] > counts["code"]


def test_held_out_sources_take_about_the_fraction_without_dividing_a_source():
    sizes = {f"file{i}": (i % 7) + 1 for i in range(200)}
    held = finetune.held_out_sources(sizes, 0.25)
    share = sum(sizes[s] for s in held) / sum(sizes.values())
    assert 0.23 < share <= 0.25
    assert held == finetune.held_out_sources(dict(reversed(sizes.items())), 0.25)  # order of the dict is irrelevant


def test_majority_baseline_and_subsample():
    data = TaskData("t", "sequence", ("a", "b"), [Example("s", 0), Example("s", 1), Example("s", 1)],
                    [Example("u", 1), Example("u", 0), Example("u", 0), Example("u", 0)], "")
    assert finetune.majority_baseline(data) == {"label": "b", "accuracy": 0.25}
    sample = finetune.subsample(data.test, 2, seed=3)
    assert len(sample) == 2 and sample == finetune.subsample(data.test, 2, seed=3)
    assert finetune.subsample(data.test, None, seed=3) == data.test


def test_majority_baseline_takes_the_label_of_the_examples_given_for_training():
    data = TaskData("t", "sequence", ("a", "b"), [Example("s", 0)] * 3 + [Example("s", 1)],
                    [Example("u", 1), Example("u", 1), Example("u", 0)], "")
    assert finetune.majority_baseline(data) == {"label": "a", "accuracy": pytest.approx(1 / 3)}
    assert finetune.majority_baseline(data, train=data.train[3:]) == {"label": "b", "accuracy": pytest.approx(2 / 3)}


def test_token_labels_sit_on_each_words_first_subtoken(minilm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    example = Example("x", (0, 1, 0), words=("Call", "__init_subclass__", "here."))
    batch = finetune.encode_batch(tokenizer, [example], "token", 64)
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    labelled = [(t, int(label)) for t, label in zip(tokens, batch["labels"][0], strict=True) if label != -100]
    assert labelled == [("call", 0), ("_", 1), ("here", 0)]  # "__init_subclass__" is many sub-tokens, labelled once


class _Oracle(torch.nn.Module):
    """Predicts label 1 for every token of the first row, the true label elsewhere (known confusion)."""

    def __init__(self, labels: torch.Tensor):
        super().__init__()
        self.labels = labels

    def forward(self, input_ids, **_):
        logits = torch.nn.functional.one_hot(self.labels.clamp(min=0)[:, :input_ids.shape[1]], 2).float()
        logits[0] = torch.tensor([0.0, 1.0])
        return transformers.modeling_outputs.TokenClassifierOutput(logits=logits)


def test_evaluate_counts_words_and_truncated_words_as_wrong(minilm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    examples = [Example("x", (0, 1, 0), words=("a", "b", "c")), Example("y", (0,) * 20, words=("word",) * 20)]
    batch = finetune.encode_batch(tokenizer, examples, "token", 12)  # the second row keeps 10 of its 20 words
    result = finetune.evaluate(_Oracle(batch["labels"]), tokenizer, examples, "token", 2, max_length=12)
    # row 0: 1 of 3 right (all predicted 1); row 1: 10 right, 10 cut off
    assert result["count"] == 23 and result["truncated_words"] == 10
    assert result["accuracy"] == pytest.approx(11 / 23)
    assert result["per_label"][1] == {"precision": pytest.approx(1 / 3), "recall": 1.0, "f1": pytest.approx(0.5),
                                      "support": 1}


# ------------------------------------------------------------------------------------------------ the CLI
def _independent_accuracy(model_dir: Path, results: dict) -> float:
    """Held-out accuracy of the saved model recomputed here, one example at a time, plain transformers."""
    data = finetune.build_task(results["task"], results["settings"]["seed"])
    test = finetune.subsample(data.test, results["settings"]["eval_limit"], results["settings"]["seed"])
    auto = (transformers.AutoModelForSequenceClassification if data.kind == "sequence"
            else transformers.AutoModelForTokenClassification)
    model = auto.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    right = total = 0
    with torch.no_grad():
        for example in test:
            if data.kind == "sequence":
                logits = model(**tokenizer(example.text, example.text_pair, return_tensors="pt")).logits
                right += int(logits.argmax(-1).item() == example.label)
                total += 1
            else:
                encoded = tokenizer(list(example.words), is_split_into_words=True, return_tensors="pt")
                predicted = model(**encoded).logits.argmax(-1)[0]
                firsts = {}
                for position, word in enumerate(encoded.word_ids(0)):
                    if word is not None:
                        firsts.setdefault(word, position)
                right += sum(int(predicted[firsts[w]]) == label for w, label in enumerate(example.label))
                total += len(example.label)
    return right / total


@pytest.mark.parametrize("task", ["pair", "code"])
def test_tiny_finetune_through_the_cli(capsys, tmp_path, tiny_checkpoint, task):
    out = tmp_path / "run"
    code, _, err = _run(capsys, "finetune", "--task", task, "--model", tiny_checkpoint, "-o", str(out),
                        "--max-steps", "4", "--batch-size", "8", "--train-limit", "32", "--eval-limit", "24",
                        "--learning-rate", "1e-3", "--threads", "1")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == task and results["training"]["steps"] == 4
    assert results["train"]["examples"] == 32 and results["held_out"]["examples"] == 24
    assert any(line.startswith("fastbert finetune: held-out accuracy") for line in err.splitlines()), repr(err)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("eval")] == [1, 2, 3, 4]
    # the saved model is the trained one: its weights moved, and it scores what results.json says
    saved = transformers.AutoModel.from_pretrained(out / "model").state_dict()
    start = transformers.AutoModel.from_pretrained(tiny_checkpoint).state_dict()
    assert not torch.equal(saved["encoder.layer.0.attention.self.query.weight"],
                           start["encoder.layer.0.attention.self.query.weight"])
    assert results["evaluation"]["accuracy"] == pytest.approx(_independent_accuracy(out / "model", results))
    data = finetune.build_task(task)
    baseline = finetune.majority_baseline(data, finetune.subsample(data.test, 24, 0),
                                          finetune.subsample(data.train, 32, 0))
    assert results["majority_baseline"] == baseline

    # resuming a finished run says so and changes nothing
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    code, _, err = _run(capsys, "finetune", "--task", task, "--model", tiny_checkpoint, "-o", str(out),
                        "--max-steps", "4", "--batch-size", "8", "--train-limit", "32", "--eval-limit", "24",
                        "--learning-rate", "1e-3", "--resume")
    assert code == 0, err
    assert (f"fastbert finetune: the run in {out} is already complete (step 4 of 4): nothing to train, nothing "
            f"changed; its results are in {out / 'results.json'}, its model in {out / 'model'}\n") in err
    assert "held-out accuracy" not in err and "steps in" not in err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == files

    # ... unless it asks for another evaluation: that is evaluated and reported
    code, _, err = _run(capsys, "finetune", "--task", task, "--model", tiny_checkpoint, "-o", str(out),
                        "--max-steps", "4", "--batch-size", "8", "--train-limit", "32", "--eval-limit", "12",
                        "--learning-rate", "1e-3", "--resume")
    assert code == 0 and "nothing changed" not in err and "held-out accuracy" in err, err
    assert json.loads((out / "results.json").read_text())["held_out"]["examples"] == 12


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("fastbert: error: "), err
    assert "Traceback" not in err
    return lines[-1]


def test_cli_errors_are_one_line(capsys, tmp_path, tiny_checkpoint):
    code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", str(tmp_path / "nowhere"), "-o",
                        str(tmp_path / "a"))
    assert code == 1 and "does not exist" in _one_error_line(err)

    code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", tiny_checkpoint, "-o", str(tmp_path / "b"),
                        "--batch-size", "0")
    assert code == 1 and "--batch-size" in _one_error_line(err)

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_checkpoint, no_tokenizer, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", str(no_tokenizer), "-o", str(tmp_path / "c"))
    assert code == 1 and "tokenizer" in _one_error_line(err)

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["finetune", "--task", "sentiment", "-o", str(tmp_path / "d")])
    assert exit_info.value.code == 2 and "invalid choice" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("option, value, message", [
    ("--learning-rate", "nan", "--learning-rate must be a number > 0, got nan"),
    ("--epochs", "inf", "--epochs must be a number > 0, got inf"),
    ("--warmup-ratio", "nan", "--warmup-ratio must be in [0, 1), got nan"),
    ("--save-every", "-1", "--save-every must be >= 0, got -1"),
    ("--log-every", "0", "--log-every must be >= 1, got 0"),
])
def test_option_values_are_refused_before_any_work(capsys, tmp_path, option, value, message):
    out = tmp_path / "run"
    code, _, err = _run(capsys, "finetune", "--task", "topic", "--model", str(tmp_path / "unread"), "-o", str(out),
                        option, value)
    assert code == 1 and err == f"fastbert: error: {message}\n"  # before the model is looked for
    assert not out.exists()


def test_cli_refuses_an_output_dir_that_holds_a_run(capsys, tmp_path, tiny_checkpoint):
    argv = ["finetune", "--task", "topic", "--model", tiny_checkpoint, "-o", str(tmp_path / "run"), "--max-steps", "1",
            "--batch-size", "4", "--train-limit", "4", "--eval-limit", "4"]
    assert _run(capsys, *argv)[0] == 0
    code, _, err = _run(capsys, *argv)
    assert code == 1 and "already holds a run" in _one_error_line(err)


def test_the_majority_baseline_is_that_of_the_train_limit_sample(tmp_path, tiny_checkpoint, monkeypatch):
    """The baseline is comparable with the run: the most frequent label of the --train-limit sample trained on (here
    'b', 4 of 4), not of the whole training split (there 'a', 16 of 20), scored on the held-out examples."""
    import random

    chosen = set(random.Random(0).sample(range(20), 4))  # what `subsample(train, 4, seed=0)` keeps
    assert finetune.subsample(list(range(20)), 4, 0) == sorted(chosen)
    train = [Example(f"s{i}", int(i in chosen), text=f"Sentence number {i} of the training side.") for i in range(20)]
    test = [Example(f"u{i}", label, text=f"Held-out sentence {i}.") for i, label in enumerate((1, 1, 1, 0))]
    data = TaskData("topic", "sequence", ("a", "b"), train, test, "synthetic")
    monkeypatch.setattr(finetune, "build_task", lambda name, seed=0: data)
    log = io.StringIO()
    results = finetune.finetune(finetune.FinetuneSettings(
        task="topic", output_dir=str(tmp_path / "run"), model_dir=tiny_checkpoint, max_steps=1, batch_size=4,
        train_limit=4, seed=0), log=log)
    assert results["train"]["label_counts"] == {"a": 0, "b": 4}
    assert results["majority_baseline"] == {"label": "b", "accuracy": 0.75}
    assert "(majority baseline 0.7500: always 'b')" in log.getvalue()


@pytest.mark.parametrize("option", ["--model", "--teacher"])
@pytest.mark.parametrize("kept", ["model", "checkpoint-0000003"], ids=["finetune-run", "pretrain-run"])
def test_a_run_directory_is_pointed_at_its_model(capsys, tmp_path, tiny_checkpoint, option, kept):
    """A run's output directory given for a checkpoint: one line naming the model in it, DIR/model (a finetune or
    distill run) or its latest checkpoint (a pretrain run), for --model as for --teacher."""
    run = tmp_path / "earlier-run"
    shutil.copytree(tiny_checkpoint, run / kept)
    (run / kept / "trainer_state.pt").touch()  # what makes a checkpoint directory complete
    model = ["--teacher", str(run), "--model", tiny_checkpoint] if option == "--teacher" else ["--model", str(run)]
    code, _, err = _run(capsys, "finetune", "--task", "pair", *model, "-o", str(tmp_path / "new"), "--max-steps", "1")
    assert code == 1
    assert _one_error_line(err) == (f"fastbert: error: {option}: model path {run} has no config.json; did you mean "
                                    f"{run / kept}?")
    assert not (tmp_path / "new").exists()


def test_max_length_is_capped_to_the_models_positions(tmp_path, minilm_dir, capsys):
    directory = tmp_path / "short"
    config = transformers.BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=24)
    transformers.BertModel(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(minilm_dir) / name, directory / name)
    results = finetune.finetune(finetune.FinetuneSettings(
        task="code", output_dir=str(tmp_path / "run"), model_dir=str(directory), max_steps=1, batch_size=4,
        train_limit=4, eval_limit=8))  # default max_length 128 would index past 24 positions
    assert results["settings"]["max_length"] == 24
    assert "capped to the model's 24 positions" in capsys.readouterr().err
    assert results["evaluation"]["truncated_words"] > 0  # counted as wrong, and reported
    with pytest.raises(UserError, match=r"--max-length must lie in \[8, 24\] for this model, got 32"):
        finetune.finetune(finetune.FinetuneSettings(task="code", output_dir=str(tmp_path / "asked"),
                                                    model_dir=str(directory), max_length=32))  # asked for: not cut


# --------------------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_minilm_learns_the_topic_task(tmp_path, minilm_dir):
    results = finetune.finetune(finetune.FinetuneSettings(
        task="topic", output_dir=str(tmp_path / "run"), model_dir=minilm_dir, max_steps=40, batch_size=16,
        train_limit=640, eval_limit=150, learning_rate=2e-4))
    assert results["evaluation"]["accuracy"] > results["majority_baseline"]["accuracy"] + 0.15
    assert Counter(results["held_out"]["label_counts"]) == Counter(
        finetune.count_labels(finetune.TOPIC_PACKAGES, finetune.subsample(finetune.build_task("topic").test, 150, 0)))


def test_a_resume_with_more_epochs_extends_a_finished_run(capsys, tmp_path, tiny_checkpoint):
    """--epochs sets max_steps (2 per epoch here): a resume with more epochs extends the run, on the new schedule
    (warmup 10 % of the new max_steps) from its last step on; a smaller --max-steps than its step is refused."""
    argv = ["finetune", "--task", "pair", "--model", tiny_checkpoint, "-o", str(tmp_path / "run"), "--batch-size",
            "8", "--train-limit", "16", "--eval-limit", "8", "--threads", "1", "--warmup-ratio", "0.5"]
    assert _run(capsys, *argv, "--epochs", "1")[0] == 0
    code, _, err = _run(capsys, *argv, "--epochs", "2", "--resume")
    assert code == 0, err
    assert ("--max-steps 4 extends the run (its checkpoint's: 2): the learning rate now follows the schedule for 4 "
            "steps (warmup 2 steps (was 1), linear decay to 0 at step 4)") in err
    assert "2 steps in" in err and "(steps 3-4; 4 in all)" in err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["training"]["steps"] == 4 and results["training"]["epochs"] == 2.0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if not r.get("eval")] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r.get("eval")] == [0, 2, 4]
    code, _, err = _run(capsys, *argv, "--max-steps", "3", "--resume")
    assert code == 1 and "--max-steps 3 is below the step of the checkpoint" in _one_error_line(err)


def test_a_teacher_that_does_not_exist_is_refused_before_the_data_is_built(capsys, tmp_path, tiny_checkpoint,
                                                                          monkeypatch):
    def build_task(name, seed=0):
        raise AssertionError("the data was built before the teacher was checked")

    monkeypatch.setattr(finetune, "build_task", build_task)
    code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", tiny_checkpoint, "--teacher",
                        str(tmp_path / "nonexistent"), "-o", str(tmp_path / "run"))
    assert code == 1
    assert _one_error_line(err) == f"fastbert: error: --teacher: model path {tmp_path / 'nonexistent'} does not exist"


@pytest.mark.parametrize("name", finetune.TASK_NAMES)
def test_the_task_outline_is_the_tasks_shape(tasks, name):
    outline = finetune.task_outline(name)
    assert (outline.name, outline.kind, outline.labels) == (name, tasks[name].kind, tasks[name].labels)
