"""Task heads on fastbert's encoder: masked LM, next-sentence / sentence-order, pretraining, sequence / token
classification, extractive QA and multiple choice, for every supported family, with transformers' losses.

Each task model is `encoder` (a `FastBertModel`) plus one or two heads built from two blocks:

- `MaskedLMHead`: dense -> activation -> LayerNorm -> decoder tied to the word embeddings (+ own bias). Its
  widths and activation cover BERT, RoBERTa, DistilBERT, ALBERT (H -> E), ELECTRA's generator (H -> E) and
  ModernBERT (whose dense, LayerNorm and decoder may lack biases).
- `DenseHead`: [dense -> activation -> [LayerNorm] ->] linear, applied to the pooler output, the first token,
  the first real token, the mean of the real tokens or every token. It covers BERT's classifiers, RoBERTa/ELECTRA's
  classification head, DistilBERT's pre_classifier, ELECTRA's discriminator and sequence summary, the span (QA)
  head, ModernBERT's prediction head + classifier (cls or mean pooling).

Which head, on which input, with which HF parameter names, per task is one table per family (`Family.heads`, in
the family's module of `fastbert.families`); `build_task_model` and `head_key_map` (used by
`fastbert.from_pretrained`) both read it. The computation is the corresponding transformers class in eval mode;
there is no dropout. Heads that read every token (masked LM, token classification, QA, discriminator) see zeros
at padded positions where transformers sees padding garbage, so their outputs at padded positions differ from
transformers' (real positions and losses over them match).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fastbert import families, ops
from fastbert.config import FastBertConfig
from fastbert.model import EncoderOutput, FastBertModel
from fastbert.ops.padding import first_position_padded, first_token_beyond

TASKS = ("masked-lm", "next-sentence", "pretraining", "sequence-classification", "token-classification",
         "question-answering", "multiple-choice")
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")
HEAD_ACTIVATIONS = ops.ACTIVATIONS + ("tanh",)
MaybeTensor = torch.Tensor | None


# ------------------------------------------------------------------------------------------------ outputs
@dataclass
class MaskedLMOutput:
    """logits [B, S, V]."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class NextSentencePredictorOutput:
    """logits [B, 2] (0 = B continues A)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class PreTrainingOutput:
    """BERT: prediction_logits [B, S, V], seq_relationship_logits [B, 2]; loss = MLM + NSP."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    seq_relationship_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class SentenceOrderPreTrainingOutput:
    """ALBERT: prediction_logits [B, S, V], sop_logits [B, num_labels]; loss = MLM + sentence order."""

    loss: torch.Tensor | None = None
    prediction_logits: torch.Tensor | None = None
    sop_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class DiscriminatorOutput:
    """ELECTRA pretraining: logits [B, S], > 0 = token replaced."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutput:
    """logits [B, num_labels]."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class TokenClassifierOutput:
    """logits [B, S, num_labels]."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class QuestionAnsweringOutput:
    """start_logits, end_logits [B, S]."""

    loss: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class MultipleChoiceOutput:
    """logits [B, C]; hidden_states are those of the flattened [B * C, S] batch."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


# ------------------------------------------------------------------------------------------------- losses
def _check_label_shape(name: str, labels: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(labels.shape)}")


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, name: str = "labels") -> torch.Tensor:
    """Mean cross entropy over every position whose label is not -100. logits [..., C], labels [...] (int)."""
    _check_label_shape(name, labels, logits.shape[:-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), ignore_index=-100)


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor,
                                 problem_type: str | None = None) -> torch.Tensor:
    """transformers' rule: problem_type if set, else regression (MSE) when num_labels == 1, single-label cross
    entropy for integer labels [B], multi-label BCE-with-logits for float labels [B, num_labels]. logits [B, L].

    Unlike transformers, the inferred problem type is not written back into the config (each call decides)."""
    num_labels = logits.shape[-1]
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return F.mse_loss(logits, labels.to(logits.dtype))
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.reshape(-1).long())
    if problem_type == "multi_label_classification":
        _check_label_shape("labels", labels, logits.shape)
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    raise ValueError(f"unknown problem_type {problem_type!r}; expected one of {PROBLEM_TYPES}")


