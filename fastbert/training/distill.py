"""Distillation (``fastbert distill``): train a smaller student from a teacher checkpoint, offline, on the same loop,
checkpoints, exact resume, progress line, metrics.jsonl and loss curve as `fastbert.training.pretrain`.

Two objectives (``--objective``):

- ``mlm``: DistilBERT as its paper describes it (Sanh, Debut, Chaumond, Wolf, "DistilBERT, a distilled version of
  BERT: smaller, faster, cheaper and lighter", arXiv:1910.01108, 2019, sections 2 and 3). The teacher is a
  masked-LM checkpoint (BERT or RoBERTa ``ForMaskedLM`` / ``ForPreTraining``, e.g. one ``fastbert pretrain``
  wrote). The student is a ``DistilBertForMaskedLM``: the teacher's width, no token-type embeddings, no pooler,
  half the teacher's layers by default, initialised from the teacher ("taking one layer out of two"): embeddings,
  the chosen layers (`student_layer_indices`) and the MLM head. Training is masked LM only (15 %, 80/10/10, a new
  mask every batch: dynamic masking), no next-sentence prediction, on single sentences of the corpus (or
  ``--pack``ed runs of them), and the loss is the paper's triple loss (`triple_loss`):
  ``alpha_ce * L_ce + alpha_mlm * L_mlm + alpha_cos * L_cos``, L_ce the KL divergence between the teacher's and
  the student's output distributions softened by a temperature, L_mlm the masked-LM cross-entropy, L_cos one
  minus the cosine of the student's and the teacher's last hidden states. Defaults: the values of the authors'
  training command for DistilBERT (`DISTILBERT_LOSS`).
- ``embedding``: distillation of a sentence-transformers model to a shallower one, as practitioners do to serve
  embeddings cheaper. The teacher is a sentence-transformers checkpoint (default the embedded all-MiniLM-L6-v2);
  the student is the same architecture with N of its layers (copied, the rest of the weights too); the loss is
  the mean squared error between the student's and the teacher's sentence embeddings (pooled as the checkpoint's
  ``1_Pooling`` says, normalised when it has a Normalize module), optionally plus ``alpha_cos`` times one minus
  their cosine, over the corpus's sentences. The student is saved with the teacher's sentence-transformers files,
  so ``SentenceTransformer(dir)`` and ``fastbert embed --model dir`` load it.

Both run the teacher's forward (no grad, eval mode) and the student's training through `fastbert.optimize`. The
corpus is the one of ``fastbert pretrain`` (CPython's documentation, or text files); whole documents are held out
for evaluation: held-out masked-LM loss and accuracy of the student (and, once, of the teacher) with fixed masks,
or the mean cosine between student and teacher embeddings of the held-out sentences. The output directory gets
checkpoints (``checkpoint-N``: the student in HF format with the tokenizer), metrics.jsonl, loss_curve.png,
summary.json and, at the end, ``model/``: the final student without the trainer state.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
import torch.nn.functional as F

from fastbert import families
from fastbert.common.resolve import UserError, default_model_dir
from fastbert.common.text import load_auto_tokenizer, mean_pool
from fastbert.files import write_atomic
from fastbert.training import curves
from fastbert.training.corpus import run_documents
from fastbert.training.loop import StepOutput, TrainingArguments, TrainingTask, TrainResult, keep_final_model, train
from fastbert.training.masking import IGNORE_INDEX
from fastbert.training.pretrain import (
    DataOptions,
    PretrainingData,
    continuation_table,
    corpus_fingerprint,
    hold_out,
    tokenize_documents,
    vocab_fingerprint,
)
from fastbert.training.settings import RunSettings, check_number, run_model_hint

if TYPE_CHECKING:  # transformers is optional and imported where a model, config or tokenizer is built
    from transformers import DistilBertConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

OBJECTIVES = ("mlm", "embedding")
MLM_TEACHER_TYPES = ("bert", "roberta")
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class LossWeights:
    """The weights of the distillation loss's terms and the softmax temperature of its soft targets."""

    temperature: float = 2.0
    alpha_ce: float = 5.0
    alpha_mlm: float = 2.0
    alpha_cos: float = 1.0
    alpha_mse: float = 0.0
    alpha_hidden: float = 0.0
    alpha_layers: float = 0.0


# DistilBERT's triple loss as its authors trained it: temperature 2.0 (the default of their train.py), alpha_ce 5.0,
# alpha_mlm 2.0, alpha_cos 1.0 (the command in the README of transformers' examples/research_projects/distillation,
# the code released with arXiv:1910.01108). The paper (section 3) describes the terms, not their weights.
DISTILBERT_LOSS = LossWeights(temperature=2.0, alpha_ce=5.0, alpha_mlm=2.0, alpha_cos=1.0, alpha_mse=0.0)
# Sentence-embedding distillation: MSE between the embeddings (Reimers & Gurevych, "Making Monolingual Sentence
# Embeddings Multilingual using Knowledge Distillation", EMNLP 2020, train a student on exactly this loss).
EMBEDDING_LOSS = LossWeights(temperature=1.0, alpha_ce=0.0, alpha_mlm=0.0, alpha_cos=0.0, alpha_mse=1.0)
# The teacher modules whose weights a DistilBERT layer takes, by their names in BERT / RoBERTa -> DistilBERT.
DISTILBERT_LAYER_NAMES = (("attention.self.query", "attention.q_lin"), ("attention.self.key", "attention.k_lin"),
                          ("attention.self.value", "attention.v_lin"), ("attention.output.dense", "attention.out_lin"),
                          ("attention.output.LayerNorm", "sa_layer_norm"), ("intermediate.dense", "ffn.lin1"),
                          ("output.dense", "ffn.lin2"), ("output.LayerNorm", "output_layer_norm"))
