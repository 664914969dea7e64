"""Fine-tuning (``fastbert finetune``): fine-tune a checkpoint on small real labelled sets built offline from
CPython's own text.

Three tasks, each deterministic for a given Python version, with a held-out split by *source* (a whole file, topic
or docstring goes to one side), so no sentence, nor a near-copy from the same place, is on both sides:

- ``topic`` (single-sentence classification): sentences of standard-library docstrings, labelled by the package
  they come from (asyncio, email, importlib, multiprocessing, unittest, xml). Held out by file.
- ``pair`` (sentence-pair classification, BERT's next-sentence task on real prose): two consecutive sentences of
  one paragraph of ``pydoc_data.topics`` or a docstring (label ``follows``) or the first of them with a sentence
  of another document of the same split (label ``random``), 50/50. Held out by topic / file.
- ``code`` (token classification): sentences of ``pydoc_data.topics`` whose inline literals Sphinx rendered as
  ``"..."``; the quote marks are removed from the input and each word is labelled ``code`` (it was inside the
  literal markup) or ``prose``. Held out by topic.

The model is transformers' ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification`` loaded from
the checkpoint (a new head on top of it), passed through ``fastbert.optimize``, trained by ``fastbert.training.loop``,
evaluated on the held-out split against the majority-class baseline and saved in HF format with its tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from fastbert.common.resolve import UserError, resolve_device
from fastbert.common.text import load_auto_tokenizer
from fastbert.files import write_atomic
from fastbert.training import curves
from fastbert.training import loop as training
from fastbert.training.corpus import (
    TEST_DIRS,
    UNDOCUMENTED_DIRS,
    file_docstrings,
    prose_sentences,
    stdlib_python_files,
)
from fastbert.training.distill import freeze
from fastbert.training.loop import StepOutput, TrainingTask
from fastbert.training.masking import IGNORE_INDEX
from fastbert.training.settings import check_number, check_output_dir, resolve_model_option
from fastbert.training.task_distillation import (
    TaskTeacher,
    TeacherLoss,
    check_head,
    check_teacher,
    resolve_teacher,
)

if TYPE_CHECKING:  # transformers is optional and imported where a model or tokenizer is built
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from fastbert.config import FastBertConfig

TASK_NAMES = ("topic", "pair", "code")
TOPIC_PACKAGES = ("asyncio", "email", "importlib", "multiprocessing", "unittest", "xml")
PAIR_LABELS = ("follows", "random")
CODE_LABELS = ("prose", "code")
HELD_OUT_FRACTION = 0.2
DEFAULT_MAX_LENGTH = 128  # tokens per example when --max-length is not given
# The folders whose docstrings are left out: no prose of their own, tkinter (as in `cpython_sentences`), the tests.
SKIPPED_DIRS = UNDOCUMENTED_DIRS | {"tkinter"} | TEST_DIRS
_QUOTED = re.compile(r'"([^"]*)"')


# ------------------------------------------------------------------------------------------------ datasets
@dataclass(frozen=True)
class Example:
    """One labelled example. Sequence tasks: ``text`` (and ``text_pair``) with one label; the token task:
    ``words`` with one label per word. ``source`` names where it came from (the unit of the held-out split)."""

    source: str
    label: int | tuple[int, ...]
    text: str = ""
    text_pair: str | None = None
    words: tuple[str, ...] = ()


@dataclass
class TaskData:
    """A task's label names and its train / held-out examples."""

    name: str
    kind: str  # "sequence" or "token"
    labels: tuple[str, ...]
    train: list[Example]
    test: list[Example]
    description: str

    def label_counts(self, split: str) -> dict[str, int]:
        """How many examples (sequence tasks) or words (token task) of ``split`` carry each label."""
        return count_labels(self.labels, getattr(self, split))


def _stable_hash(source: str) -> int:
    """A hash that is the same in every process and on every machine (Python's ``hash`` of a str is salted)."""
    return int.from_bytes(hashlib.sha256(source.encode("utf-8")).digest()[:8], "big")


def held_out_sources(sizes: dict[str, int], fraction: float = HELD_OUT_FRACTION) -> set[str]:
    """The sources (files, topics) of the held-out split: taken in the order of a stable hash of their names, each
    one that still fits under ``fraction`` of all examples, so the split is close to ``fraction`` however unequal
    the sources are, and a source is never divided."""
    target = fraction * sum(sizes.values())
    held, count = set(), 0
    for source in sorted(sizes, key=lambda s: (_stable_hash(s), s)):
        if count + sizes[source] <= target:
            held.add(source)
            count += sizes[source]
    return held