def span_loss(start_logits: torch.Tensor, end_logits: torch.Tensor, start_positions: torch.Tensor,
              end_positions: torch.Tensor) -> torch.Tensor:
    """Extractive QA loss: mean of start and end cross entropies over S positions. Positions [B] (or [B, 1])
    outside [0, S) are clamped to S and ignored, as in transformers."""
    seqlen = start_logits.shape[1]
    positions = []
    for name, pos in (("start_positions", start_positions), ("end_positions", end_positions)):
        if pos.dim() > 1:
            pos = pos.squeeze(-1)
        _check_label_shape(name, pos, start_logits.shape[:1])
        positions.append(pos.clamp(0, seqlen).long())
    start = F.cross_entropy(start_logits, positions[0], ignore_index=seqlen)
    end = F.cross_entropy(end_logits, positions[1], ignore_index=seqlen)
    return (start + end) / 2


WINDOWED_PADDING_WARNING = (
    "fastbert: this loss reads padded positions (labels there that are not -100, or question answering's span "
    "positions on a padded batch), and on sliding-window layers a padded position whose window holds no real "
    "token is zeros in fastbert where transformers averages the padding there: the loss may differ slightly from "
    "transformers'")


def reads_padding(attention_mask: MaybeTensor, labels: MaybeTensor = None, spans: bool = False) -> bool:
    """Whether a loss reads the head's output at positions ``attention_mask`` marks as padding: token labels there
    that are not -100 (a collator that does not mask them), or a span loss (question answering: its softmax runs
    over every position of the row) on a padded batch. Under torch.compile or tracing, which cannot read the mask
    and run the padded form anyway: whenever such labels are given."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return False
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return spans or isinstance(labels, torch.Tensor)
    if spans:
        return not bool(attention_mask.bool().all())
    if isinstance(labels, torch.Tensor) and labels.shape == attention_mask.shape:
        return bool(((attention_mask == 0) & (labels != -100)).any())
    return False


def discriminator_loss(logits: torch.Tensor, labels: torch.Tensor,
                       attention_mask: torch.Tensor | None) -> torch.Tensor:
    """ELECTRA replaced-token detection: BCE-with-logits over the real tokens. logits, labels (0/1), mask [B, S]."""
    _check_label_shape("labels", labels, logits.shape)
    if attention_mask is None:
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    active = attention_mask.reshape(logits.shape) != 0
    return F.binary_cross_entropy_with_logits(logits[active], labels[active].to(logits.dtype))


# -------------------------------------------------------------------------------------------------- heads
def activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """A head activation: one of `HEAD_ACTIVATIONS`, or None for identity."""
    if activation is None:
        return x
    if activation == "tanh":
        return torch.tanh(x)
    if activation in ops.ACTIVATIONS:
        return ops.apply_activation(x, activation)
    raise ValueError(f"unknown head activation {activation!r}; expected one of {HEAD_ACTIVATIONS} or None")


def dense_activation(x: torch.Tensor, layer: nn.Linear, activation: str | None, backend: str | None) -> torch.Tensor:
    """act(layer(x)); the GELU/ReLU cases go through the fused `linear_activation` op."""
    if activation in ops.ACTIVATIONS:
        return ops.linear_activation(x.contiguous(), layer.weight, layer.bias, activation, backend=backend)
    return activate(layer(x), activation)


class MaskedLMHead(nn.Module):
    """dense (H -> width) -> activation -> LayerNorm(width) -> decoder (width -> V): [..., H] -> [..., V].

    The decoder weight is the encoder's word embeddings [V, width], passed to `forward` (tied, no parameter of
    its own) unless the checkpoint unties them (`tied=False`: own `decoder_weight`)."""

    def __init__(self, hidden_size: int, width: int, vocab_size: int, activation: str, eps: float,
                 tied: bool = True, dense_bias: bool = True, norm_bias: bool = True, decoder_bias: bool = True):
        super().__init__()
        self.activation = activation
        self.dense = nn.Linear(hidden_size, width, bias=dense_bias)
        self.norm = nn.LayerNorm(width, eps=eps, bias=norm_bias)
        self.decoder_weight = None if tied else nn.Parameter(torch.empty(vocab_size, width))
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size)) if decoder_bias else None

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor, backend: str | None = None):
        x = self.norm(dense_activation(hidden, self.dense, self.activation, backend))
        weight = word_embeddings if self.decoder_weight is None else self.decoder_weight
        return F.linear(x, weight, self.decoder_bias)


class DenseHead(nn.Module):
    """[dense (in -> inner) ->] [activation ->] [LayerNorm ->] out (-> out_features): [..., in] ->
    [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, inner_features: int | None = None,
                 activation: str | None = None, dense_bias: bool = True, norm_eps: float | None = None,
                 norm_bias: bool = True):
        super().__init__()
        self.activation = activation
        self.dense = nn.Linear(in_features, inner_features, bias=dense_bias) if inner_features else None
        width = inner_features or in_features
        self.norm = nn.LayerNorm(width, eps=norm_eps, bias=norm_bias) if norm_eps is not None else None
        self.out = nn.Linear(width, out_features)

    def forward(self, x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
        if self.dense is not None:
            x = dense_activation(x, self.dense, self.activation, backend)
        else:
            x = activate(x, self.activation)
        if self.norm is not None:
            x = self.norm(x)
        return self.out(x)


# --------------------------------------------------------------------------------------- per-family table
@dataclass(frozen=True)
class MLMSpec:
    """A `MaskedLMHead` and the HF names of its parts (full keys without .weight/.bias)."""

    width: int
    activation: str
    eps: float
    hf_dense: str
    hf_norm: str
    hf_decoder: str
    hf_tied_bias: str | None  # where a tied decoder's bias is saved (BERT's cls.predictions.bias); None: decoder's own
    # ModernBERT's head may lack the dense bias (classifier_bias), the LayerNorm's (norm_bias) and the decoder's
    # (decoder_bias)
    dense_bias: bool = True
    norm_bias: bool = True
    decoder_bias: bool = True

    def build(self, config: FastBertConfig) -> MaskedLMHead:
        return MaskedLMHead(config.hidden_size, self.width, config.vocab_size, self.activation, self.eps,
                            tied=_tied(config), dense_bias=self.dense_bias, norm_bias=self.norm_bias,
                            decoder_bias=self.decoder_bias)

    def key_map(self, name: str, config: FastBertConfig) -> list[tuple[str, list[str]]]:
        pairs = _module_keys(f"{name}.dense", self.hf_dense, self.dense_bias)
        pairs += _module_keys(f"{name}.norm", self.hf_norm, self.norm_bias)
        if _tied(config):
            bias = self.hf_tied_bias or f"{self.hf_decoder}.bias"
        else:  # untied: transformers ties neither weight nor bias and runs the decoder Linear as saved
            pairs.append((f"{name}.decoder_weight", [f"{self.hf_decoder}.weight"]))
            bias = f"{self.hf_decoder}.bias"
        return pairs + ([(f"{name}.decoder_bias", [bias])] if self.decoder_bias else [])

    def redundant_keys(self, config: FastBertConfig) -> list[str]:
        """HF keys a checkpoint may hold that carry nothing of their own: a tied decoder's copies of the word
        embeddings (and of the bias), or BERT-style heads' unused `bias` beside an untied decoder's."""
        if not _tied(config):
            return [self.hf_tied_bias] if self.hf_tied_bias else []
        return [f"{self.hf_decoder}.weight"] + ([f"{self.hf_decoder}.bias"] if self.hf_tied_bias else [])


@dataclass(frozen=True)
class DenseSpec:
    """A `DenseHead` on ``source``: "pooler" (the pooler output), "first" (the first token), "first_real" (each
    row's first real token), "mean" (the mean over the real tokens) or "tokens" (every token). ``hf_norm``: a
    LayerNorm (eps ``eps``) after the activation (ModernBERT's prediction head)."""

    out_features: int
    source: str
    hf_out: str
    hf_dense: str | None = None
    activation: str | None = None
    hf_norm: str | None = None
    dense_bias: bool = True
    norm_bias: bool = True
    eps: float = 1e-12

    def build(self, config: FastBertConfig) -> DenseHead:
        inner = config.hidden_size if self.hf_dense else None
        return DenseHead(config.hidden_size, self.out_features, inner, self.activation, self.dense_bias,
                         self.eps if self.hf_norm else None, self.norm_bias)

    def key_map(self, name: str, config: FastBertConfig) -> list[tuple[str, list[str]]]:
        pairs = _module_keys(f"{name}.dense", self.hf_dense, self.dense_bias) if self.hf_dense else []
        pairs += _module_keys(f"{name}.norm", self.hf_norm, self.norm_bias) if self.hf_norm else []
        return pairs + _module_keys(f"{name}.out", self.hf_out)

    def redundant_keys(self, config: FastBertConfig) -> list[str]:
        return []


def _module_keys(ours: str, theirs: str, bias: bool = True) -> list[tuple[str, list[str]]]:
    return [(f"{ours}.weight", [f"{theirs}.weight"])] + ([(f"{ours}.bias", [f"{theirs}.bias"])] if bias else [])


def _tied(config: FastBertConfig) -> bool:
    return bool(config.extra.get("tie_word_embeddings", True))


def _family_heads(config: FastBertConfig) -> dict[str, dict[str, MLMSpec | DenseSpec]]:
    """task -> {attribute name: head spec} for the config's family (its module in `fastbert.families`); the keys
    are `supported_tasks(config)`."""
    return families.get(config.model_type).heads(config)


def supported_tasks(config: FastBertConfig) -> tuple[str, ...]:
    """The tasks of `TASKS` that the config's family has a transformers head class for."""
    return tuple(task for task in TASKS if task in _family_heads(config))


def _task_heads(config: FastBertConfig, task: str) -> dict[str, MLMSpec | DenseSpec]:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    tasks = supported_tasks(config)
    if task not in tasks:
        raise ValueError(f"{config.model_type} has no {task!r} head; its tasks are: {', '.join(tasks)}")
    if task == "question-answering" and config.num_labels != 2:
        raise ValueError(f"question answering needs num_labels == 2 (start, end logits), got {config.num_labels}")
    families.get(config.model_type).check_task(config, task)
    return _family_heads(config)[task]


# ---------------------------------------------------------------------------------------------- task models
class TaskModel(nn.Module):
    """`encoder` (FastBertModel) + named heads; subclasses define `forward` per task. Inputs are the encoder's
    (input_ids / attention_mask / token_type_ids / position_ids [B, S] or inputs_embeds [B, S, E]); there is no
    dropout, in training mode either."""

    def __init__(self, config: FastBertConfig, heads: dict[str, MLMSpec | DenseSpec], backend: str = "auto"):
        super().__init__()
        uses_pooler = any(isinstance(spec, DenseSpec) and spec.source == "pooler" for spec in heads.values())
        self.config = config
        self.encoder = FastBertModel(dataclasses.replace(config, has_pooler=uses_pooler), backend=backend)
        self.sources = {name: getattr(spec, "source", "tokens") for name, spec in heads.items()}
        for name, spec in heads.items():
            self.add_module(name, spec.build(config))

    def _encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                output_hidden_states, loss_reads_padding: bool = False) -> EncoderOutput:
        """The encoder's output; in its padded form, padded positions computed as transformers computes them, when
        the call's loss reads them (`reads_padding`) or a head reads position 0 where it is padding (the encoder's
        ``reads_first_position``), so that both equal transformers'."""
        config = self.encoder.config
        if loss_reads_padding and attention_mask is not None and config.window_narrower_than(attention_mask.shape[-1]):
            warnings.warn(WINDOWED_PADDING_WARNING, stacklevel=3)
        reads_first = "first" in self.sources.values()
        if reads_first:
            self._check_first_position(attention_mask)
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            position_ids=position_ids, inputs_embeds=inputs_embeds,
                            output_hidden_states=output_hidden_states, keep_padded_rows=loss_reads_padding,
                            reads_first_position=reads_first)

    def _check_first_position(self, attention_mask: MaybeTensor) -> None:
        """Raise when a row's position 0 is padding and a sliding window around it holds no token: fastbert's
        attention gives zeros there, where transformers averages the padding, so a first-token head would read
        other numbers. (Under torch.compile or tracing, which cannot read the mask, nothing is checked.)"""
        if (torch.compiler.is_compiling() or torch.jit.is_tracing() or not isinstance(attention_mask, torch.Tensor)
                or attention_mask.dim() != 2):
            return
        reach = self.encoder.config.window_reach()
        if reach is not None and first_position_padded(attention_mask) and first_token_beyond(attention_mask, reach):
            raise ValueError(f"a row's first token lies more than {reach} positions from position 0 (or it has "
                             "none), which the first-token head reads: its sliding window there holds no token, and "
                             "fastbert would not compute what transformers does; pad on the right")

    def _head(self, name: str, encoded: EncoderOutput, attention_mask: MaybeTensor = None) -> torch.Tensor:
        """Run head ``name`` on its input: pooler output [B, H], first token [B, H], first real token [B, H], mean
        of the real tokens [B, H] (``attention_mask`` [B, S] says which are real; None: all) or every token
        [B, S, H]."""
        head = getattr(self, name)
        backend = self.encoder.backend
        if isinstance(head, MaskedLMHead):
            return head(encoded.last_hidden_state, self.encoder.embeddings.word_embeddings, backend)
        source = self.sources[name]
        hidden = encoded.last_hidden_state
        if source == "pooler":
            x = encoded.pooler_output
        elif source == "first":
            x = encoded.first_position
        elif source == "first_real":  # transformers: argmax of the mask (position 0 for a row without tokens)
            first = (attention_mask.argmax(dim=-1) if attention_mask is not None
                     else torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device))
            x = hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
        elif source == "mean":
            if attention_mask is None:
                x = hidden.mean(dim=1)
            else:  # a select, not a product: nothing at a padded position reaches the mean
                real = attention_mask[..., None] != 0
                x = torch.where(real, hidden, hidden.new_zeros(())).sum(dim=1) / attention_mask.sum(
                    dim=1, keepdim=True).to(hidden.dtype)
        else:
            x = hidden
        return head(x, backend)