_LAYER_KEY = re.compile(r"(^|\.)layer\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------- losses
def at_least_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or as it is when wider: the losses reduce over the vocabulary in fp32 at least, and a
    float64 check of the formula stays in float64."""
    return tensor if tensor.dtype == torch.float64 else tensor.float()


def triple_loss(student_logits: torch.Tensor, student_hidden: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor, weights: LossWeights, teacher_logits: torch.Tensor | None = None,
                teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DistilBERT's loss of one batch: (weighted total, {"ce_loss", "mlm_loss", "cos_loss"} unweighted).

    - ce: `soft_target_loss` over the real (non-padding) tokens.
    - mlm: cross-entropy of the student's logits at the masked positions (``labels != -100``).
    - cos: mean over the real tokens of ``1 - cos(student hidden, teacher hidden)`` (the last layer's states).
    A term whose weight is 0 is not computed (the teacher's outputs may then be None)."""
    real = attention_mask.bool()
    zero = student_logits.sum() * 0.0  # a zero that still belongs to the graph
    terms: dict[str, torch.Tensor] = {}
    if weights.alpha_ce:
        terms["ce_loss"] = soft_target_loss(student_logits[real], teacher_logits[real], weights.temperature)
    if weights.alpha_mlm:
        masked = labels != IGNORE_INDEX
        terms["mlm_loss"] = (F.cross_entropy(at_least_fp32(student_logits[masked]), labels[masked]) if masked.any()
                             else zero)
    if weights.alpha_cos:
        terms["cos_loss"] = hidden_cosine_loss(student_hidden, teacher_hidden, attention_mask)
    alphas = {"ce_loss": weights.alpha_ce, "mlm_loss": weights.alpha_mlm, "cos_loss": weights.alpha_cos}
    total = sum((alphas[name] * value for name, value in terms.items()), zero)
    return total, terms


def soft_target_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher / T) || softmax(student / T))`` averaged over the rows (the last dimension holds
    the classes); T^2 keeps its gradients' scale independent of T (Hinton, Vinyals, Dean 2015, section 2)."""
    log_student = F.log_softmax(at_least_fp32(student_logits) / temperature, dim=-1)
    soft_targets = F.softmax(at_least_fp32(teacher_logits) / temperature, dim=-1)
    return F.kl_div(log_student, soft_targets, reduction="batchmean") * temperature ** 2


def hidden_cosine_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor, attention_mask: torch.Tensor
                       ) -> torch.Tensor:
    """Mean over the real (non-padding) tokens of ``1 - cos(student hidden state, teacher hidden state)``."""
    real = attention_mask.bool()
    cosine = F.cosine_similarity(at_least_fp32(student_hidden[real]), at_least_fp32(teacher_hidden[real]), dim=-1)
    return (1.0 - cosine).mean()