@lru_cache(maxsize=2)
def stdlib_docstrings(packages: tuple[str, ...] | None = None) -> tuple[tuple[str, int, str], ...]:
    """(path relative to the standard library, index in the file, docstring) for every module, class and function
    docstring of the standard library outside its test suites, in sorted path order; only the files of
    ``packages`` (top-level names) when given, which spares parsing the rest (seconds)."""
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    found = []
    for path in stdlib_python_files(SKIPPED_DIRS):
        relative = os.path.relpath(path, stdlib).replace(os.sep, "/")
        if packages is None or relative.split("/")[0] in packages:
            found.extend((relative, index, doc) for index, doc in enumerate(file_docstrings(path)))
    return tuple(found)


def _paragraphs(text: str) -> Iterator[str]:
    """The prose paragraphs of a text (indented blocks are code, grammar or tables in both pydoc topics and
    docstrings)."""
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.strip() and not paragraph.startswith((" ", "\t")):
            yield paragraph


def _pydoc_topics() -> dict[str, str]:
    import pydoc_data.topics

    return dict(sorted(pydoc_data.topics.topics.items()))


def topic_task() -> TaskData:
    """Sentences of the docstrings of TOPIC_PACKAGES, labelled by package; split by file. A sentence found in more
    than one package is dropped; one found twice in a package is kept once (first file in sorted order)."""
    where: dict[str, tuple[str, str]] = {}
    ambiguous: set[str] = set()
    for path, _, doc in stdlib_docstrings(TOPIC_PACKAGES):
        package = path.split("/")[0]
        for sentence in prose_sentences(doc):
            if sentence in where and where[sentence][0] != package:
                ambiguous.add(sentence)
            where.setdefault(sentence, (package, path))
    kept = [(sentence, package, path) for sentence, (package, path) in where.items() if sentence not in ambiguous]
    held: set[str] = set()
    for package in TOPIC_PACKAGES:  # per package, so every label has its share of held-out sentences
        held |= held_out_sources(Counter(path for _, p, path in kept if p == package))
    train, test = [], []
    for sentence, package, path in kept:
        example = Example(source=path, label=TOPIC_PACKAGES.index(package), text=sentence)
        (test if path in held else train).append(example)
    return TaskData("topic", "sequence", TOPIC_PACKAGES, train, test,
                    "standard-library docstring sentences labelled by package; held out by file")


def _pair_documents() -> list[tuple[str, str, list[list[str]]]]:
    """(split key, document name, paragraphs as lists of sentences) for pydoc topics and standard-library
    docstrings. The split key of a docstring is its file, so one file's docstrings stay on one side."""
    documents = []
    for topic, text in _pydoc_topics().items():
        documents.append((f"pydoc:{topic}", f"pydoc:{topic}", [prose_sentences(p) for p in _paragraphs(text)]))
    for path, index, doc in stdlib_docstrings():
        documents.append((path, f"{path}#{index}", [prose_sentences(p) for p in _paragraphs(doc)]))
    return documents


def pair_task(seed: int = 0) -> TaskData:
    """Pairs of sentences: consecutive in one paragraph (``follows``) or the first one with a sentence of another
    document on the same side of the split (``random``), chosen 50/50 with ``random.Random(seed)``.

    Sentences repeat across the standard library (``io`` and ``_pyio``, pydoc text quoted in docstrings), so: a
    held-out pair has no sentence that occurs anywhere in the training documents; each sentence is the first of at
    most one pair per side; a ``random`` partner is never a sentence that follows the first one anywhere."""
    rng = random.Random(seed)
    documents = _pair_documents()
    sizes: Counter[str] = Counter()
    successors: dict[str, set[str]] = {}
    for key, _, paragraphs in documents:
        sizes[key] += sum(max(len(p) - 1, 0) for p in paragraphs)
        for paragraph in paragraphs:
            for first, second in pairwise(paragraph):
                successors.setdefault(first, set()).add(second)
    held = held_out_sources(sizes)
    sides: dict[bool, list[tuple[str, list[list[str]]]]] = {False: [], True: []}
    for key, name, paragraphs in documents:
        sides[key in held].append((name, paragraphs))
    train_sentences = {s for _, paragraphs in sides[False] for p in paragraphs for s in p}
    splits = {held_out: _side_pairs(side, train_sentences if held_out else set(), successors, rng)
              for held_out, side in sides.items()}  # training side first: both draw from one rng
    return TaskData("pair", "sequence", PAIR_LABELS, splits[False], splits[True],
                    "consecutive sentences of one paragraph (pydoc topics, stdlib docstrings) vs a sentence of "
                    "another document, 50/50; held out by topic / file")