class ForMaskedLM(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False) -> MaskedLMOutput:
        """logits [B, S, V]; labels [B, S] token ids, -100 = not scored."""
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, reads_padding(attention_mask, labels))
        logits = self._head("mlm", encoded)
        loss = token_cross_entropy(logits, labels) if labels is not None else None
        return MaskedLMOutput(loss, logits, encoded.hidden_states)


class ForNextSentence(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False, next_sentence_label: MaybeTensor = None
                ) -> NextSentencePredictorOutput:
        """logits [B, 2]; labels (or next_sentence_label) [B]: 0 = sentence B follows A, 1 = random."""
        if labels is None:
            labels = next_sentence_label
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states)
        logits = self._head("nsp", encoded, attention_mask)
        loss = token_cross_entropy(logits, labels) if labels is not None else None
        return NextSentencePredictorOutput(loss, logits, encoded.hidden_states)


class ForPreTraining(TaskModel):
    """BERT (MLM + next sentence, head "nsp") or ALBERT (MLM + sentence order, head "sop")."""

    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False, next_sentence_label: MaybeTensor = None,
                sentence_order_label: MaybeTensor = None) -> PreTrainingOutput | SentenceOrderPreTrainingOutput:
        """prediction_logits [B, S, V] and the pair logits [B, 2]; the loss (sum of both) needs both labels."""
        sentence_order = "sop" in self.sources
        pair_label = sentence_order_label if sentence_order else next_sentence_label
        wrong = next_sentence_label if sentence_order else sentence_order_label
        if wrong is not None:
            expected = "sentence_order_label" if sentence_order else "next_sentence_label"
            raise ValueError(f"{self.config.model_type} pretraining takes {expected}, not the other pair label")
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, reads_padding(attention_mask, labels))
        prediction_logits = self._head("mlm", encoded)
        pair_logits = self._head("sop" if sentence_order else "nsp", encoded, attention_mask)
        loss = None
        if labels is not None and pair_label is not None:
            loss = token_cross_entropy(prediction_logits, labels) + token_cross_entropy(pair_logits, pair_label)
        if sentence_order:
            return SentenceOrderPreTrainingOutput(loss, prediction_logits, pair_logits, encoded.hidden_states)
        return PreTrainingOutput(loss, prediction_logits, pair_logits, encoded.hidden_states)