def layer_cosine_loss(student_states: Sequence[torch.Tensor], teacher_states: Sequence[torch.Tensor],
                      attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean over the paired layers of `hidden_cosine_loss`: ``student_states[j]`` (the output of student layer j)
    against ``teacher_states[j]`` (the output of the teacher layer it was copied from). TinyBERT's hidden-state
    loss (Jiao et al., "TinyBERT: Distilling BERT for Natural Language Understanding", Findings of EMNLP 2020,
    section 3.1) with a cosine in place of its MSE, as DistilBERT's cosine term: every student layer gets a target,
    not only the last one."""
    if len(student_states) != len(teacher_states) or not student_states:
        raise ValueError(f"{len(student_states)} student layers against {len(teacher_states)} teacher layers")
    losses = [hidden_cosine_loss(s, t, attention_mask) for s, t in zip(student_states, teacher_states, strict=True)]
    return torch.stack(losses).mean()


def embedding_loss(student: torch.Tensor, teacher: torch.Tensor, weights: LossWeights,
                   hidden: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                   layers: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sentence-embedding distillation loss of one batch [B, H]: ``alpha_mse * MSE + alpha_cos * (1 - cos)`` of the
    embeddings, plus ``alpha_hidden`` times `hidden_cosine_loss` of ``hidden`` = (student's last hidden states,
    teacher's, attention mask), every token's, [CLS] included: what a classifier's pooler reads, which mean pooling
    alone does not pin down; plus ``alpha_layers`` times `layer_cosine_loss` of ``layers`` = (the student's
    intermediate layer outputs, the teacher's paired ones) under the same mask. Returns (total, {"mse_loss",
    "cos_loss", "hidden_loss", "layers_loss"} unweighted, each only when its weight is not 0)."""
    terms: dict[str, torch.Tensor] = {}
    if weights.alpha_mse:
        terms["mse_loss"] = F.mse_loss(at_least_fp32(student), at_least_fp32(teacher))
    if weights.alpha_cos:
        cosine = F.cosine_similarity(at_least_fp32(student), at_least_fp32(teacher), dim=-1)
        terms["cos_loss"] = (1.0 - cosine).mean()
    if weights.alpha_hidden:
        if hidden is None:
            raise ValueError("alpha_hidden needs the hidden states")
        terms["hidden_loss"] = hidden_cosine_loss(*hidden)
    if weights.alpha_layers:
        if hidden is None or layers is None:
            raise ValueError("alpha_layers needs the intermediate hidden states and the attention mask")
        terms["layers_loss"] = layer_cosine_loss(*layers, hidden[2])
    alphas = {"mse_loss": weights.alpha_mse, "cos_loss": weights.alpha_cos, "hidden_loss": weights.alpha_hidden,
              "layers_loss": weights.alpha_layers}
    total = sum((alphas[name] * value for name, value in terms.items()), student.sum() * 0.0)
    return total, terms


# ----------------------------------------------------------------------------------------------- the student
def student_layer_indices(teacher_layers: int, student_layers: int | None = None,
                          chosen: Sequence[int] | None = None) -> list[int]:
    """The teacher layers the student's layers start from. ``chosen``: those (checked); else ``student_layers``
    (default half the teacher's, at least 1) spread over the teacher's depth, first and last included:
    ``round(i * (L - 1) / (N - 1))``, which for 12 -> 6 gives DistilBERT's own choice, 0 2 4 7 9 11 (one layer
    out of two). UserError for a student deeper than its teacher or indices outside it."""
    if chosen is not None:
        indices = list(chosen)
        if not indices or any(not 0 <= i < teacher_layers for i in indices):
            raise UserError(f"--teacher-layers {','.join(map(str, indices))}: the teacher has layers 0 to "
                            f"{teacher_layers - 1}")
        if student_layers is not None and student_layers != len(indices):
            raise UserError(f"--student-layers {student_layers} but --teacher-layers names {len(indices)} layers")
        if indices != sorted(set(indices)):
            raise UserError("--teacher-layers must be increasing, each layer once")
        return indices
    count = student_layers if student_layers is not None else max(1, teacher_layers // 2)
    if count < 1:
        raise UserError(f"--student-layers must be >= 1, got {count}")
    if count > teacher_layers:
        raise UserError(f"--student-layers {count}: a student cannot be deeper than its teacher "
                        f"({teacher_layers} layers)")
    if count == 1:
        return [teacher_layers - 1]
    return [int(math.floor(i * (teacher_layers - 1) / (count - 1) + 0.5)) for i in range(count)]


def distilbert_config(teacher_config: PretrainedConfig, layers: int) -> DistilBertConfig:
    """The DistilBertConfig of a student of a BERT/RoBERTa teacher: the teacher's width, heads, FFN, activation,
    dropout and vocabulary, ``layers`` layers, positions numbered from 0 (RoBERTa's offset past the padding id
    removed), no token types, no pooler."""
    from transformers import DistilBertConfig

    offset = position_offset(teacher_config)
    return DistilBertConfig(
        vocab_size=teacher_config.vocab_size, dim=teacher_config.hidden_size, n_layers=layers,
        n_heads=teacher_config.num_attention_heads, hidden_dim=teacher_config.intermediate_size,
        max_position_embeddings=teacher_config.max_position_embeddings - offset,
        activation=teacher_config.hidden_act, dropout=teacher_config.hidden_dropout_prob,
        attention_dropout=teacher_config.attention_probs_dropout_prob,
        initializer_range=teacher_config.initializer_range, pad_token_id=teacher_config.pad_token_id,
        sinusoidal_pos_embds=False, tie_word_embeddings=True)


def position_offset(config: PretrainedConfig) -> int:
    """Where a model's position ids start: the RoBERTa-style families (RoBERTa, XLM-R, CamemBERT) number them from
    pad_token_id + 1, BERT from 0 (the families' own rule, `fastbert.families.Family.offset_positions`)."""
    return config.pad_token_id + 1 if families.get(config.model_type).offset_positions else 0


def build_mlm_student(teacher: torch.nn.Module, indices: list[int], from_teacher: bool = True) -> torch.nn.Module:
    """A ``DistilBertForMaskedLM`` of ``len(indices)`` layers for a BERT/RoBERTa masked-LM teacher, initialised from
    it (`copy_teacher_into_distilbert`) or, with ``from_teacher=False``, at random (from torch's seed)."""
    from transformers import DistilBertForMaskedLM

    student = DistilBertForMaskedLM(distilbert_config(teacher.config, len(indices)))
    if from_teacher:
        copy_teacher_into_distilbert(teacher, student, indices)
    return student


@torch.no_grad()
def copy_teacher_into_distilbert(teacher: torch.nn.Module, student: torch.nn.Module, indices: list[int]) -> None:
    """Copy a BERT/RoBERTa masked-LM teacher into a DistilBERT student: word embeddings, position embeddings
    (past RoBERTa's offset) with the teacher's token-type-0 embedding added to them (the student has no token
    types; every single-segment input adds that vector, so the student's embeddings equal the teacher's), the
    embedding LayerNorm, teacher layer ``indices[j]`` into student layer j, and the MLM head (transform, LayerNorm,
    output bias; the output weights are tied to the word embeddings in both)."""
    base, embeddings = teacher.base_model, teacher.base_model.embeddings
    target = student.distilbert.embeddings
    target.word_embeddings.weight.copy_(embeddings.word_embeddings.weight)
    offset = position_offset(teacher.config)
    positions = embeddings.position_embeddings.weight[offset:offset + target.position_embeddings.num_embeddings]
    token_type = getattr(embeddings, "token_type_embeddings", None)
    target.position_embeddings.weight.copy_(positions + (token_type.weight[0] if token_type is not None else 0))
    target.LayerNorm.load_state_dict(embeddings.LayerNorm.state_dict())
    for student_index, teacher_index in enumerate(indices):
        source, destination = base.encoder.layer[teacher_index], student.distilbert.transformer.layer[student_index]
        for theirs, ours in DISTILBERT_LAYER_NAMES:
            destination.get_submodule(ours).load_state_dict(source.get_submodule(theirs).state_dict())
    head = teacher.lm_head if hasattr(teacher, "lm_head") else teacher.cls.predictions
    transform, norm = (head.dense, head.layer_norm) if hasattr(teacher, "lm_head") else \
        (head.transform.dense, head.transform.LayerNorm)
    student.vocab_transform.load_state_dict(transform.state_dict())
    student.vocab_layer_norm.load_state_dict(norm.state_dict())
    student.vocab_projector.bias.copy_(teacher.get_output_embeddings().bias)


def build_layer_student(teacher: torch.nn.Module, indices: list[int], from_teacher: bool = True) -> torch.nn.Module:
    """The teacher's own architecture with ``len(indices)`` layers: teacher layer ``indices[j]`` becomes layer j,
    every other weight (embeddings, pooler) copied as it is; or, with ``from_teacher=False``, initialised at
    random. For the models whose layers are ``...layer.<n>.`` in their state_dict (BERT, RoBERTa, DistilBERT,
    ELECTRA...)."""
    config = copy.deepcopy(teacher.config)
    for name in ("num_hidden_layers", "n_layers"):
        if hasattr(config, name):
            setattr(config, name, len(indices))
    student = type(teacher)(config)
    if from_teacher:
        student.load_state_dict(layer_subset_state_dict(teacher.state_dict(), indices), strict=True)
    return student


def layer_subset_state_dict(state: dict[str, torch.Tensor], indices: list[int]) -> dict[str, torch.Tensor]:
    """A teacher state_dict renumbered for a student: ``layer.<indices[j]>.`` becomes ``layer.<j>.``, the other
    layers dropped, every other key kept. UserError when no key names a layer."""
    renumber = {teacher: student for student, teacher in enumerate(indices)}
    out, found = {}, False
    for key, tensor in state.items():
        match = _LAYER_KEY.search(key)
        if match is None:
            out[key] = tensor.clone()
            continue
        found = True
        layer = int(match.group(2))
        if layer in renumber:
            start, end = match.span(2)
            out[key[:start] + str(renumber[layer]) + key[end:]] = tensor.clone()
    if not found:
        raise UserError("the teacher's weights have no 'layer.<n>.' keys; fastbert distill keeps layers of BERT-like "
                        "models (bert, roberta, distilbert, electra)")
    return out


# ---------------------------------------------------------------------------------------------- the teacher
def read_json_file(path: Path) -> Any:
    """A JSON file's value; UserError naming the file when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not readable JSON ({err})") from err


def teacher_config_fields(teacher_dir: str) -> dict[str, Any]:
    """The teacher's config.json fields; UserError for a directory without one."""
    directory = Path(teacher_dir)
    if not directory.is_dir():
        raise UserError(f"--teacher {teacher_dir} is not a directory")
    if not (directory / "config.json").is_file():
        raise UserError(f"--teacher {teacher_dir} has no config.json (expected an HF checkpoint directory)"
                        f"{run_model_hint(teacher_dir)}")
    return read_json_file(directory / "config.json")


def check_mlm_teacher(teacher_dir: str) -> None:
    """UserError unless the directory holds a BERT/RoBERTa checkpoint with a masked-LM head (by its config)."""
    fields = teacher_config_fields(teacher_dir)
    model_type = fields.get("model_type")
    if model_type not in MLM_TEACHER_TYPES:
        raise UserError(f"--teacher {teacher_dir} is a {model_type!r} model; the mlm objective distils a "
                        f"{' or '.join(MLM_TEACHER_TYPES)} masked-LM teacher")
    architectures = fields.get("architectures") or []
    if not any(a.endswith(("ForMaskedLM", "ForPreTraining")) for a in architectures):
        raise UserError(f"--teacher {teacher_dir} has no masked-LM head (architectures: "
                        f"{', '.join(architectures) or 'none'}); the mlm objective needs a ...ForMaskedLM or "
                        "...ForPreTraining checkpoint (e.g. one `fastbert pretrain` wrote)")


def teacher_config(teacher_dir: str) -> PretrainedConfig:
    """The teacher's transformers config; UserError when transformers cannot read it."""
    import transformers

    teacher_config_fields(teacher_dir)
    try:
        return transformers.AutoConfig.from_pretrained(teacher_dir)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"--teacher {teacher_dir}: cannot read its config ({str(err).splitlines()[0]})") from err


def load_mlm_teacher(teacher_dir: str, device: torch.device) -> torch.nn.Module:
    """A BERT/RoBERTa masked-LM teacher (`check_mlm_teacher` first) in eval mode without gradients; UserError for
    weights that lack the masked-LM head or do not fit the config."""
    import transformers

    check_mlm_teacher(teacher_dir)
    try:
        model, info = transformers.AutoModelForMaskedLM.from_pretrained(teacher_dir, output_loading_info=True,
                                                                        attn_implementation="eager")
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"--teacher {teacher_dir}: cannot load the model ({str(err).splitlines()[0]})") from err
    missing = [k for k in info["missing_keys"] if "position_ids" not in k]
    if missing:
        raise UserError(f"--teacher {teacher_dir}: its weights lack {', '.join(missing[:3])}"
                        f"{' ...' if len(missing) > 3 else ''}; the mlm objective needs a trained masked-LM head")
    return freeze(model, device)