def _side_pairs(side: list[tuple[str, list[list[str]]]], excluded: set[str], successors: dict[str, set[str]],
                rng: random.Random) -> list[Example]:
    """The pairs of one side of the split (see `pair_task`), leaving out every sentence in ``excluded``."""
    pool = [(index, s) for index, (_, paragraphs) in enumerate(side) for p in paragraphs for s in p
            if s not in excluded]
    examples, anchors = [], set()
    for index, (name, paragraphs) in enumerate(side):
        for paragraph in paragraphs:
            for first, second in pairwise(paragraph):
                if first in anchors or first in excluded or second in excluded:
                    continue
                anchors.add(first)
                if rng.random() < 0.5:
                    examples.append(Example(source=name, label=0, text=first, text_pair=second))
                    continue
                while True:
                    other, sentence = pool[rng.randrange(len(pool))]
                    if other != index and sentence != first and sentence not in successors[first]:
                        break
                examples.append(Example(source=name, label=1, text=first, text_pair=sentence))
    return examples


def code_words(sentence: str) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The words of a pydoc sentence with its ``"..."`` literal markup removed, and per word 1 if it was inside
    the markup, else 0; None if the quotes do not pair up or nothing is marked."""
    if sentence.count('"') % 2 or '"' not in sentence:
        return None
    words: list[str] = []
    labels: list[int] = []
    position = 0
    for match in _QUOTED.finditer(sentence):
        prose = sentence[position:match.start()].split()
        words += prose
        labels += [0] * len(prose)
        code = match.group(1).split()
        words += code
        labels += [1] * len(code)
        position = match.end()
    prose = sentence[position:].split()
    words += prose
    labels += [0] * len(prose)
    if 1 not in labels:
        return None
    return tuple(words), tuple(labels)


def code_task() -> TaskData:
    """pydoc topic sentences with inline literals: words labelled code / prose, quote marks removed; split by
    topic. Each distinct sentence is kept once."""
    examples = []
    seen: set[str] = set()
    for topic, text in _pydoc_topics().items():
        for paragraph in _paragraphs(text):
            for sentence in prose_sentences(paragraph):
                labelled = code_words(sentence)
                if labelled is not None and sentence not in seen:
                    seen.add(sentence)
                    examples.append(Example(source=f"pydoc:{topic}", label=labelled[1], words=labelled[0]))
    held = held_out_sources(Counter(e.source for e in examples))
    train = [e for e in examples if e.source not in held]
    test = [e for e in examples if e.source in held]
    return TaskData("code", "token", CODE_LABELS, train, test,
                    "pydoc topic sentences, quote marks of inline literals removed, each word labelled code or "
                    "prose; held out by topic")


_TASK_SHAPES = {"topic": ("sequence", TOPIC_PACKAGES), "pair": ("sequence", PAIR_LABELS),
                "code": ("token", CODE_LABELS)}


def task_outline(name: str) -> TaskData:
    """The named task's name, kind and labels without its examples (instant, where `build_task` takes seconds):
    what the checks of a teacher need before the data is built."""
    if name not in _TASK_SHAPES:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
    kind, labels = _TASK_SHAPES[name]
    return TaskData(name, kind, labels, [], [], "")


def build_task(name: str, seed: int = 0) -> TaskData:
    """The named task's data (TASK_NAMES); ``seed`` draws the random partners of the pair task."""
    if name == "topic":
        return topic_task()
    if name == "pair":
        return pair_task(seed)
    if name == "code":
        return code_task()
    raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")


def subsample(examples: Sequence[Example], limit: int | None, seed: int) -> list[Example]:
    """At most ``limit`` examples, a seeded random sample in their original order (all of them if None)."""
    if limit is None or limit >= len(examples):
        return list(examples)
    keep = sorted(random.Random(seed).sample(range(len(examples)), limit))
    return [examples[i] for i in keep]


# ------------------------------------------------------------------------------------------------ batches
def encode_batch(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], kind: str,
                 max_length: int) -> dict[str, torch.Tensor]:
    """Tokenise and pad a batch (longest in the batch). Sequence tasks: ``labels`` [B]; the token task: ``labels``
    [B, S] with the word label on each word's first sub-token and IGNORE_INDEX elsewhere (special tokens, later
    sub-tokens, padding)."""
    if kind == "sequence":
        texts = [e.text for e in examples]
        pairs = [e.text_pair for e in examples]
        has_pairs = any(p is not None for p in pairs)
        if has_pairs and any(p is None for p in pairs):
            raise ValueError("a batch mixes single sentences and pairs")
        batch = tokenizer(texts, pairs if has_pairs else None, truncation=True, max_length=max_length,
                          padding=True, return_tensors="pt")
        batch["labels"] = torch.tensor([e.label for e in examples])
        return dict(batch)
    batch = tokenizer([list(e.words) for e in examples], is_split_into_words=True, truncation=True,
                      max_length=max_length, padding=True, return_tensors="pt")
    labels = torch.full(batch["input_ids"].shape, IGNORE_INDEX, dtype=torch.long)
    for row, example in enumerate(examples):
        previous = None
        for position, word in enumerate(batch.word_ids(row)):
            if word is not None and word != previous:
                labels[row, position] = example.label[word]
            previous = word
    batch["labels"] = labels
    return dict(batch)