class ForReplacedTokenDetection(TaskModel):
    """ELECTRA's pretraining discriminator."""

    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False) -> DiscriminatorOutput:
        """logits [B, S]; labels [B, S] (1 = replaced), scored at real tokens only."""
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states)
        logits = self._head("discriminator", encoded).squeeze(-1)
        loss = discriminator_loss(logits, labels, attention_mask) if labels is not None else None
        return DiscriminatorOutput(loss, logits, encoded.hidden_states)


class ForSequenceClassification(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False) -> SequenceClassifierOutput:
        """logits [B, num_labels]; labels: int [B] (single label), float [B, L] (multi label) or float [B]
        (regression, num_labels == 1); config.problem_type overrides the choice."""
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states)
        logits = self._head("classifier", encoded, attention_mask)
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(logits, labels, self.config.problem_type)
        return SequenceClassifierOutput(loss, logits, encoded.hidden_states)


class ForTokenClassification(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False) -> TokenClassifierOutput:
        """logits [B, S, num_labels]; labels [B, S], -100 = not scored (give -100 at padding: a label at a padded
        position is scored as transformers scores it, on the padded form, slower)."""
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, reads_padding(attention_mask, labels))
        logits = self._head("classifier", encoded)
        loss = token_cross_entropy(logits, labels) if labels is not None else None
        return TokenClassifierOutput(loss, logits, encoded.hidden_states)


