"""fastbert finetune --teacher: the task-distillation loss against a direct computation, the layer map, a tiny
distilled fine-tune through the CLI end to end (and that the teacher's signal trains the student), the pair task's
resampling, and one-line errors for teachers that cannot teach."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fastbert import cli  # noqa: E402
from fastbert.training import finetune  # noqa: E402
from fastbert.training.task_distillation import TeacherLoss, task_distillation_loss, uniform_layer_map  # noqa: E402
from tests.helpers import TOKENIZER_FILES, save_tiny_bert  # noqa: E402


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("fastbert: error: "), err
    assert "Traceback" not in err
    return lines[-1]


SMALL_RUN = ("--batch-size", "8", "--train-limit", "32", "--eval-limit", "24", "--threads", "1")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, minilm_dir) -> dict[str, str]:
    """A 4-layer tiny BERT fine-tuned for a few steps on each task (the teachers),
    a 2-layer student and a wider one, all with all-MiniLM-L6-v2's tokenizer."""
    root = tmp_path_factory.mktemp("task-distillation")
    base = save_tiny_bert(root / "base", minilm_dir, layers=4, seed=4)
    paths = {"base": base}
    for task in ("pair", "topic", "code"):
        out = root / f"teacher-{task}"
        code = cli.main(["finetune", "--task", task, "--model", base, "-o", str(out), "--max-steps", "3",
                         "--learning-rate", "1e-3", *SMALL_RUN])
        assert code == 0
        paths[f"teacher-{task}"] = str(out / "model")
    for name, hidden in (("student", 32), ("wide-student", 48)):
        paths[name] = save_tiny_bert(root / name, minilm_dir, layers=2, hidden=hidden, seed=2)
    return paths


# ---------------------------------------------------------------------------------------------------- the loss
def _outputs(batch: int, labels: int, layers: int, seq: int = 5, width: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, labels, generator=generator, dtype=torch.float64)
    hidden = tuple(torch.randn(batch, seq, width, generator=generator, dtype=torch.float64)
                   for _ in range(layers + 1))
    return SimpleNamespace(logits=logits, hidden_states=hidden)


def _direct_terms(student, teacher, labels, mask, temperature, layer_map):
    hard = F.cross_entropy(student.logits, labels)
    p_teacher = torch.softmax(teacher.logits / temperature, -1)
    log_p_student = torch.log_softmax(student.logits / temperature, -1)
    soft = (p_teacher * (p_teacher.log() - log_p_student)).sum(-1).mean() * temperature ** 2
    per_layer = []
    for m, t in enumerate(layer_map, start=1):
        cosines = [F.cosine_similarity(student.hidden_states[m][b, s], teacher.hidden_states[t][b, s], dim=0)
                   for b in range(mask.shape[0]) for s in range(mask.shape[1]) if mask[b, s]]
        per_layer.append(1 - torch.stack(cosines).mean())
    return hard, soft, torch.stack(per_layer).mean()


@pytest.mark.parametrize("alpha_soft, alpha_hidden", [(0.0, 0.0), (1.0, 0.0), (0.0, 2.0), (0.3, 0.7)])
def test_loss_is_each_term_with_its_weight(alpha_soft, alpha_hidden):
    student, teacher = _outputs(7, 3, layers=2, seed=1), _outputs(7, 3, layers=4, seed=2)
    labels = torch.tensor([0, 2, 1, 1, 0, 2, 2])
    student.loss = F.cross_entropy(student.logits, labels)
    mask = torch.ones(7, 5, dtype=torch.long)
    mask[3, 2:] = 0
    mask[6, 1:] = 0
    weights = TeacherLoss(alpha_soft=alpha_soft, temperature=2.5, alpha_hidden=alpha_hidden)
    layer_map = uniform_layer_map(2, 4)
    total, terms = task_distillation_loss(student, teacher, labels, mask, weights, layer_map)
    hard, soft, hidden = _direct_terms(student, teacher, labels, mask, 2.5, layer_map)
    torch.testing.assert_close(terms["hard_loss"], hard)
    torch.testing.assert_close(terms["soft_loss"], soft)
    assert ("hidden_loss" in terms) == bool(alpha_hidden)
    if alpha_hidden:
        torch.testing.assert_close(terms["hidden_loss"], hidden)
    expected = (1 - alpha_soft) * hard + alpha_soft * soft + alpha_hidden * hidden
    torch.testing.assert_close(total, expected)