def batches(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], kind: str, batch_size: int,
            max_length: int, shuffle_seed: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Encoded batches of ``examples`` in order, or shuffled with ``random.Random(shuffle_seed)``."""
    order = list(range(len(examples)))
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(order)
    for start in range(0, len(order), batch_size):
        yield encode_batch(tokenizer, [examples[i] for i in order[start:start + batch_size]], kind, max_length)


# ------------------------------------------------------------------------------------------------- metrics
def majority_baseline(data: TaskData, test: Sequence[Example] | None = None,
                      train: Sequence[Example] | None = None) -> dict:
    """The most frequent label of the training examples (``train``: those a run trained on, a --train-limit sample;
    default the whole training split; examples, or words for the token task) and the accuracy on ``test``
    (default the whole held-out split) of always predicting it: what a model that learnt only the label shares of
    its training data scores."""
    train_counts = count_labels(data.labels, data.train if train is None else train)
    label = max(range(len(data.labels)), key=lambda i: train_counts[data.labels[i]])
    test = data.test if test is None else test
    labels = [x for e in test for x in (e.label if isinstance(e.label, tuple) else (e.label,))]
    return {"label": data.labels[label], "accuracy": sum(x == label for x in labels) / max(len(labels), 1)}


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], kind: str,
             num_labels: int, batch_size: int = 64, max_length: int = 128) -> dict:
    """Held-out figures of a classifier in eval mode: accuracy, per-label precision / recall / F1 and macro F1.
    The token task counts words (a word cut off by ``max_length`` counts as wrong and is reported)."""
    was_training = model.training
    model.eval()
    confusion = torch.zeros(num_labels, num_labels, dtype=torch.long)  # [true, predicted]
    try:
        for batch in batches(tokenizer, examples, kind, batch_size, max_length):
            labels = batch.pop("labels")
            predicted = model(**batch).logits.argmax(-1)
            keep = labels != IGNORE_INDEX
            confusion += torch.bincount(labels[keep] * num_labels + predicted[keep],
                                        minlength=num_labels * num_labels).view(num_labels, num_labels)
    finally:
        model.train(was_training)
    # Token task: a word cut off by max_length has no prediction; it counts as wrong.
    actual = torch.zeros(num_labels, dtype=torch.long)
    for example in examples:
        for label in example.label if isinstance(example.label, tuple) else (example.label,):
            actual[label] += 1
    truncated = int(actual.sum() - confusion.sum())
    per_label = []
    for label in range(num_labels):
        tp = int(confusion[label, label])
        predicted_count, actual_count = int(confusion[:, label].sum()), int(actual[label])
        precision = tp / predicted_count if predicted_count else 0.0
        recall = tp / actual_count if actual_count else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_label.append({"precision": precision, "recall": recall, "f1": f1, "support": actual_count})
    total = int(actual.sum())
    return {"accuracy": int(confusion.diag().sum()) / max(total, 1), "count": total,
            "macro_f1": sum(p["f1"] for p in per_label) / num_labels, "per_label": per_label,
            "truncated_words": truncated, "confusion": confusion.tolist()}


# ------------------------------------------------------------------------------------------------ training
class _EpochBatches(Sequence):
    """The batches of one epoch, encoded on demand: a seeded shuffle of the examples that depends only on
    (seed, epoch), as `fastbert.training.loop` needs for an exact resume."""

    def __init__(self, tokenizer, examples: Sequence[Example], kind: str, batch_size: int, max_length: int,
                 seed: int, epoch: int):
        self.tokenizer, self.examples, self.kind = tokenizer, examples, kind
        self.batch_size, self.max_length = batch_size, max_length
        self.order = list(range(len(examples)))
        random.Random(f"finetune:{seed}:{epoch}").shuffle(self.order)  # str seeds are hashed stably (sha512)

    def __len__(self) -> int:
        return (len(self.order) + self.batch_size - 1) // self.batch_size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(index)
        chosen = self.order[index * self.batch_size:(index + 1) * self.batch_size]
        return encode_batch(self.tokenizer, [self.examples[i] for i in chosen], self.kind, self.max_length)


@dataclass
class FinetuneSettings:
    """One fine-tuning run (the options of ``fastbert finetune``)."""

    task: str
    output_dir: str
    model_dir: str | None = None  # None: the embedded all-MiniLM-L6-v2
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    batch_size: int = 32
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01
    max_length: int | None = None  # None: DEFAULT_MAX_LENGTH, or the model's positions if fewer
    train_limit: int | None = None
    eval_limit: int | None = None
    seed: int = 0
    device: str | None = None
    backend: str = "auto"
    optimize: bool = True
    resume: bool = False
    save_every: int = 0
    log_every: int = 10
    progress: bool | None = None
    teacher: str | None = None  # a classifier fine-tuned on the task: task distillation (`task_distillation`)
    alpha_soft: float | None = None  # None: TeacherLoss's defaults; only with a teacher
    temperature: float | None = None
    alpha_hidden: float | None = None
    resample_pairs: bool = False  # pair task: new partners each epoch (epoch e uses pair_task(seed + e)'s)

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot run."""
        if self.task not in TASK_NAMES:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASK_NAMES)}")
        if self.batch_size < 1 or (self.max_length is not None and self.max_length < 8):
            raise ValueError("need --batch-size >= 1 and --max-length >= 8")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"--max-steps must be >= 1, got {self.max_steps}")
        check_number("--epochs", self.epochs, strict=True, error=ValueError)
        check_number("--learning-rate", self.learning_rate, strict=True, error=ValueError)
        if not 0 <= self.warmup_ratio < 1:  # (refuses nan too)
            raise ValueError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        for name, value, minimum in (("--train-limit", self.train_limit, 1), ("--eval-limit", self.eval_limit, 1),
                                     ("--save-every", self.save_every, 0), ("--log-every", self.log_every, 1)):
            if value is not None and value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if self.resample_pairs and self.task != "pair":
            raise ValueError("--resample-pairs is an option of --task pair")
        if self.teacher is not None and not self.teacher.strip():
            raise ValueError("--teacher needs a directory, got an empty string")
        self.teacher_loss().check()

    def teacher_loss(self) -> TeacherLoss:
        """The task-distillation loss: TeacherLoss's defaults with the weights given here over them; ValueError for
        a weight given without a teacher."""
        given = {"alpha_soft": self.alpha_soft, "temperature": self.temperature, "alpha_hidden": self.alpha_hidden}
        if self.teacher is None:
            named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
            if named:
                raise ValueError(f"{', '.join(named)} needs --teacher DIR (it weighs the loss against a teacher)")
        return TeacherLoss(**{name: value for name, value in given.items() if value is not None})

    def training_arguments(self, max_steps: int) -> training.TrainingArguments:
        """The `fastbert.training.loop` arguments of this run, for ``max_steps`` steps."""
        return training.TrainingArguments(
            output_dir=self.output_dir, max_steps=max_steps, learning_rate=self.learning_rate,
            weight_decay=self.weight_decay, warmup_steps=int(self.warmup_ratio * max_steps), seed=self.seed,
            save_every=self.save_every, log_every=self.log_every, resume=self.resume, progress=self.progress)