class ForQuestionAnswering(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, start_positions: MaybeTensor = None,
                end_positions: MaybeTensor = None, output_hidden_states: bool = False) -> QuestionAnsweringOutput:
        """start_logits, end_logits [B, S]; the loss needs start_positions and end_positions [B]. Like
        transformers, the softmax runs over all S positions, padding included: a call with the positions on a
        padded batch runs the padded form, which computes padded positions as transformers does."""
        spans = start_positions is not None or end_positions is not None
        encoded = self._encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_hidden_states, reads_padding(attention_mask, spans=spans))
        logits = self._head("qa_outputs", encoded)
        start_logits, end_logits = (part.squeeze(-1).contiguous() for part in logits.split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start_logits, end_logits, start_positions, end_positions)
        return QuestionAnsweringOutput(loss, start_logits, end_logits, encoded.hidden_states)


class ForMultipleChoice(TaskModel):
    def forward(self, input_ids: MaybeTensor = None, attention_mask: MaybeTensor = None,
                token_type_ids: MaybeTensor = None, position_ids: MaybeTensor = None,
                inputs_embeds: MaybeTensor = None, labels: MaybeTensor = None,
                output_hidden_states: bool = False) -> MultipleChoiceOutput:
        """Inputs [B, C, S] (inputs_embeds [B, C, S, E]); logits [B, C]; labels [B] (index of the right choice)."""
        source = input_ids if input_ids is not None else inputs_embeds
        if source is None:
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        if source.dim() != (3 if input_ids is not None else 4):
            raise ValueError("multiple choice takes input_ids [batch, choices, seq] (inputs_embeds [batch, choices, "
                             f"seq, embedding]), got {list(source.shape)}")
        num_choices = source.shape[1]

        def flat(x):
            return None if x is None else x.reshape(-1, *x.shape[2:])

        encoded = self._encode(flat(input_ids), flat(attention_mask), flat(token_type_ids), flat(position_ids),
                               flat(inputs_embeds), output_hidden_states)
        logits = self._head("classifier", encoded, flat(attention_mask)).view(-1, num_choices)
        loss = token_cross_entropy(logits, labels) if labels is not None else None
        return MultipleChoiceOutput(loss, logits, encoded.hidden_states)