def sentence_transformer_modules(teacher_dir: str) -> tuple[str, bool, list[dict[str, Any]]]:
    """(pooling mode "mean" or "cls", normalised, the modules.json entries) of a sentence-transformers checkpoint;
    UserError for a directory that is not one, or pools in another way."""
    directory = Path(teacher_dir)
    if not (directory / "modules.json").is_file():
        raise UserError(f"--teacher {teacher_dir} is not a sentence-transformers checkpoint (no modules.json); the "
                        "embedding objective distils one (e.g. the embedded all-MiniLM-L6-v2)"
                        f"{run_model_hint(teacher_dir, 'modules.json')}")
    modules = read_json_file(directory / "modules.json")
    pooling = [m for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    if not pooling:
        raise UserError(f"--teacher {teacher_dir}: modules.json declares no Pooling module")
    pooling_config = read_json_file(directory / pooling[0]["path"] / "config.json")
    chosen = [k for k, v in pooling_config.items() if k.startswith("pooling_mode_") and v is True]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise UserError(f"--teacher {teacher_dir}: fastbert distill pools mean or cls, the checkpoint's Pooling "
                        f"module uses {', '.join(chosen) or 'none'}")
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    return POOLING_MODES[chosen[0]], normalize, modules


def load_embedding_teacher(teacher_dir: str, device: torch.device) -> torch.nn.Module:
    """The transformer of a sentence-transformers teacher (``AutoModel``), in eval mode without gradients."""
    import transformers

    teacher_config_fields(teacher_dir)
    try:
        model = transformers.AutoModel.from_pretrained(teacher_dir, attn_implementation="eager")
    except (OSError, ValueError, RuntimeError) as err:
        raise UserError(f"--teacher {teacher_dir}: cannot load the model ({str(err).splitlines()[0]})") from err
    return freeze(model, device)


def freeze(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on ``device``, in eval mode, its parameters without gradients."""
    model.to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


def load_teacher_tokenizer(teacher_dir: str, config: PretrainedConfig, objective: str) -> PreTrainedTokenizerBase:
    """The teacher's tokenizer, which must fit its model: no more tokens than the embedding table, the same padding
    id, and for mlm a mask token. UserError otherwise."""
    tokenizer = load_auto_tokenizer(teacher_dir, label=f"--teacher {teacher_dir}")
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"--teacher {teacher_dir}: tokenizer/model mismatch: the tokenizer has {len(tokenizer)} "
                        f"tokens, the model's embedding table {config.vocab_size}")
    if config.pad_token_id is not None and tokenizer.pad_token_id != config.pad_token_id:
        raise UserError(f"--teacher {teacher_dir}: tokenizer/model mismatch: the tokenizer pads with id "
                        f"{tokenizer.pad_token_id}, the model's config says {config.pad_token_id}")
    needed = ("mask_token", "cls_token", "sep_token") if objective == "mlm" else ()
    missing = [name for name in needed if getattr(tokenizer, name) is None]
    if missing:
        raise UserError(f"--teacher {teacher_dir}: its tokenizer has no {', '.join(missing)}; masked-LM "
                        "distillation needs them")
    return tokenizer


# ------------------------------------------------------------------------------------------------------ data
def sentence_pairs(documents: Sequence[Sequence[str]]) -> list[tuple[int, str, str]]:
    """(document index, sentence, the next sentence of the same document) for every consecutive pair."""
    return [(index, first, second) for index, doc in enumerate(documents)
            for first, second in itertools.pairwise(doc)]


class SentenceBatches(Sequence):
    """An epoch's batches for the embedding objective: the training sentences shuffled from (seed, epoch), tokenised
    on access (padded to the batch's longest, cut at ``max_length``); the last incomplete batch is dropped unless it
    is the only one. With ``pairs`` > 0 that share of each batch (rounded) is sentence pairs as a pair classifier
    reads them (two segments, token types 0 and 1): a sentence and the next one of its document, or, half of the
    time, a sentence of another document, drawn from (seed, epoch, batch index); the rest single sentences."""

    def __init__(self, sentences: list[str], tokenizer: PreTrainedTokenizerBase, batch_size: int, max_length: int,
                 seed: int, epoch: int, token_types: bool, pairs: float = 0.0,
                 pair_sources: Sequence[tuple[int, str, str]] = ()):
        self.tokenizer, self.batch_size, self.max_length, self.token_types = tokenizer, batch_size, max_length, \
            token_types
        self.seed, self.epoch, self.sentences, self.pair_sources = seed, epoch, list(sentences), list(pair_sources)
        random.Random(f"distill/{seed}/{epoch}").shuffle(self.sentences)
        random.Random(f"distill-pairs/{seed}/{epoch}").shuffle(self.pair_sources)
        self.pair_count = round(pairs * batch_size) if self.pair_sources else 0
        singles = batch_size - self.pair_count
        units = len(self.sentences) // singles if singles else len(self.pair_sources) // batch_size
        self.count = max(units, 1 if self.sentences or self.pair_sources else 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if not 0 <= index < self.count:
            raise IndexError(index)
        singles = self.batch_size - self.pair_count
        chunk = self.sentences[index * singles:(index + 1) * singles]
        rng = random.Random(f"distill-partners/{self.seed}/{self.epoch}/{index}")
        pairs = []
        for k in range(index * self.pair_count, (index + 1) * self.pair_count):
            document, first, second = self.pair_sources[k % len(self.pair_sources)]
            if rng.random() < 0.5:
                other = self.pair_sources[rng.randrange(len(self.pair_sources))]
                second = other[2] if other[0] != document else second  # same document: keep the true next one
            pairs.append((first, second))
        return encode_sentences(self.tokenizer, chunk, self.max_length, self.token_types, pairs)


def encode_sentences(tokenizer: PreTrainedTokenizerBase, sentences: Sequence[str], max_length: int, token_types: bool,
                     pairs: Sequence[tuple[str, str]] = ()) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask (and token_type_ids when the model has token types) of a batch: the single
    sentences, then the pairs (segments A and B, token types 0 and 1), all padded to the longest."""
    parts = []
    if sentences:
        parts.append(tokenizer(list(sentences), truncation=True, max_length=max_length))
    if pairs:
        parts.append(tokenizer([a for a, _ in pairs], [b for _, b in pairs], truncation=True, max_length=max_length))
    rows = [(ids, part.get("token_type_ids", [[0] * len(x) for x in part["input_ids"]])[i])
            for part in parts for i, ids in enumerate(part["input_ids"])]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    batch = {"input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows]),
             "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])}
    if token_types:
        batch["token_type_ids"] = torch.tensor([types + [0] * (width - len(types)) for _, types in rows])
    return batch


# ----------------------------------------------------------------------------------------------------- tasks
class DistillationTask(TrainingTask):
    """What both objectives share: the teacher, the tokenizer and the files saved beside each checkpoint, the run's
    settings, the loss curve and summary at each checkpoint."""

    objective = ""

    def __init__(self, teacher: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, weights: LossWeights,
                 settings: dict[str, Any], extra_files: Path | None = None,
                 modules: list[dict[str, Any]] | None = None):
        self.teacher, self.tokenizer, self.weights, self._settings = teacher, tokenizer, weights, settings
        self.extra_files, self.modules = extra_files, modules or []
        self.teacher_figures: dict[str, float] | None = None

    def settings(self) -> dict[str, Any]:
        """Teacher, student layers, loss weights, data, corpus and vocabulary: what a resume must match."""
        return self._settings

    def save(self, directory: Path) -> None:
        """The tokenizer, and for a sentence-transformers teacher its module files (pooling, normalisation)."""
        self.tokenizer.save_pretrained(directory)
        if self.extra_files is None:
            return
        for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
            if (self.extra_files / name).is_file():
                shutil.copyfile(self.extra_files / name, directory / name)
        for module in self.modules:
            source = self.extra_files / module.get("path", "")
            if module.get("path") and source.is_dir():
                shutil.copytree(source, directory / module["path"])

    def on_checkpoint(self, output_dir: Path, records: list[dict[str, Any]], final: bool) -> None:
        """Redraw loss_curve.png (and write summary.json at the end)."""
        plot_distillation_curve(records, output_dir / "loss_curve.png", self.objective)
        if final:
            write_atomic(output_dir / "summary.json",
                         (json.dumps(summarize(records, self.teacher_figures), indent=2) + "\n").encode())


class MlmDistillationTask(DistillationTask):
    """DistilBERT's distillation: masked-LM batches (`fastbert.training.pretrain.PretrainingData`, MLM only, dynamic
    masks), the triple loss against the teacher, held-out masked-LM loss and accuracy with fixed masks."""

    objective = "mlm"

    def __init__(self, teacher: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, weights: LossWeights,
                 settings: dict[str, Any], data: PretrainingData, held_out: PretrainingData | None,
                 eval_examples: int = 512):
        super().__init__(teacher, tokenizer, weights, settings)
        self.data = data
        self.eval_batches = held_out.evaluation_batches(eval_examples) if held_out is not None else []

    def batches(self, epoch: int) -> Sequence[dict[str, torch.Tensor]]:
        """The epoch's masked batches."""
        return self.data.epoch_batches(epoch)

    def compute(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """The triple loss of one batch (the teacher only runs when a term needs it)."""
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        out = model(**inputs, output_hidden_states=self.weights.alpha_cos != 0)
        teacher_logits = teacher_hidden = None
        if self.weights.alpha_ce or self.weights.alpha_cos:
            with torch.no_grad():
                taught = self.teacher(**inputs, output_hidden_states=self.weights.alpha_cos != 0)
            teacher_logits = taught.logits
            teacher_hidden = taught.hidden_states[-1] if self.weights.alpha_cos else None
        student_hidden = out.hidden_states[-1] if self.weights.alpha_cos else None
        loss, terms = triple_loss(out.logits, student_hidden, batch["labels"], batch["attention_mask"],
                                  self.weights, teacher_logits, teacher_hidden)
        metrics = {name: float(value.detach()) for name, value in terms.items()}
        masked = batch["labels"] != IGNORE_INDEX
        metrics["mlm_accuracy"] = float((out.logits[masked].argmax(-1) == batch["labels"][masked]).float().mean()) \
            if masked.any() else 0.0
        return StepOutput(loss, metrics, int(batch["attention_mask"].sum()))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out masked-LM loss and accuracy of the student; the teacher's on the same masks, computed once."""
        if not self.eval_batches:
            return {}
        if self.teacher_figures is None:
            found = masked_lm_figures(self.teacher, self.eval_batches)
            self.teacher_figures = {"teacher_mlm_loss": found["eval_mlm_loss"],
                                    "teacher_mlm_accuracy": found["eval_mlm_accuracy"]}
        return {**masked_lm_figures(model, self.eval_batches),
                **{f"eval_{k}": v for k, v in self.teacher_figures.items()}}


def masked_lm_figures(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """{"eval_mlm_loss", "eval_mlm_accuracy", "eval_mlm_tokens"} of a masked-LM model over batches with fixed masks
    (the loss and accuracy over all masked tokens together)."""
    device = next(model.parameters()).device
    loss_sum, correct, tokens = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"].to(device),
                           attention_mask=batch["attention_mask"].to(device)).logits
            labels = batch["labels"].to(device)
            masked = labels != IGNORE_INDEX
            chosen, targets = logits[masked].float(), labels[masked]
            loss_sum += float(F.cross_entropy(chosen, targets, reduction="sum"))
            correct += int((chosen.argmax(-1) == targets).sum())
            tokens += int(targets.numel())
    return {"eval_mlm_loss": loss_sum / max(tokens, 1), "eval_mlm_accuracy": correct / max(tokens, 1),
            "eval_mlm_tokens": tokens}


class EmbeddingDistillationTask(DistillationTask):
    """Sentence-embedding distillation: batches of sentences, the student's pooled embeddings matched to the
    teacher's (MSE, optionally cosine), held-out mean cosine and MSE between them."""

    objective = "embedding"

    def __init__(self, teacher: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, weights: LossWeights,
                 settings: dict[str, Any], *, sentences: list[str], held_out: list[str],
                 pooling: str, normalize: bool, batch_size: int, max_length: int, seed: int, extra_files: Path,
                 modules: list[dict[str, Any]], pairs: float = 0.0,
                 pair_sources: Sequence[tuple[int, str, str]] = ()):
        super().__init__(teacher, tokenizer, weights, settings, extra_files, modules)
        self.sentences, self.pooling, self.normalize = sentences, pooling, normalize
        self.pairs, self.pair_sources = pairs, list(pair_sources)
        self.batch_size, self.max_length, self.seed = batch_size, max_length, seed
        self.token_types = bool(getattr(teacher.config, "type_vocab_size", 0))
        self.eval_batches = [encode_sentences(tokenizer, held_out[i:i + batch_size], max_length, self.token_types)
                             for i in range(0, len(held_out), batch_size)]
        self.teacher_eval: list[torch.Tensor] | None = None

    def batches(self, epoch: int) -> Sequence[dict[str, torch.Tensor]]:
        """The epoch's sentence batches."""
        return SentenceBatches(self.sentences, self.tokenizer, self.batch_size, self.max_length, self.seed, epoch,
                               self.token_types, self.pairs, self.pair_sources)

    def embed(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sentence embeddings [B, H] as the checkpoint's sentence-transformers modules make them."""
        return self.pool(model(**batch).last_hidden_state, batch)

    def pool(self, hidden: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sentence embeddings [B, H] of last hidden states [B, S, H] (pooled, normalised as the checkpoint)."""
        if self.pooling == "cls":
            pooled = hidden[:, 0].float()
            return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled
        return mean_pool(hidden, batch["attention_mask"], normalize=self.normalize)

    def compute(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """The embedding loss of one batch against the teacher's embeddings of the same sentences."""
        all_states = bool(self.weights.alpha_layers)
        with torch.no_grad():
            teacher_out = self.teacher(**batch, output_hidden_states=all_states)
            target = self.pool(teacher_out.last_hidden_state, batch)
        student_out = model(**batch, output_hidden_states=all_states)
        student = self.pool(student_out.last_hidden_state, batch)
        layers = None
        if all_states:  # hidden_states[0] is the embeddings' output, [i + 1] layer i's
            paired = self._settings["teacher_layers"][:-1]
            layers = (student_out.hidden_states[1:len(paired) + 1],
                      [teacher_out.hidden_states[index + 1] for index in paired])
        loss, terms = embedding_loss(student, target, self.weights, (student_out.last_hidden_state,
                                     teacher_out.last_hidden_state, batch["attention_mask"]), layers)
        metrics = {name: float(value.detach()) for name, value in terms.items()}
        metrics["cosine"] = float(F.cosine_similarity(student.detach(), target, dim=-1).mean())
        return StepOutput(loss, metrics, int(batch["attention_mask"].sum()))

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Mean cosine and MSE between the student's and the teacher's embeddings of the held-out sentences."""
        if not self.eval_batches:
            return {}
        device = next(model.parameters()).device
        batches = [{k: v.to(device) for k, v in b.items()} for b in self.eval_batches]
        with torch.no_grad():
            if self.teacher_eval is None:
                self.teacher_eval = [self.embed(self.teacher, b) for b in batches]
            student = torch.cat([self.embed(model, b) for b in batches])
        teacher = torch.cat(self.teacher_eval)
        return {"eval_cosine": float(F.cosine_similarity(student, teacher, dim=-1).mean()),
                "eval_mse": float(F.mse_loss(student, teacher)), "eval_sentences": int(teacher.shape[0])}


# ---------------------------------------------------------------------------------------- curve, summary
# the loss and its terms
TRAINING_LOSSES = ("loss", "ce_loss", "mlm_loss", "cos_loss", "mse_loss", "hidden_loss", "layers_loss")


def summarize(records: list[dict[str, Any]], teacher: dict[str, float] | None = None,
              window: int = curves.SUMMARY_WINDOW) -> dict[str, Any]:
    """Steps, tokens, time, the mean training loss (and each term) over the first and last ``window`` steps, the
    first and last held-out evaluations, and the teacher's held-out figures (mlm)."""
    summary = curves.summarize_run(records, (*TRAINING_LOSSES, "mlm_accuracy", "cosine"), window)
    if teacher:
        summary["teacher"] = teacher
    return summary


def plot_distillation_curve(records: list[dict[str, Any]], path: Path, objective: str) -> None:
    """The training loss and each of its terms against the step (moving averages), with the held-out figure
    (student MLM loss for mlm, mean cosine to the teacher for embedding) on a second axis; written atomically."""
    steps, evals = curves.split_records(records)
    if not steps:
        return
    window = curves.curve_window(len(steps))
    x = [r["step"] for r in steps]
    held = "eval_mlm_loss" if objective == "mlm" else "eval_cosine"
    with curves.curve_figure(path, f"fastbert distill ({objective})", columns=3) as axis:
        for key in TRAINING_LOSSES:
            if key in steps[0]:
                axis.plot(x, curves.moving_average([r[key] for r in steps], window),
                          label=f"train {key} (mean of {window})")
        axis.set_xlabel("step")
        axis.set_ylabel("training loss")
        axis.set_yscale("log")
        if evals and held in evals[0]:
            second = axis.twinx()
            second.plot([r["step"] for r in evals], [r[held] for r in evals], "o-", color="black",
                        label=f"held-out {held[5:].replace('_', ' ')}")
            second.set_ylabel(f"held-out {held[5:].replace('_', ' ')}")


# ----------------------------------------------------------------------------------------------------- run
@dataclass
class DistillSettings(RunSettings):
    """One distillation run (the options of ``fastbert distill``; see the module docstring)."""

    output_dir: str
    teacher: str | None = None  # None: the embedded all-MiniLM-L6-v2 (embedding objective only)
    objective: str = "mlm"
    student_layers: int | None = None  # None: half the teacher's
    teacher_layers: tuple[int, ...] | None = None  # the teacher layers to keep, instead of the spread default
    init: str = "teacher"  # or "random": the same student trained from scratch (a baseline)
    files: tuple[str, ...] = ()
    corpus: str | None = None  # without files: "pydoc" (mlm default) or "cpython" (embedding default)
    temperature: float | None = None  # None: the objective's default (DISTILBERT_LOSS / EMBEDDING_LOSS)
    alpha_ce: float | None = None
    alpha_mlm: float | None = None
    alpha_cos: float | None = None
    alpha_mse: float | None = None
    alpha_hidden: float | None = None
    alpha_layers: float | None = None
    pairs: float = 0.0  # embedding: the share of each batch that is sentence pairs (`SentenceBatches`)
    mlm_probability: float = 0.15
    pack: bool = False
    max_length: int | None = None  # None: 128, or the teacher's positions when it has fewer
    batch_size: int = 32
    max_steps: int = 1000
    learning_rate: float | None = None  # None: 5e-4 (mlm, DistilBERT's) or 1e-4 (embedding)
    warmup_steps: int | None = None  # None: 5 % of max_steps (DistilBERT's warmup_prop)
    weight_decay: float = 0.0  # DistilBERT's
    max_grad_norm: float = 5.0  # DistilBERT's
    held_out: float = 0.05
    eval_sentences: int = 512

    def check(self) -> None:
        """UserError naming the first setting that cannot run (by its command-line option)."""
        if self.objective not in OBJECTIVES:
            raise UserError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "mlm" and self.teacher is None:
            raise UserError("--objective mlm needs --teacher DIR: a BERT or RoBERTa masked-LM checkpoint")
        if self.init not in ("teacher", "random"):
            raise UserError(f"--init must be teacher or random, got {self.init!r}")
        for name, value in (("--batch-size", self.batch_size), ("--max-steps", self.max_steps),
                            ("--eval-sentences", self.eval_sentences)):
            if value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if self.max_length is not None and self.max_length < 8:
            raise UserError(f"--max-length must be >= 8, got {self.max_length}")
        if not 0 < self.mlm_probability < 1:
            raise UserError(f"--mlm-probability must be between 0 and 1, got {self.mlm_probability}")
        if not 0 <= self.held_out < 0.5:
            raise UserError(f"--held-out must be in [0, 0.5), got {self.held_out}")
        weights = asdict(self.loss_weights())
        for name, value in weights.items():  # a weight not given is the objective's default, in range
            check_number(f"--{name.replace('_', '-')}", value, strict=name == "temperature")
        alphas = [value for name, value in weights.items() if name.startswith("alpha_")]
        if not 0 <= self.pairs <= 1:
            raise UserError(f"--pairs must be between 0 and 1, got {self.pairs}")
        if self.pairs and self.objective != "embedding":
            raise UserError("--pairs is an option of the embedding objective")
        if not any(alphas):
            raise UserError("every --alpha-* is 0: there is no loss to train on")
        check_number("--learning-rate", self.learning_rate, strict=True)
        check_number("--weight-decay", self.weight_decay)
        check_number("--max-grad-norm", self.max_grad_norm)
        super().check()  # the run options: --threads, checkpoints, logging
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.max_steps:
            raise UserError("--warmup-steps must be between 0 and --max-steps")

    def loss_weights(self) -> LossWeights:
        """The objective's published defaults, with the weights given here over them; an objective's terms only
        (mlm: ce, mlm, cos; embedding: mse, cos)."""
        base = DISTILBERT_LOSS if self.objective == "mlm" else EMBEDDING_LOSS
        given = {"temperature": self.temperature, "alpha_ce": self.alpha_ce, "alpha_mlm": self.alpha_mlm,
                 "alpha_cos": self.alpha_cos, "alpha_mse": self.alpha_mse, "alpha_hidden": self.alpha_hidden,
                 "alpha_layers": self.alpha_layers}
        unused = ("alpha_mse", "alpha_hidden", "alpha_layers") if self.objective == "mlm" else \
            ("temperature", "alpha_ce", "alpha_mlm")
        for name in unused:
            if given[name] is not None:
                raise UserError(f"--{name.replace('_', '-')} is not a term of the {self.objective} objective")
        return LossWeights(**{k: (v if v is not None else getattr(base, k)) for k, v in given.items()})

    def training_arguments(self) -> TrainingArguments:
        """The `fastbert.training.loop` arguments of this run (DistilBERT's Adam epsilon 1e-6)."""
        rate = self.learning_rate if self.learning_rate is not None else (5e-4 if self.objective == "mlm" else 1e-4)
        warmup = self.warmup_steps if self.warmup_steps is not None else round(0.05 * self.max_steps)
        return TrainingArguments(output_dir=self.output_dir, max_steps=self.max_steps, learning_rate=rate,
                                 weight_decay=self.weight_decay, warmup_steps=warmup, adam_epsilon=1e-6,
                                 max_grad_norm=self.max_grad_norm, seed=self.seed, save_every=self.save_every,
                                 eval_every=self.eval_every, log_every=self.log_every,
                                 keep_checkpoints=self.keep_checkpoints, resume=self.resume, progress=self.progress)


def distill(settings: DistillSettings, log: TextIO | None = None) -> TrainResult:
    """Run one distillation (module docstring): everything that can be wrong with the teacher, the student's depth,
    the tokenizer or the settings is a UserError before anything trains. Writes a description of the run and a
    summary at the end on ``log`` (default stderr); returns the loop's result."""
    log = log or sys.stderr
    device = settings.start(settings.output_dir)
    if settings.teacher is not None and not settings.teacher.strip():
        raise UserError("--teacher is empty (give a checkpoint directory, or leave it out for the default model)")
    teacher_dir = settings.teacher or default_model_dir()
    plan = plan_mlm(settings, teacher_dir, device) if settings.objective == "mlm" else \
        plan_embedding(settings, teacher_dir, device)
    task, student = plan
    if settings.optimize:
        import fastbert

        task.teacher = fastbert.optimize(task.teacher, backend=settings.backend)
        student = fastbert.optimize(student, backend=settings.backend)
    log.write(describe_run(settings, teacher_dir, task, student, device) + "\n")
    result = train(student, task, settings.training_arguments())
    out = Path(settings.output_dir)
    if result.steps_run == 0 and (out / "model").is_dir() and (out / "summary.json").is_file():
        log.write(f"fastbert distill: the run in {out} is already complete (step {result.step} of "
                  f"{settings.max_steps}): nothing to train, nothing changed; its student is in {out / 'model'}, its "
                  f"summary in {out / 'summary.json'}\n")
        return result
    if task.teacher_figures is None and settings.objective == "mlm":
        task.evaluate(student)  # a resume of a finished run: the teacher's figures for the summary
    model_out = keep_final_model(result.checkpoint, settings.output_dir)
    log.write(summary_text(result, task, model_out))
    return result


def teacher_fingerprint(teacher_dir: str) -> str:
    """A short hash of the teacher's weight files (a resume must distil the same teacher)."""
    digest = hashlib.sha256()
    for path in sorted(Path(teacher_dir).glob("*.safetensors")) + sorted(Path(teacher_dir).glob("*.bin")):
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def common_settings(settings: DistillSettings, teacher_dir: str, documents: list[list[str]],
                    tokenizer: PreTrainedTokenizerBase, student: PreTrainedModel, indices: list[int]) -> dict[str, Any]:
    """What a resume must match, for both objectives: teacher, student, layers, loss, data, corpus, vocabulary."""
    found = {"objective": settings.objective, "teacher": os.path.abspath(teacher_dir),
             "teacher_sha256": teacher_fingerprint(teacher_dir), "teacher_layers": indices, "init": settings.init,
             "loss": asdict(settings.loss_weights()), "corpus": "text files" if settings.files else settings.corpus,
             "corpus_sha256": corpus_fingerprint(documents), "held_out": settings.held_out,
             "vocab_sha256": vocab_fingerprint(tokenizer),
             "batch_size": settings.batch_size, "student": json.loads(student.config.to_json_string(use_diff=False)),
             "optimized": settings.optimize, "backend": settings.backend}
    found["student"].pop("transformers_version", None)
    return found


def sequence_length(settings: DistillSettings, teacher_config: PretrainedConfig) -> int:
    """Tokens per sequence: --max-length (default 128, or the teacher's positions when it has fewer); UserError
    when --max-length is more than the teacher has."""
    positions = teacher_config.max_position_embeddings - position_offset(teacher_config)
    if settings.max_length is None:
        return min(128, positions)
    if settings.max_length > positions:
        raise UserError(f"--max-length {settings.max_length}: the teacher has {positions} positions")
    return settings.max_length


def plan_mlm(settings: DistillSettings, teacher_dir: str, device: torch.device
             ) -> tuple[MlmDistillationTask, torch.nn.Module]:
    """The teacher, the DistilBERT student and the task of an mlm distillation (every check before training)."""
    check_mlm_teacher(teacher_dir)
    config = teacher_config(teacher_dir)
    tokenizer = load_teacher_tokenizer(teacher_dir, config, "mlm")
    indices = student_layer_indices(config.num_hidden_layers, settings.student_layers, settings.teacher_layers)
    max_length = sequence_length(settings, config)
    teacher = load_mlm_teacher(teacher_dir, device)
    torch.manual_seed(settings.seed)  # the random initialisation of what is not copied (or of everything)
    student = build_mlm_student(teacher, indices, from_teacher=settings.init == "teacher").to(device)
    # DistilBERT's tokenizer gives no token types; the student's copy of the teacher's says so
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    tokenizer.init_kwargs["model_input_names"] = ["input_ids", "attention_mask"]
    documents = run_documents(settings.files, settings.corpus, "pydoc")
    train_docs, held_docs = hold_out(documents, settings.held_out, settings.seed)
    options = DataOptions(objective="roberta", max_length=max_length, batch_size=settings.batch_size,
                          mlm_probability=settings.mlm_probability, pack=settings.pack, seed=settings.seed)
    special = dict(cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id,
                   mask_id=tokenizer.mask_token_id, vocab_size=len(tokenizer),
                   continuation=continuation_table(tokenizer))
    data = PretrainingData(tokenize_documents(tokenizer, train_docs), options, **special)
    held = PretrainingData(tokenize_documents(tokenizer, held_docs), options, **special) if held_docs else None
    run = common_settings(settings, teacher_dir, documents, tokenizer, student, indices)
    run["data"] = asdict(options)
    task = MlmDistillationTask(teacher, tokenizer, settings.loss_weights(), run, data, held,
                               eval_examples=settings.eval_sentences)
    return task, student


def plan_embedding(settings: DistillSettings, teacher_dir: str, device: torch.device
                   ) -> tuple[EmbeddingDistillationTask, torch.nn.Module]:
    """The teacher, the shallower student and the task of an embedding distillation (every check first)."""
    pooling, normalize, modules = sentence_transformer_modules(teacher_dir)
    config = teacher_config(teacher_dir)
    tokenizer = load_teacher_tokenizer(teacher_dir, config, "embedding")
    layers = getattr(config, "num_hidden_layers", None)
    if layers is None:
        raise UserError(f"--teacher {teacher_dir}: its config names no number of layers")
    indices = student_layer_indices(layers, settings.student_layers, settings.teacher_layers)
    if settings.alpha_layers and len(indices) < 2:
        raise UserError("--alpha-layers pairs the student's intermediate layers with the teacher's: a student of one "
                        "layer has none (use --alpha-hidden for its last layer)")
    max_length = sequence_length(settings, config)
    teacher = load_embedding_teacher(teacher_dir, device)
    torch.manual_seed(settings.seed)
    student = build_layer_student(teacher, indices, from_teacher=settings.init == "teacher").to(device)
    documents = run_documents(settings.files, settings.corpus, "cpython")
    train_docs, held_docs = hold_out(documents, settings.held_out, settings.seed)
    held = [s for doc in held_docs for s in doc]
    held = random.Random(f"held-out-sentences/{settings.seed}").sample(held, min(len(held), settings.eval_sentences))
    run = common_settings(settings, teacher_dir, documents, tokenizer, student, indices)
    run.update(pooling=pooling, normalize=normalize, max_length=max_length, pairs=settings.pairs)
    task = EmbeddingDistillationTask(
        teacher, tokenizer, settings.loss_weights(), run, sentences=[s for doc in train_docs for s in doc],
        held_out=held, pooling=pooling, normalize=normalize, batch_size=settings.batch_size,
        max_length=max_length, seed=settings.seed, extra_files=Path(teacher_dir), modules=modules,
        pairs=settings.pairs, pair_sources=sentence_pairs(train_docs) if settings.pairs else ())
    return task, student


def describe_run(settings: DistillSettings, teacher_dir: str, task: DistillationTask, student: torch.nn.Module,
                 device: torch.device) -> str:
    """The run's first line: teacher, student, layers kept, loss, data, threads and device."""
    def millions(model: torch.nn.Module) -> str:
        return f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters"

    weights = asdict(task.weights)
    loss = ", ".join(f"{k} {v:g}" for k, v in weights.items() if v and (k != "temperature" or weights["alpha_ce"]))
    layers = task.settings()["teacher_layers"]
    kept = "random init" if settings.init == "random" else f"teacher layers {','.join(map(str, layers))}"
    return (f"fastbert distill ({settings.objective}): teacher {type(task.teacher).__name__} "
            f"({task.teacher.config.num_hidden_layers} layers, {millions(task.teacher)}) from {teacher_dir} -> "
            f"student {type(student).__name__} ({len(layers)} layers, {kept}, {millions(student)}); loss: {loss}; "
            f"{len(task.batches(0))} batches of {settings.batch_size} per epoch, {torch.get_num_threads()} threads, "
            f"{device}")


def summary_text(result: TrainResult, task: DistillationTask, model_out: str) -> str:
    """The lines written at the end: where the student is, the last held-out figures (and the teacher's)."""
    lines = [f"fastbert distill: done at step {result.step}; student -> {model_out}\n"]
    _, evals = curves.split_records(result.records)
    if evals:
        last = evals[-1]
        lines.append("  held-out at step {}: {}\n".format(
            last["step"], ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("eval_")
                                    and isinstance(v, float))))
    return "".join(lines)