class FinetuneTask(TrainingTask):
    """The `fastbert.training.loop.TrainingTask` of a fine-tuning run: batches of the training split, the head's loss
    and batch accuracy, the held-out evaluation at the end, the tokenizer beside each checkpoint."""

    def __init__(self, data: TaskData, train: list[Example], test: list[Example], tokenizer: PreTrainedTokenizerBase,
                 settings: FinetuneSettings, model_dir: str, teacher: TaskTeacher | None = None):
        self.data, self.train_examples, self.test_examples = data, train, test
        self.tokenizer, self.run, self.model_dir, self.teacher = tokenizer, settings, model_dir, teacher
        self.evaluation: dict | None = None

    def batches(self, epoch: int) -> Sequence[dict[str, torch.Tensor]]:
        return _EpochBatches(self.tokenizer, self.epoch_examples(epoch), self.data.kind, self.run.batch_size,
                             self.run.max_length, self.run.seed, epoch)

    def epoch_examples(self, epoch: int) -> list[Example]:
        """The training examples of ``epoch``: always the same ones, or with --resample-pairs those of
        ``pair_task(seed + epoch)`` (the same anchor sentences and training documents, new partners and labels; the
        held-out pairs stay those of the run's seed). So runs of neighbouring seeds share some epochs' pairs (seed
        0's epoch 1 is seed 1's epoch 0): training draws, never held-out ones."""
        if not self.run.resample_pairs or epoch == 0:
            return self.train_examples
        return subsample(pair_task(self.run.seed + epoch).train, self.run.train_limit, self.run.seed)

    def compute(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        wants_hidden = self.teacher is not None and self.teacher.wants_hidden_states
        out = model(**batch, output_hidden_states=True) if wants_hidden else model(**batch)
        labels = batch["labels"]
        keep = labels != IGNORE_INDEX
        accuracy = float((out.logits.argmax(-1)[keep] == labels[keep]).float().mean()) if keep.any() else 0.0
        if self.teacher is None:
            return StepOutput(out.loss, {"accuracy": accuracy}, int(batch["attention_mask"].sum()))
        loss, terms = self.teacher.loss(out, batch)
        figures = {"accuracy": accuracy, **{name: float(value.detach()) for name, value in terms.items()}}
        return StepOutput(loss, figures, int(batch["attention_mask"].sum()))

    def settings(self) -> dict:
        return {"task": self.data.name, "model": os.path.abspath(self.model_dir), "batch_size": self.run.batch_size,
                "max_length": self.run.max_length, "train_examples": len(self.train_examples),
                "train_limit": self.run.train_limit, "data_seed": self.run.seed, "optimize": self.run.optimize,
                "backend": self.run.backend, **({"resample_pairs": True} if self.run.resample_pairs else {}),
                **(self.teacher.settings() if self.teacher is not None else {})}

    def save(self, directory: Path) -> None:
        self.tokenizer.save_pretrained(directory)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        self.evaluation = evaluate(model, self.tokenizer, self.test_examples, self.data.kind, len(self.data.labels),
                                   max_length=self.run.max_length)
        return {"eval_accuracy": self.evaluation["accuracy"], "eval_macro_f1": self.evaluation["macro_f1"]}


def load_classifier(model_dir: str, data: TaskData, device: torch.device) -> torch.nn.Module:
    """transformers' sequence- or token-classification model of the checkpoint with a new head for the task's
    labels (label names in its config), in training mode on ``device``."""
    id2label = dict(enumerate(data.labels))
    model = pretrained_classifier(model_dir, data.kind, num_labels=len(data.labels), id2label=id2label,
                                  label2id={v: k for k, v in id2label.items()})
    return model.to(device).train()


def pretrained_classifier(model_dir: str, kind: str,
                          **options: Any) -> PreTrainedModel | tuple[PreTrainedModel, dict[str, Any]]:
    """transformers' sequence- or token-classification model of the checkpoint (``from_pretrained`` with
    ``options``), its loading notices silenced: the run reports a new head itself, and a teacher's missing head is
    an error (`check_head`)."""
    import transformers

    auto = (transformers.AutoModelForSequenceClassification if kind == "sequence"
            else transformers.AutoModelForTokenClassification)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return auto.from_pretrained(model_dir, attn_implementation="eager", **options)
    finally:
        transformers.logging.set_verbosity(verbosity)


def finetune(settings: FinetuneSettings, log: TextIO | None = None) -> dict:
    """Run one fine-tuning (module docstring), with a description of it and the held-out result on ``log``
    (default stderr): returns the results record, also written to ``<output_dir>/results.json``; the fine-tuned
    model and tokenizer are in ``<output_dir>/model``. Under torchrun, ranks other than 0 return {}.

    Raises ValueError for bad settings, `fastbert.common.resolve.UserError` for a checkpoint that cannot be used and
    `fastbert.training.loop.TrainingError` for an output directory that holds another run."""
    log = log or sys.stderr
    settings.check()
    check_output_dir(settings.output_dir, settings.resume)  # before a minute of loading, not after
    model_dir, config = resolve_model_option("--model", settings.model_dir)
    settings = cap_max_length(settings, config, log)
    device = resolve_device(settings.device)
    tokenizer = load_tokenizer(model_dir)
    # the teacher before the data (seconds to build): its checks need only the task's labels, the student's config
    # and tokenizer, so a teacher that cannot teach fails at once
    teacher = (build_teacher(settings, task_outline(settings.task), tokenizer, config, device)
               if settings.teacher is not None else None)
    data = build_task(settings.task, settings.seed)
    train_examples = subsample(data.train, settings.train_limit, settings.seed)
    test_examples = subsample(data.test, settings.eval_limit, settings.seed)
    steps_per_epoch = (len(train_examples) + settings.batch_size - 1) // settings.batch_size
    max_steps = settings.max_steps or max(1, round(settings.epochs * steps_per_epoch))
    log.write(f"fastbert finetune: task {data.name} ({data.description}): {len(train_examples)} train / "
              f"{len(test_examples)} held-out {'sentences' if data.kind == 'token' else 'examples'}, labels "
              f"{', '.join(data.labels)}; {max_steps} steps of {settings.batch_size}\n")
    model = build_classifier(model_dir, data, tokenizer, settings, device)
    if teacher is not None:
        log.write(f"fastbert finetune: {teacher.describe()}\n")
    path = describe_path(model, tokenizer, train_examples, data.kind, settings, device)
    task = FinetuneTask(data, train_examples, test_examples, tokenizer, settings, model_dir, teacher)
    started = time.perf_counter()
    result = training.train(model, task, settings.training_arguments(max_steps))
    elapsed = time.perf_counter() - started
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 evaluates and writes
        return {}
    if result.steps_run == 0:
        finished = finished_results(settings, result.step)
        if finished is not None:  # a resume of a complete run: say so, change nothing
            out = settings.output_dir
            log.write(f"fastbert finetune: the run in {out} is already complete (step {result.step} of {max_steps}): "
                      f"nothing to train, nothing changed; its results are in {os.path.join(out, 'results.json')}, "
                      f"its model in {os.path.join(out, 'model')}\n")
            return finished
    if task.evaluation is None:  # a run stopped after its last step, before its results: evaluate its weights
        task.evaluate(model)
    model_out = training.keep_final_model(result.checkpoint, settings.output_dir)
    results = results_record(task, result, model_out, path, steps_per_epoch, elapsed)
    if teacher is not None:
        results["teacher"] = teacher_record(task, teacher)
    write_atomic(os.path.join(settings.output_dir, "results.json"), json.dumps(results, indent=2) + "\n")
    evaluation, baseline = results["evaluation"], results["majority_baseline"]
    log.write(f"fastbert finetune: held-out accuracy {evaluation['accuracy']:.4f} (majority baseline "
              f"{baseline['accuracy']:.4f}: always '{baseline['label']}'), macro F1 {evaluation['macro_f1']:.4f}; "
              f"{steps_line(result, elapsed)}; model -> {model_out}\n")
    if teacher is not None:
        share = results["teacher"]["student_over_teacher"]
        log.write(f"fastbert finetune: the teacher's held-out accuracy {results['teacher']['accuracy']:.4f}; "
                  f"student / teacher {'n/a' if share is None else f'{share:.1%}'}\n")
    return results


# Options a resume may change that decide what results.json reports (not what trains): a complete run's resume
# with other values evaluates again.
_EVALUATION_OPTIONS = ("eval_limit", "max_length", "teacher", "alpha_soft", "temperature", "alpha_hidden")


def finished_results(settings: FinetuneSettings, step: int) -> dict | None:
    """The results.json of a run that finished at ``step`` (with its model beside it) and was evaluated as these
    settings ask, None when the run stopped between its last checkpoint and its results, or the file is not that
    run's, or its evaluation options differ (`_EVALUATION_OPTIONS`)."""
    output_dir = settings.output_dir
    try:
        with open(os.path.join(output_dir, "results.json"), encoding="utf-8") as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict) or results.get("training", {}).get("steps") != step:
        return None
    recorded = results.get("settings", {})
    if any(recorded.get(option) != getattr(settings, option) for option in _EVALUATION_OPTIONS):
        return None
    return results if os.path.isdir(os.path.join(output_dir, "model")) else None