def _model_class(task: str, heads: dict[str, MLMSpec | DenseSpec]) -> type[TaskModel]:
    if task == "pretraining" and "discriminator" in heads:  # ELECTRA's: no MLM, no sentence-pair head
        return ForReplacedTokenDetection
    return {
        "masked-lm": ForMaskedLM,
        "next-sentence": ForNextSentence,
        "pretraining": ForPreTraining,
        "sequence-classification": ForSequenceClassification,
        "token-classification": ForTokenClassification,
        "question-answering": ForQuestionAnswering,
        "multiple-choice": ForMultipleChoice,
    }[task]


# ------------------------------------------------------------------------------------------------- public
def build_task_model(config: FastBertConfig, task: str, backend: str = "auto") -> TaskModel:
    """An uninitialised task model (parameters hold garbage until loaded): ``model.encoder`` is a FastBertModel
    built with a pooler only where the task's head reads it. Raises ValueError for a task unknown or not offered
    by the family (the message lists the family's tasks)."""
    heads = _task_heads(config, task)
    return _model_class(task, heads)(config, heads, backend=backend)


def head_key_map(config: FastBertConfig, task: str) -> list[tuple[str, list[str]]]:
    """[(task model state_dict key, [HF checkpoint key])] for every head parameter (the pooler is the
    encoder's, mapped by `fastbert.loading.encoder_key_map`)."""
    pairs = []
    for name, spec in _task_heads(config, task).items():
        pairs += spec.key_map(name, config)
    return pairs


def redundant_checkpoint_keys(config: FastBertConfig, task: str) -> list[str]:
    """HF checkpoint keys of the task's heads that hold no weights of their own (tied copies: e.g.
    cls.predictions.decoder.weight, saved by `torch.save(model.state_dict())` and older checkpoints); loading
    skips them without calling them unused."""
    return [key for spec in _task_heads(config, task).values() for key in spec.redundant_keys(config)]
