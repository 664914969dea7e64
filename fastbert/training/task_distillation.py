"""Task-specific distillation (``fastbert finetune --teacher DIR``): the student is fine-tuned on the task's labels
and, in the same steps, on the outputs of a classifier already fine-tuned on the same task (the teacher).

The loss of one batch:

    (1 - alpha_soft) * cross-entropy(student, labels)
    + alpha_soft * soft_target_loss(student logits, teacher logits, T)
    + alpha_hidden * mean over student layers m of the token-wise cosine loss (student layer m, teacher layer g(m))

Soft targets during fine-tuning are DistilBERT's "distillation during fine-tuning" (Sanh et al., arXiv:1910.01108,
section 4.2); the hidden-state term is TinyBERT's task-specific stage (Jiao et al., Findings of EMNLP 2020,
section 3.1-3.2: layer mapping g(m) = m * N / M) with the cosine of DistilBERT's loss in place of its MSE. Both
models read the same token ids, so the teacher must share the student's tokenizer. The teacher runs in eval mode
without gradients (through `fastbert.optimize` when the student is optimized). The layer map is TinyBERT's uniform
one whatever layers the student was built from (`fastbert distill` copies 0, 3, 5 of 6 for 3; the map compares
their outputs with the teacher's layers 2, 4, 6).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fastbert.common.resolve import UserError
from fastbert.config import FastBertConfig
from fastbert.training.distill import layer_cosine_loss, soft_target_loss, teacher_fingerprint
from fastbert.training.masking import IGNORE_INDEX
from fastbert.training.settings import resolve_model_option

if TYPE_CHECKING:
    from transformers.modeling_outputs import SequenceClassifierOutput, TokenClassifierOutput

    ClassifierOutput = SequenceClassifierOutput | TokenClassifierOutput  # what transformers' classifiers return


@dataclass(frozen=True)
class TeacherLoss:
    """The weights of the task-distillation loss (module docstring) and the soft targets' temperature."""

    alpha_soft: float = 0.5
    temperature: float = 2.0
    alpha_hidden: float = 1.0

    def check(self) -> None:
        """ValueError naming the first weight that cannot train, or a teacher that would teach nothing."""
        if not 0 <= self.alpha_soft <= 1:  # also refuses nan
            raise ValueError(f"--alpha-soft must be between 0 and 1, got {self.alpha_soft}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"--temperature must be a number > 0, got {self.temperature}")
        if not (math.isfinite(self.alpha_hidden) and self.alpha_hidden >= 0):
            raise ValueError(f"--alpha-hidden must be a number >= 0, got {self.alpha_hidden}")
        if self.alpha_soft == 0 and self.alpha_hidden == 0:
            raise ValueError("--alpha-soft 0 and --alpha-hidden 0: the teacher would teach nothing")


def uniform_layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """TinyBERT's g(m) = m * N / M, rounded: for each student layer m = 1..M, the index in the teacher's
    ``hidden_states`` (0 = the embeddings) whose output it is compared with; the last layers meet, and a student
    deeper than its teacher never maps a layer to the embeddings."""
    return [max(1, round(m * teacher_layers / student_layers)) for m in range(1, student_layers + 1)]


def task_distillation_loss(student_out: ClassifierOutput, teacher_out: ClassifierOutput, labels: torch.Tensor,
                           attention_mask: torch.Tensor, weights: TeacherLoss,
                           layer_map: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(weighted total, {"hard_loss", "soft_loss"[, "hidden_loss"]} unweighted) of one batch, from transformers'
    classifier outputs (``loss`` from the labels, ``logits``, ``hidden_states`` when alpha_hidden is not 0). The soft
    targets cover the labelled rows (sequence tasks) or the labelled tokens (the token task)."""
    labelled = labels != IGNORE_INDEX
    terms = {"hard_loss": student_out.loss,
             "soft_loss": soft_target_loss(student_out.logits[labelled], teacher_out.logits[labelled],
                                           weights.temperature)}
    total = (1 - weights.alpha_soft) * terms["hard_loss"] + weights.alpha_soft * terms["soft_loss"]
    if weights.alpha_hidden:
        targets = [teacher_out.hidden_states[index] for index in layer_map]
        terms["hidden_loss"] = layer_cosine_loss(student_out.hidden_states[1:], targets, attention_mask)
        total = total + weights.alpha_hidden * terms["hidden_loss"]
    return total, terms


class TaskTeacher:
    """A frozen fine-tuned classifier and how the student learns from it (`task_distillation_loss`)."""

    def __init__(self, model: torch.nn.Module, directory: str, weights: TeacherLoss, student_layers: int):
        self.model, self.directory, self.weights = model, directory, weights
        self.layer_map = uniform_layer_map(student_layers, model.config.num_hidden_layers)
        self.fingerprint = teacher_fingerprint(directory)

    @property
    def wants_hidden_states(self) -> bool:
        return bool(self.weights.alpha_hidden)

    def loss(self, student_out: ClassifierOutput,
             batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The batch's loss against the teacher's outputs on the same inputs."""
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        with torch.no_grad():
            teacher_out = self.model(**inputs, output_hidden_states=self.wants_hidden_states)
        return task_distillation_loss(student_out, teacher_out, batch["labels"], batch["attention_mask"],
                                      self.weights, self.layer_map)

    def settings(self) -> dict[str, Any]:
        """What a resume must find unchanged: the teacher's weights and the loss."""
        return {"teacher": os.path.abspath(self.directory), "teacher_fingerprint": self.fingerprint,
                "alpha_soft": self.weights.alpha_soft, "temperature": self.weights.temperature,
                "alpha_hidden": self.weights.alpha_hidden, "layer_map": self.layer_map}

    def describe(self) -> str:
        """One line for the run's log."""
        line = (f"distilling from the fine-tuned teacher {self.directory} ({self.model.config.num_hidden_layers} "
                f"layers): soft targets weight {self.weights.alpha_soft:g} at temperature "
                f"{self.weights.temperature:g}")
        if self.weights.alpha_hidden:
            pairs = ", ".join(f"{m}->{t}" for m, t in enumerate(self.layer_map, start=1))
            line += f", hidden states weight {self.weights.alpha_hidden:g} (student->teacher layer {pairs})"
        return line


def resolve_teacher(teacher_dir: str) -> tuple[str, FastBertConfig]:
    """(directory, config) of the teacher checkpoint; UserError naming --teacher when there is none (and pointing
    at ``DIR/model`` when DIR is a `fastbert finetune` run's output directory: `resolve_model_option`)."""
    return resolve_model_option("--teacher", teacher_dir)


def check_teacher(directory: str, config: FastBertConfig, labels: tuple[str, ...], task: str,
                  student_config: FastBertConfig, max_length: int, weights: TeacherLoss,
                  tokenizers: tuple[Any, Any]) -> None:
    """UserError with one line unless the teacher can teach this student this task: a classifier of the task's
    labels, the same tokenizer as the student (``tokenizers``: the teacher's, the student's) giving the same
    inputs (token types or not), positions for ``max_length`` tokens and, for the hidden-state term, the
    student's width."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        id2label = json.load(f).get("id2label") or {}
    found = tuple(id2label[key] for key in sorted(id2label, key=int))
    if found != labels:
        raise UserError(f"--teacher {directory}: its labels {list(found) or 'none'} are not those of --task {task} "
                        f"{list(labels)}; give a classifier fine-tuned on --task {task} (DIR/model of a `fastbert "
                        f"finetune --task {task}` run)")
    teacher_tokenizer, student_tokenizer = tokenizers
    if teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab():
        raise UserError(f"--teacher {directory}: its tokenizer differs from the student's; both models must read the "
                        "same token ids")
    if list(teacher_tokenizer.model_input_names) != list(student_tokenizer.model_input_names):
        raise UserError(f"--teacher {directory}: it reads {', '.join(teacher_tokenizer.model_input_names)}, the "
                        f"student {', '.join(student_tokenizer.model_input_names)} (token types in one only)")
    if config.token_positions < max_length:
        raise UserError(f"--teacher {directory}: {config.token_positions} positions, fewer than --max-length "
                        f"{max_length}")
    if weights.alpha_hidden and config.hidden_size != student_config.hidden_size:
        raise UserError(f"--teacher {directory}: hidden size {config.hidden_size} against the student's "
                        f"{student_config.hidden_size}; the hidden-state term needs equal widths (--alpha-hidden 0)")


def check_head(directory: str, missing_keys: list[str]) -> None:
    """UserError when the teacher's checkpoint lacked weights of its classifier (a base model, not a fine-tuned one)."""
    if missing_keys:
        raise UserError(f"--teacher {directory}: no trained classification head ({', '.join(sorted(missing_keys)[:3])} "
                        "missing)")