def steps_line(result: training.TrainResult, elapsed: float) -> str:
    """'40 steps in 12.3 s', or for a resume '10 steps in 3.1 s (steps 31-40; 40 in all)'."""
    if result.steps_run == result.step:
        return f"{result.step} steps in {elapsed:.1f} s"
    if result.steps_run == 0:
        return f"no step left to train ({result.step} in all)"
    first = result.step - result.steps_run + 1
    return f"{result.steps_run} steps in {elapsed:.1f} s (steps {first}-{result.step}; {result.step} in all)"


def build_teacher(settings: FinetuneSettings, data: TaskData, tokenizer: PreTrainedTokenizerBase,
                  student_config: FastBertConfig, device: torch.device) -> TaskTeacher:
    """The run's checked teacher (`fastbert.training.task_distillation`) with its trained head, frozen on
    ``device``, optimized like the student. Of ``data`` it reads only the name, kind and labels (`task_outline`
    gives them before the examples are built)."""
    import fastbert

    assert settings.teacher is not None
    weights = settings.teacher_loss()
    directory, config = resolve_teacher(settings.teacher)
    try:
        teacher_tokenizer = load_tokenizer(directory)
    except UserError as err:
        raise UserError(f"--teacher: {err}") from err
    max_length = settings.max_length or DEFAULT_MAX_LENGTH  # (None before `cap_max_length`)
    check_teacher(directory, config, data.labels, data.name, student_config, max_length, weights,
                  (teacher_tokenizer, tokenizer))
    try:
        model, info = pretrained_classifier(directory, data.kind, output_loading_info=True)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"--teacher {directory}: cannot load it as a {data.kind} classifier "
                        f"({str(err).splitlines()[0]})") from err
    check_head(directory, info.get("missing_keys", []))
    model = freeze(model, device)
    if settings.optimize:
        model = fastbert.optimize(model, backend=settings.backend)
    return TaskTeacher(model, directory, weights, student_config.num_hidden_layers)