def test_soft_targets_cover_only_labelled_tokens():
    """The token task: soft targets on the labelled tokens only (padding and later sub-tokens carry -100)."""
    generator = torch.Generator().manual_seed(0)
    student = SimpleNamespace(logits=torch.randn(2, 4, 3, generator=generator, dtype=torch.float64), loss=None)
    teacher = SimpleNamespace(logits=torch.randn(2, 4, 3, generator=generator, dtype=torch.float64))
    labels = torch.tensor([[-100, 1, -100, 0], [2, -100, -100, -100]])
    student.loss = torch.tensor(0.0, dtype=torch.float64)
    _, terms = task_distillation_loss(student, teacher, labels, torch.ones(2, 4), TeacherLoss(alpha_hidden=0.0), [])
    keep = labels != -100
    p = torch.softmax(teacher.logits[keep] / 2, -1)
    expected = (p * (p.log() - torch.log_softmax(student.logits[keep] / 2, -1))).sum(-1).mean() * 4
    torch.testing.assert_close(terms["soft_loss"], expected)


@pytest.mark.parametrize("student, teacher, expected", [(3, 6, [2, 4, 6]), (6, 6, [1, 2, 3, 4, 5, 6]),
                                                        (1, 12, [12]), (2, 5, [2, 5]), (4, 2, [1, 1, 2, 2])])
def test_layer_map_spreads_the_student_over_the_teacher(student, teacher, expected):
    assert uniform_layer_map(student, teacher) == expected