def teacher_record(task: FinetuneTask, teacher: TaskTeacher) -> dict:
    """The teacher's held-out figures on the same examples, and the student's accuracy as a share of its."""
    assert task.evaluation is not None
    figures = evaluate(teacher.model, task.tokenizer, task.test_examples, task.data.kind, len(task.data.labels),
                       max_length=task.run.max_length)
    share = task.evaluation["accuracy"] / figures["accuracy"] if figures["accuracy"] else None
    return {**teacher.settings(), "accuracy": figures["accuracy"], "macro_f1": figures["macro_f1"],
            "student_over_teacher": share}


def cap_max_length(settings: FinetuneSettings, config: FastBertConfig, log: TextIO) -> FinetuneSettings:
    """The settings with max_length set: the one asked for, which must fit the model's positions (UserError), or
    the default cut to them (a small pretrained model may have fewer), saying so on ``log`` when it cuts."""
    positions = config.token_positions
    if settings.max_length is not None:
        if settings.max_length > positions:
            raise UserError(f"--max-length must lie in [8, {positions}] for this model, got {settings.max_length}")
        return settings
    if DEFAULT_MAX_LENGTH <= positions:
        return replace(settings, max_length=DEFAULT_MAX_LENGTH)
    log.write(f"fastbert finetune: --max-length {DEFAULT_MAX_LENGTH} (the default) capped to the model's {positions} "
              "positions\n")
    return replace(settings, max_length=positions)


def load_tokenizer(model_dir: str) -> PreTrainedTokenizerFast:
    """The checkpoint's fast tokenizer; UserError when there is none."""
    tokenizer = load_auto_tokenizer(model_dir)
    if not tokenizer.is_fast:
        raise UserError(f"{model_dir}: the token task needs a fast tokenizer (tokenizer.json)")
    return tokenizer


def build_classifier(model_dir: str, data: TaskData, tokenizer: PreTrainedTokenizerBase, settings: FinetuneSettings,
                     device: torch.device) -> torch.nn.Module:
    """`load_classifier` with the head initialised from the seed, checked against the tokenizer, and passed
    through `fastbert.optimize` unless the settings say not to."""
    import fastbert

    torch.manual_seed(settings.seed)  # the new head's initialisation
    try:
        model = load_classifier(model_dir, data, device)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{model_dir}: cannot build a {data.kind}-classification model "
                        f"({str(err).splitlines()[0]})") from err
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(f"{model_dir}: the tokenizer has {len(tokenizer)} tokens, the model's embedding table only "
                        f"{model.get_input_embeddings().num_embeddings}")
    return fastbert.optimize(model, backend=settings.backend) if settings.optimize else model


def describe_path(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], kind: str,
                  settings: FinetuneSettings, device: torch.device) -> str:
    """`fastbert.explain` of the model on a sample batch: which of its calls run fastbert's code."""
    if not settings.optimize:
        return "not optimized (--no-optimize)"
    import fastbert

    sample = encode_batch(tokenizer, examples[:2], kind, settings.max_length)
    return fastbert.explain(model, **{k: v.to(device) for k, v in sample.items()})


def results_record(task: FinetuneTask, result: training.TrainResult, model_out: str, path: str,
                   steps_per_epoch: int, elapsed: float) -> dict:
    """What results.json holds: the task, the splits, the held-out evaluation against the majority baseline, the
    training's figures, the settings and the versions."""
    import transformers

    import fastbert

    data, train_examples, test_examples = task.data, task.train_examples, task.test_examples
    assert task.evaluation is not None
    baseline = majority_baseline(data, test_examples, train_examples)  # what was trained on, and evaluated
    steps, evals = curves.split_records(result.records)
    before = [r for r in evals if r["step"] == 0]
    return {
        "task": data.name, "description": data.description, "kind": data.kind, "labels": list(data.labels),
        "model": task.model_dir, "model_out": model_out, "python": sys.version.split()[0],
        "train": {"examples": len(train_examples), "available": len(data.train),
                  "label_counts": count_labels(data.labels, train_examples)},
        "held_out": {"examples": len(test_examples), "available": len(data.test),
                     "label_counts": count_labels(data.labels, test_examples)},
        "majority_baseline": baseline, "evaluation": task.evaluation,
        "accuracy_before_training": before[0]["eval_accuracy"] if before else None,
        "accuracy_over_baseline": task.evaluation["accuracy"] - baseline["accuracy"],
        "training": {"steps": result.step, "epochs": result.step / steps_per_epoch,
                     "first_loss": steps[0]["loss"] if steps else None,
                     "last_losses_mean": (sum(r["loss"] for r in steps[-10:]) / len(steps[-10:])) if steps else None,
                     "tokens": sum(r["tokens"] for r in steps), "seconds_this_run": round(elapsed, 2),
                     "seconds_total": steps[-1]["elapsed_s"] if steps else None},
        "settings": asdict(task.run), "path": path,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "fastbert": fastbert.__version__},
        "threads": torch.get_num_threads(),
    }


def count_labels(labels: Sequence[str], examples: Sequence[Example]) -> dict[str, int]:
    """How many examples (sequence tasks) or words (token task) carry each label, by label name."""
    counts: Counter[int] = Counter()
    for example in examples:
        counts.update(example.label if isinstance(example.label, tuple) else (example.label,))
    return {name: counts.get(index, 0) for index, name in enumerate(labels)}