# --------------------------------------------------------------------------------------------- runs end to end
def test_distilled_finetune_through_the_cli(capsys, tmp_path, checkpoints):
    out = tmp_path / "run"
    argv = ["finetune", "--task", "pair", "--model", checkpoints["student"], "--teacher", checkpoints["teacher-pair"],
            "-o", str(out), "--max-steps", "4", "--learning-rate", "1e-3", "--resample-pairs", "--log-every", "1",
            *SMALL_RUN, "--train-limit", "16"]  # 2 steps per epoch: epoch 1 trains on resampled pairs
    code, _, err = _run(capsys, *argv)
    assert code == 0, err
    assert "distilling from the fine-tuned teacher" in err and "student->teacher layer 1->2, 2->4" in err
    results = json.loads((out / "results.json").read_text())
    teacher = results["teacher"]
    assert teacher["layer_map"] == [2, 4] and teacher["alpha_soft"] == 0.5 and teacher["temperature"] == 2.0
    # the teacher's figure is its own held-out accuracy on the same examples, and the share follows from it
    model = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoints["teacher-pair"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["teacher-pair"])
    test = finetune.subsample(finetune.build_task("pair").test, 24, 0)
    assert teacher["accuracy"] == pytest.approx(finetune.evaluate(model, tokenizer, test, "sequence", 2)["accuracy"])
    assert teacher["student_over_teacher"] == pytest.approx(results["evaluation"]["accuracy"] / teacher["accuracy"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if not r.get("eval")]
    assert results["train"]["examples"] == 16 and len(steps) == 4
    assert all({"hard_loss", "soft_loss", "hidden_loss"} <= set(r) for r in steps)
    # a resume of the finished run finds the same teacher and evaluates the same weights; another loss is refused
    code, _, err = _run(capsys, *argv, "--resume")
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["evaluation"] == results["evaluation"]
    code, _, err = _run(capsys, *argv, "--resume", "--alpha-soft", "0.25")
    assert code == 1 and "alpha_soft" in _one_error_line(err)


def test_the_token_task_runs_with_a_teacher(capsys, tmp_path, checkpoints):
    code, _, err = _run(capsys, "finetune", "--task", "code", "--model", checkpoints["student"], "--teacher",
                        checkpoints["teacher-code"], "-o", str(tmp_path / "run"), "--max-steps", "2", "--log-every",
                        "1", *SMALL_RUN)
    assert code == 0, err
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["kind"] == "token" and results["teacher"]["accuracy"] > 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    soft = [r["soft_loss"] for r in records if not r.get("eval")]
    assert len(soft) == 2 and all(math.isfinite(x) and x >= 0 for x in soft)  # soft targets on the labelled tokens


def test_the_teacher_is_frozen_and_deterministic(tmp_path, checkpoints, minilm_dir):
    settings = finetune.FinetuneSettings(task="pair", output_dir=str(tmp_path), teacher=checkpoints["teacher-pair"])
    data = finetune.pair_task(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["student"])
    student = transformers.BertForSequenceClassification.from_pretrained(checkpoints["student"], num_labels=2)
    teacher = finetune.build_teacher(settings, data, tokenizer, student.config, torch.device("cpu"))
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    batch = finetune.encode_batch(tokenizer, data.train[:6], "sequence", 64)
    out = student(**batch, output_hidden_states=True)
    first, second = teacher.loss(out, batch)[1], teacher.loss(out, batch)[1]
    assert all(torch.equal(first[name], second[name]) for name in first)  # no dropout in the teacher
    assert first["soft_loss"].requires_grad and first["hidden_loss"].requires_grad  # gradients reach the student


@pytest.mark.slow  # two fresh processes
def test_resume_after_sigkill_with_a_teacher_and_resampled_pairs(tmp_path, checkpoints):
    from tests.helpers import assert_same_final_weights, kill_and_resume, logged_losses

    common = ["finetune", "--task", "pair", "--model", checkpoints["student"], "--teacher",
              checkpoints["teacher-pair"], "--resample-pairs", "--max-steps", "8", "--save-every", "2",
              "--batch-size", "8", "--train-limit", "16", "--eval-limit", "8", "--threads", "1", "--log-every", "1"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert cli.main([*common, "-o", str(whole)]) == 0
    kill_and_resume([sys.executable, "-m", "fastbert.cli", *common, "-o", str(killed)], killed, 8, wait_s=180)
    assert_same_final_weights(whole, killed)
    assert logged_losses(killed) == logged_losses(whole)


def test_the_teachers_soft_targets_train_the_student(tmp_path, checkpoints):
    """Soft targets alone (no labels, no hidden states): the student's distance to the teacher falls."""
    settings = finetune.FinetuneSettings(
        task="pair", output_dir=str(tmp_path / "run"), model_dir=checkpoints["student"],
        teacher=checkpoints["teacher-pair"], alpha_soft=1.0, alpha_hidden=0.0, max_steps=24, batch_size=8,
        learning_rate=2e-3, warmup_ratio=0.0, train_limit=16, eval_limit=8, log_every=1, progress=False)
    finetune.finetune(settings, log=open(tmp_path / "log.txt", "w"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    soft = [r["soft_loss"] for r in records if not r.get("eval")]
    assert len(soft) == 24 and all(math.isfinite(x) for x in soft)
    assert sum(soft[-4:]) / 4 < 0.5 * sum(soft[:4]) / 4, soft


def test_resampled_epochs_keep_the_anchors_and_the_held_out_pairs(tasks_pair):
    settings = finetune.FinetuneSettings(task="pair", output_dir="unused", resample_pairs=True)
    task = finetune.FinetuneTask(tasks_pair, tasks_pair.train, tasks_pair.test, None, settings, "unused")
    first, second = task.epoch_examples(0), task.epoch_examples(1)
    assert first is tasks_pair.train and second == finetune.pair_task(1).train
    assert [e.text for e in first] == [e.text for e in second]
    assert [e.text_pair for e in first] != [e.text_pair for e in second]
    assert finetune.pair_task(1).test != tasks_pair.test  # what resampling must not use: the run keeps seed 0's
    fixed = finetune.FinetuneTask(tasks_pair, tasks_pair.train, tasks_pair.test, None,
                                  finetune.FinetuneSettings(task="pair", output_dir="unused"), "unused")
    assert fixed.epoch_examples(3) is tasks_pair.train


@pytest.fixture(scope="module")
def tasks_pair() -> finetune.TaskData:
    return finetune.pair_task(0)


# ---------------------------------------------------------------------------------------------------- errors
def _different_tokenizer(directory: Path, model_dir: str) -> str:
    shutil.copytree(model_dir, directory)
    for name in TOKENIZER_FILES:
        (directory / name).unlink(missing_ok=True)
    # transformers 5 builds an empty tokenizer from vocab_file=; the vocabulary is passed as a mapping
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a"]
    transformers.BertTokenizerFast(vocab={word: i for i, word in enumerate(words)}).save_pretrained(directory)
    return str(directory)


def test_teachers_that_cannot_teach_are_one_line_errors(capsys, tmp_path, checkpoints):
    def error(*extra: str, model: str = checkpoints["student"]) -> str:
        code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", model, "-o",
                            str(tmp_path / f"run{len(list(tmp_path.iterdir()))}"), "--max-steps", "1", *extra,
                            *SMALL_RUN)
        assert code == 1
        return _one_error_line(err)

    assert "are not those of --task pair" in error("--teacher", checkpoints["teacher-topic"])
    assert "its labels none" in error("--teacher", checkpoints["base"])
    assert "does not exist" in error("--teacher", str(tmp_path / "nowhere"))
    other = _different_tokenizer(tmp_path / "other-tokenizer", checkpoints["teacher-pair"])
    assert "tokenizer differs" in error("--teacher", other)
    assert "hidden size 32" in error("--teacher", checkpoints["teacher-pair"], model=checkpoints["wide-student"])
    assert "did you mean" in error("--teacher", str(Path(checkpoints["teacher-pair"]).parent))
    headless = tmp_path / "headless"
    shutil.copytree(checkpoints["base"], headless)
    config = json.loads((headless / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**config, "id2label": {"0": "follows", "1": "random"},
                                                      "label2id": {"follows": 0, "random": 1}}))
    assert "no trained classification head" in error("--teacher", str(headless))
    no_token_types = tmp_path / "no-token-types"
    shutil.copytree(checkpoints["teacher-pair"], no_token_types)
    tokenizer_config = json.loads((no_token_types / "tokenizer_config.json").read_text())
    (no_token_types / "tokenizer_config.json").write_text(json.dumps(
        {**tokenizer_config, "model_input_names": ["input_ids", "attention_mask"]}))
    assert "token types in one only" in error("--teacher", str(no_token_types))
    short = tmp_path / "short"
    shutil.copytree(checkpoints["teacher-pair"], short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    assert "16 positions, fewer than --max-length 128" in error("--teacher", str(short))
    assert "--alpha-soft needs --teacher" in error("--alpha-soft", "0.3")
    teacher = ("--teacher", checkpoints["teacher-pair"])
    assert "--alpha-soft must be between 0 and 1" in error(*teacher, "--alpha-soft", "1.5")
    assert "--temperature must be a number > 0" in error(*teacher, "--temperature", "nan")
    assert "--alpha-hidden must be a number >= 0" in error(*teacher, "--alpha-hidden", "-1")
    assert "would teach nothing" in error(*teacher, "--alpha-soft", "0", "--alpha-hidden", "0")
    assert "--teacher needs a directory" in error("--teacher", "")
    code, _, err = _run(capsys, "finetune", "--task", "topic", "--model", checkpoints["student"], "-o",
                        str(tmp_path / "topic"), "--resample-pairs")
    assert code == 1 and "--resample-pairs is an option of --task pair" in _one_error_line(err)


def test_a_wide_student_may_learn_from_soft_targets_alone(capsys, tmp_path, checkpoints):
    code, _, err = _run(capsys, "finetune", "--task", "pair", "--model", checkpoints["wide-student"], "--teacher",
                        checkpoints["teacher-pair"], "--alpha-hidden", "0", "-o", str(tmp_path / "run"),
                        "--max-steps", "2", *SMALL_RUN)
    assert code == 0, err
    assert "hidden states" not in err
