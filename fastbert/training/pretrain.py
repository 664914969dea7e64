"""Pretraining a small BERT (or RoBERTa / ALBERT) from scratch on real text, offline: `pretrain` with a
`PretrainSettings` from Python, or ``fastbert pretrain`` (`fastbert.cli.pretrain`; options named below).

- Corpus: CPython's reference documentation as it ships with every Python (``pydoc_data.topics``: one document per
  topic; ``--corpus cpython`` adds the standard library's docstrings, one document per module), or text files named
  on the command line (a blank line ends a document). Documents are split into sentences (paragraphs, then
  ``. ! ?`` followed by a capital letter). 5 % of the documents, chosen at random, are held out whole for
  evaluation (with fewer than 20 documents: the last 5 % of the sentences of each document of 10 or more).
- Vocabulary, trained with the ``tokenizers`` library on the training sentences and saved as a transformers fast
  tokenizer (``AutoTokenizer.from_pretrained`` loads it): WordPiece for bert and albert (lower-cased, BERT's
  normaliser and pre-tokeniser, ``[PAD] [UNK] [CLS] [SEP] [MASK]``); for roberta a byte-level BPE as RoBERTa's
  (no normaliser, no lower-casing, every byte in the base alphabet so no text is unknown and
  ``decode(encode(text)) == text``; ``<s> <pad> </s> <unk> <mask>`` with ids 0-4, as RoBERTa numbers them).
- Objectives (``--objective``):
    - ``bert`` (default): ``[CLS] A [SEP] B [SEP]`` with segment ids, masked LM (15 %, 80/10/10) + next-sentence
      prediction, B the following segment or one from another document 50/50; ``BertForPreTraining``.
    - ``roberta``: one segment (or, with ``--pack``, consecutive sentences across documents up to the max length,
      ``[SEP]`` between documents), masked LM only, no NSP, no segment ids; ``RobertaForMaskedLM`` (RoBERTa's
      architecture: positions offset past the padding id, one token type) over a byte-level BPE vocabulary.
    - ``albert``: sentence-order prediction (two consecutive segments, in order or swapped 50/50) + masked LM;
      ``AlbertForPreTraining`` (factorised embeddings, one shared layer).
  Masks are drawn afresh every time a batch is formed (dynamic masking) for every objective, seeded by (seed,
  epoch, batch) so a resumed run sees the same masks. ``--whole-word-masking`` chooses words (a token and its
  ``##`` continuations; with BPE, a token and those after it up to the next one that follows a space) instead of
  tokens. ``--pack`` fills sequences: for bert/albert each segment is a run of consecutive sentences up to half
  the max length (BERT's original recipe), for roberta see above.
- The model is a transformers class built from a small default config (H=256, 4 layers, 4 heads; ``--config``
  a JSON file of config fields, or the size options), passed through `fastbert.optimize` so training runs on
  fastbert's path where it can (it says with a warning when a call runs transformers' code).
- Training: `fastbert.training.loop` (AdamW, warmup + linear decay, clipping, checkpoints every ``--save-every``
  steps in HF format with the tokenizer, written atomically, ``--resume``); the output directory also gets
  ``metrics.jsonl``, ``loss_curve.png`` (rewritten at each checkpoint) and, at the end, ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from fastbert.common.resolve import UserError
from fastbert.common.text import load_auto_tokenizer
from fastbert.files import replace_atomic, temporary_path, write_atomic
from fastbert.training import curves
from fastbert.training.corpus import run_documents
from fastbert.training.loop import (
    StepOutput,
    TrainingArguments,
    TrainingTask,
    TrainResult,
    latest_checkpoint,
    train,
)
from fastbert.training.masking import (
    IGNORE_INDEX,
    SentencePair,
    encode_pair,
    mask_tokens,
    next_sentence_pairs,
    sentence_order_pairs,
)
from fastbert.training.settings import RunSettings, check_number, run_model_hint

if TYPE_CHECKING:
    from matplotlib.axes import Axes  # matplotlib is optional and imported where a curve is drawn
    from transformers import (  # transformers too, imported where a tokenizer, config or model is built
        BertTokenizerFast,
        PretrainedConfig,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
        RobertaTokenizerFast,
    )

OBJECTIVES = ("bert", "roberta", "albert")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BPE_SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # RoBERTa's, in its id order
# A byte-level BPE holds every byte, whatever its size: --vocab-size below this cannot be trained (roberta)
BPE_MIN_VOCAB = 256 + len(BPE_SPECIAL_TOKENS)
BYTE_LEVEL_SPACE = "\u0120"  # how byte-level BPE writes the space byte: a token that starts a word after a space
# The small default model: a few minutes on two CPU cores teach it something.
DEFAULT_SIZES = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 1024}
DEFAULT_MAX_LENGTH = 128  # tokens per sequence when --max-length is not given (fewer if the --config's positions are)


# ------------------------------------------------------------------------------------------------ held out
WHOLE_DOCUMENTS_FROM = 20  # with at least this many documents, whole documents are held out


def hold_out(documents: list[list[str]], fraction: float, seed: int = 0) -> tuple[list[list[str]], list[list[str]]]:
    """(training documents, held-out documents), in their original order. With at least `WHOLE_DOCUMENTS_FROM`
    documents, ``fraction`` of the documents (at least two, chosen at random from ``seed``) are held out whole:
    the model never sees their text. With fewer, the last ``fraction`` of the sentences of every document with at
    least 10 sentences (at least two each, so they form a pair) are held out instead."""
    if fraction <= 0:
        return list(documents), []
    if len(documents) >= WHOLE_DOCUMENTS_FROM:
        count = max(2, round(len(documents) * fraction))
        chosen = set(random.Random(f"held-out/{seed}").sample(range(len(documents)), count))
        return ([doc for i, doc in enumerate(documents) if i not in chosen],
                [doc for i, doc in enumerate(documents) if i in chosen])
    train_docs, held = [], []
    for doc in documents:
        count = max(2, int(len(doc) * fraction)) if len(doc) >= 10 else 0
        train_docs.append(doc[:len(doc) - count] if count else doc)
        if count:
            held.append(doc[len(doc) - count:])
    return train_docs, held


# ----------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(documents: list[list[str]], vocab_size: int, max_length: int, lowercase: bool = True,
                    objective: str = "bert") -> PreTrainedTokenizerFast:
    """The objective's vocabulary trained on the documents' sentences: byte-level BPE for roberta
    (`train_byte_level_bpe`), else WordPiece (`train_wordpiece`)."""
    if objective == "roberta":
        return train_byte_level_bpe(documents, vocab_size, max_length)
    return train_wordpiece(documents, vocab_size, max_length, lowercase)


def train_byte_level_bpe(documents: list[list[str]], vocab_size: int, max_length: int) -> RobertaTokenizerFast:
    """RoBERTa's kind of vocabulary: a byte-level BPE trained on the documents' sentences, as a transformers fast
    tokenizer (RobertaTokenizerFast; specials <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4; a sequence is
    ``<s> A </s>``, a pair ``<s> A </s></s> B </s>``). The 256 byte symbols are all in the base alphabet, so any
    text encodes without <unk> and decodes back to itself (no clean-up of spaces before punctuation)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import RobertaTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # <mask> takes the space before it, as RoBERTa's does, so "the <mask> is" masks the word " cat" stood for
    specials = [*BPE_SPECIAL_TOKENS[:-1], AddedToken(BPE_SPECIAL_TOKENS[-1], lstrip=True, special=True)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((s for doc in documents for s in doc), trainer)
    backend.post_processor = processors.RobertaProcessing(
        ("</s>", backend.token_to_id("</s>")), ("<s>", backend.token_to_id("<s>")), add_prefix_space=False,
        trim_offsets=True)
    return RobertaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                add_prefix_space=False, clean_up_tokenization_spaces=False,
                                model_max_length=max_length)


def train_wordpiece(documents: list[list[str]], vocab_size: int, max_length: int,
                    lowercase: bool = True) -> BertTokenizerFast:
    """A WordPiece vocabulary trained on the documents' sentences, as a transformers fast tokenizer
    (BertTokenizerFast; specials [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4; pairs get token types 0/1). The same
    sentences give the same vocabulary, ids included, in every process (`wordpiece_vocabulary`)."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import BertTokenizerFast

    vocab = wordpiece_vocabulary([s for doc in documents for s in doc], vocab_size, lowercase)
    # the model WordPieceTrainer would have left, rebuilt from the vocabulary alone (its special tokens were many)
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", continuing_subword_prefix="##",
                                         max_input_chars_per_word=100))
    _bert_pipeline(backend, lowercase)
    backend.add_special_tokens(list(SPECIAL_TOKENS))  # in the vocabulary already: they keep ids 0-4
    backend.decoder = decoders.WordPiece()
    cls_id, sep_id = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id),
                                                                                     ("[SEP]", sep_id)])
    return BertTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]",
                             cls_token="[CLS]", mask_token="[MASK]", do_lower_case=lowercase,
                             model_max_length=max_length)


def _bert_pipeline(backend: Any, lowercase: bool) -> None:
    """BERT's normaliser and pre-tokeniser on a `tokenizers.Tokenizer`: what WordPiece trains on and encodes."""
    from tokenizers import normalizers, pre_tokenizers

    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()


def wordpiece_vocabulary(sentences: Sequence[str], vocab_size: int, lowercase: bool = True) -> dict[str, int]:
    """token -> id: tokenizers' WordPieceTrainer on the sentences (BERT's normaliser and pre-tokeniser, its default
    min_frequency and alphabet), the same in every process. Left alone, the trainer numbers the alphabet in
    code-point order but each ``##c`` form (a character inside a word) when it first meets it in its word counts, a
    hash map whose order changes from process to process (huggingface/tokenizers#1794), and it breaks ties between
    equally frequent pairs by those ids: the vocabulary changed from run to run. So a first pass with no merges
    (vocab_size 0) lists the alphabet and the ``##c`` forms, and the real pass is given them as special tokens after
    the five, each group in code-point order: the trainer then numbers nothing itself but the tokens its merges make,
    in the order it makes them, and every merge is decided by counts and these fixed ids. The result has
    WordPieceTrainer's tokens and layout (specials, alphabet, ``##c`` forms, merges, as many); only which of equally
    frequent pairs merges first may differ from a given run of it. The first pass reads the text once more (about
    as long as the training itself on a few MB)."""
    from tokenizers import Tokenizer, models, trainers

    def train(special_tokens: list[str], size: int) -> dict[str, int]:
        backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        _bert_pipeline(backend, lowercase)
        trainer = trainers.WordPieceTrainer(vocab_size=size, special_tokens=special_tokens, show_progress=False)
        backend.train_from_iterator(sentences, trainer)
        return backend.get_vocab(with_added_tokens=False)

    found = set(train(list(SPECIAL_TOKENS), 0)).difference(SPECIAL_TOKENS)
    alphabet = sorted(token for token in found if len(token) == 1)  # one character each
    continuing = sorted(token for token in found if len(token) > 1)  # "##" and one character each
    return train([*SPECIAL_TOKENS, *alphabet, *continuing], vocab_size)


def continuation_table(tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """bool [vocab]: True for the tokens whole-word masking keeps with the token before them: WordPiece's ``##...``
    continuations; with a byte-level BPE (whose tokens that start a word after a space begin with ``Ġ``), every
    token that does not, special tokens aside (a word is what spaces delimit, RoBERTa's whole words)."""
    table = torch.zeros(len(tokenizer), dtype=torch.bool)
    byte_level = "<s>" in tokenizer.get_vocab() and tokenizer.cls_token == "<s>"
    special = set(tokenizer.all_special_tokens)
    for token, index in tokenizer.get_vocab().items():
        if (not token.startswith(BYTE_LEVEL_SPACE) and token not in special) if byte_level else token.startswith("##"):
            table[index] = True
    return table


# ------------------------------------------------------------------------------------------------- masking
def mask_whole_words(
    input_ids: torch.Tensor,
    continuation: torch.Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    special_tokens_mask: torch.Tensor,
    mlm_probability: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole-word masking of a batch [B, S]: each word (a token and the ``##`` continuations after it) is chosen
    with ``mlm_probability``; a chosen word's tokens all become [MASK] (80 %), all random tokens (10 %) or all stay
    (10 %). Returns (masked inputs, labels) like `fastbert.training.masking.mask_tokens`."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got {tuple(input_ids.shape)}")
    special = special_tokens_mask.bool()
    is_continuation = continuation.to(input_ids.device)[input_ids] & ~special
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    # each token's word start: the last position <= it that is not a continuation
    word_start = torch.where(is_continuation, torch.zeros_like(positions), positions).cummax(dim=1).values

    chosen = (_per_word_uniform(word_start, generator) < mlm_probability) & ~special
    fate = _per_word_uniform(word_start, generator)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=input_ids.device,
                               dtype=input_ids.dtype)
    inputs = torch.where(chosen & (fate < 0.8), torch.full_like(input_ids, mask_token_id), input_ids)
    inputs = torch.where(chosen & (fate >= 0.8) & (fate < 0.9), random_ids, inputs)
    return inputs, labels


def _per_word_uniform(word_start: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Uniform [0, 1) draws, one per token, that every token of a word takes from its word's first token."""
    return torch.rand(word_start.shape, generator=generator, device=word_start.device).gather(1, word_start)


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class DataOptions:
    """How examples are built (recorded in checkpoints; a resume must match)."""

    objective: str = "bert"
    max_length: int = 128
    batch_size: int = 32
    mlm_probability: float = 0.15
    whole_word_masking: bool = False
    pack: bool = False
    seed: int = 0


def _pack_segments(doc: list[list[int]], budget: int) -> list[list[int]]:
    """Consecutive sentences of one document joined while they fit ``budget`` tokens (a longer sentence alone)."""
    segments: list[list[int]] = []
    current: list[int] = []
    for sentence in doc:
        if current and len(current) + len(sentence) > budget:
            segments.append(current)
            current = []
        current = current + sentence
    if current:
        segments.append(current)
    return segments


def _pack_stream(documents: list[list[list[int]]], budget: int, sep_id: int) -> list[list[int]]:
    """RoBERTa's full sentences: consecutive sentences across documents (``[SEP]`` between documents) up to
    ``budget`` tokens; a sentence longer than the budget is cut into pieces."""
    sequences: list[list[int]] = []
    current: list[int] = []
    for doc_index, doc in enumerate(documents):
        pieces = [s[i:i + budget] for s in doc for i in range(0, max(len(s), 1), budget)]
        if doc_index and current:
            pieces = [[sep_id]] + pieces
        for piece in pieces:
            if current and len(current) + len(piece) > budget:
                sequences.append(current)
                current = []
            current = current + piece
            if current == [sep_id]:
                current = []
    if current:
        sequences.append(current)
    return sequences


class PretrainingData:
    """Tokenised documents and the examples of each epoch (pairs drawn and shuffled per epoch from the seed)."""

    def __init__(self, documents: list[list[list[int]]], options: DataOptions, *, cls_id: int, sep_id: int,
                 pad_id: int, mask_id: int, vocab_size: int, continuation: torch.Tensor | None = None):
        self.options = options
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = cls_id, sep_id, pad_id, mask_id
        self.vocab_size, self.continuation = vocab_size, continuation
        documents = [[s for s in doc if s] for doc in documents]
        documents = [doc for doc in documents if doc]
        if options.objective == "roberta":
            budget = options.max_length - 2
            self.sequences = (_pack_stream(documents, budget, sep_id) if options.pack
                              else [s[:budget] for doc in documents for s in doc])
            self.documents = documents
        else:
            budget = (options.max_length - 3) // 2
            self.documents = [_pack_segments(doc, budget) for doc in documents] if options.pack else documents

    def examples(self, epoch: int) -> list[dict[str, list[int]]]:
        """The encoded examples of an epoch, shuffled; a deterministic function of (seed, epoch)."""
        rng = random.Random(f"{self.options.seed}/{epoch}")
        if self.options.objective == "roberta":
            examples = [{"input_ids": [self.cls_id, *s, self.sep_id], "token_type_ids": [0] * (len(s) + 2),
                         "special_tokens_mask": [1, *(int(t == self.sep_id) for t in s), 1]} for s in self.sequences]
        else:
            if self.options.objective == "bert":
                if sum(1 for d in self.documents if d) < 2:
                    raise UserError("next-sentence pairs need at least two documents (separate them by a blank line)")
                pairs: list[SentencePair] = next_sentence_pairs(self.documents, rng)
            else:
                pairs = sentence_order_pairs(self.documents, rng)
            examples = []
            for pair in pairs:
                encoded: dict[str, Any] = encode_pair(pair, self.cls_id, self.sep_id, self.options.max_length)
                encoded["label"] = pair.label
                examples.append(encoded)
        rng.shuffle(examples)
        return examples

    def collate(self, examples: Sequence[dict[str, Any]], generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Pad a list of examples to their longest and mask them (token or whole-word masking)."""
        input_ids = _padded(examples, "input_ids", self.pad_id)
        attention_mask = _padded(examples, "input_ids", -1).ne(-1).long()
        special = _padded(examples, "special_tokens_mask", 1).bool()
        options = self.options
        if options.whole_word_masking:
            inputs, labels = mask_whole_words(input_ids, self.continuation, mask_token_id=self.mask_id,
                                              vocab_size=self.vocab_size, special_tokens_mask=special,
                                              mlm_probability=options.mlm_probability, generator=generator)
        else:
            inputs, labels = mask_tokens(input_ids, mask_token_id=self.mask_id, vocab_size=self.vocab_size,
                                         special_tokens_mask=special, mlm_probability=options.mlm_probability,
                                         generator=generator)
        batch = {"input_ids": inputs, "attention_mask": attention_mask, "labels": labels}
        if options.objective != "roberta":
            batch["token_type_ids"] = _padded(examples, "token_type_ids", 0)
            batch["pair_labels"] = torch.tensor([e["label"] for e in examples])
        return batch

    def epoch_batches(self, epoch: int) -> _EpochBatches:
        """The batches of an epoch (the last, incomplete one dropped unless it is the only one)."""
        return _EpochBatches(self, epoch, self.examples(epoch))

    def evaluation_batches(self, limit: int) -> list[dict[str, torch.Tensor]]:
        """Up to ``limit`` examples of epoch 0 as batches masked once, with a generator of their own: a held-out
        evaluation sees the same masks at every checkpoint."""
        examples = self.examples(epoch=0)[:limit]
        size = self.options.batch_size
        generator = torch.Generator().manual_seed(self.options.seed + 1)
        return [self.collate(examples[i:i + size], generator) for i in range(0, len(examples), size)]


def _padded(examples: Sequence[dict[str, Any]], key: str, fill: int) -> torch.Tensor:
    """[examples, longest input]: each example's ``key`` list, padded with ``fill``."""
    length = max(len(e["input_ids"]) for e in examples)
    return torch.tensor([list(e[key]) + [fill] * (length - len(e[key])) for e in examples])


class _EpochBatches(Sequence):
    """An epoch's batches, collated (and masked) on access: batch i's masks come from a generator seeded with
    (seed, epoch, i), so a resumed run that starts at batch i sees what an uninterrupted one saw."""

    def __init__(self, data: PretrainingData, epoch: int, examples: list[dict[str, Any]]):
        self.data, self.epoch, self.examples = data, epoch, examples
        size = data.options.batch_size
        self.count = max(len(examples) // size, 1 if examples else 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):  # type: ignore[override]
        if not 0 <= index < self.count:
            raise IndexError(index)
        size = self.data.options.batch_size
        seed = int.from_bytes(hashlib.sha256(f"{self.data.options.seed}/{self.epoch}/{index}".encode()).digest()[:8],
                              "little")
        return self.data.collate(self.examples[index * size:(index + 1) * size], torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------- model
def build_config(objective: str, tokenizer: PreTrainedTokenizerBase | VocabularyShape, max_length: int,
                 overrides: dict[str, Any]) -> PretrainedConfig:
    """The transformers config of the objective's model: the small default sizes, then ``overrides`` (a --config
    file's fields and the size options), with the vocabulary and special ids of ``tokenizer``."""
    from transformers import AlbertConfig, BertConfig, RobertaConfig

    fields: dict[str, Any] = dict(DEFAULT_SIZES)
    if objective == "albert":
        fields.update(embedding_size=128, hidden_act="gelu_new")
    fields.update(overrides)
    special = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    if objective == "roberta":
        # RoBERTa numbers positions from pad_token_id + 1
        fields.setdefault("max_position_embeddings", max_length + tokenizer.pad_token_id + 1)
        fields.setdefault("type_vocab_size", 1)
        return RobertaConfig(**{**fields, **special, "bos_token_id": tokenizer.cls_token_id,
                                "eos_token_id": tokenizer.sep_token_id})
    fields.setdefault("max_position_embeddings", max_length)
    config_class = AlbertConfig if objective == "albert" else BertConfig
    extra = {"bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id} \
        if objective == "albert" else {}
    return config_class(**{**fields, **special, **extra})


def build_model(objective: str, config: PretrainedConfig) -> torch.nn.Module:
    """BertForPreTraining, RobertaForMaskedLM or AlbertForPreTraining from ``config`` (random initialisation)."""
    from transformers import AlbertForPreTraining, BertForPreTraining, RobertaForMaskedLM

    model_class = {"bert": BertForPreTraining, "roberta": RobertaForMaskedLM, "albert": AlbertForPreTraining}
    return model_class[objective](config)


def _pretraining_losses(objective: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]
                        ) -> tuple[torch.Tensor, dict[str, float], dict[str, int]]:
    """(loss, metrics, counts) of one batch: masked-LM cross-entropy over the chosen tokens, plus NSP/SOP
    cross-entropy for bert/albert."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}
    out = model(**inputs)
    prediction = out.logits if objective == "roberta" else out.prediction_logits
    labels = batch["labels"]
    chosen = labels != IGNORE_INDEX
    # only the chosen positions go through the cross-entropy (the logits of the rest are not needed)
    mlm_logits = prediction[chosen].float()
    mlm_labels = labels[chosen]
    if mlm_labels.numel():
        mlm_loss = torch.nn.functional.cross_entropy(mlm_logits, mlm_labels)
    else:  # no token chosen in the whole batch: zero loss that still depends on the graph
        mlm_loss = prediction.sum() * 0.0
    mlm_correct = int((mlm_logits.argmax(-1) == mlm_labels).sum())
    metrics = {"mlm_loss": float(mlm_loss.detach()),
               "mlm_accuracy": mlm_correct / max(mlm_labels.numel(), 1)}
    counts = {"mlm_tokens": int(mlm_labels.numel()), "mlm_correct": mlm_correct}
    loss = mlm_loss
    if objective != "roberta":
        pair_logits = out.seq_relationship_logits if objective == "bert" else out.sop_logits
        name = "nsp" if objective == "bert" else "sop"
        pair_loss = torch.nn.functional.cross_entropy(pair_logits.float(), batch["pair_labels"])
        pair_correct = int((pair_logits.argmax(-1) == batch["pair_labels"]).sum())
        metrics[f"{name}_loss"] = float(pair_loss.detach())
        metrics[f"{name}_accuracy"] = pair_correct / len(batch["pair_labels"])
        counts.update(pairs=len(batch["pair_labels"]), pair_correct=pair_correct)
        loss = loss + pair_loss
    return loss, metrics, counts


class PretrainingTask(TrainingTask):
    """The `fastbert.training.loop` task of a pretraining run: batches from `PretrainingData`, MLM (+ NSP/SOP) losses,
    held-out evaluation, tokenizer files in each checkpoint, the loss curve at each checkpoint."""

    def __init__(self, data: PretrainingData, tokenizer: PreTrainedTokenizerBase, settings: dict[str, Any],
                 held_out: PretrainingData | None = None, eval_examples: int = 512):
        self.data, self.tokenizer, self._settings = data, tokenizer, settings
        self.objective = data.options.objective
        self.eval_batches = held_out.evaluation_batches(eval_examples) if held_out is not None else []

    def batches(self, epoch: int) -> Sequence[dict[str, torch.Tensor]]:
        """The epoch's batches (see `PretrainingData.epoch_batches`)."""
        return self.data.epoch_batches(epoch)

    def compute(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> StepOutput:
        """MLM (+ NSP/SOP) loss of one batch, its metrics and its real tokens."""
        loss, metrics, _ = _pretraining_losses(self.objective, model, batch)
        return StepOutput(loss, metrics, int(batch["attention_mask"].sum()))

    def settings(self) -> dict[str, Any]:
        """Data, objective, corpus fingerprint and model config: what a resume must match."""
        return self._settings

    def save(self, directory: Path) -> None:
        """The tokenizer files beside the model."""
        self.tokenizer.save_pretrained(directory)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out MLM loss and accuracy (over all chosen tokens) and NSP/SOP accuracy, with fixed masks."""
        if not self.eval_batches:
            return {}
        device = next(model.parameters()).device
        totals: dict[str, float] = {"mlm_loss_sum": 0.0, "mlm_tokens": 0, "mlm_correct": 0, "pairs": 0,
                                    "pair_correct": 0}
        for batch in self.eval_batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            _, metrics, counts = _pretraining_losses(self.objective, model, batch)
            totals["mlm_loss_sum"] += metrics["mlm_loss"] * counts["mlm_tokens"]
            for key in ("mlm_tokens", "mlm_correct", "pairs", "pair_correct"):
                totals[key] += counts.get(key, 0)
        found = {"eval_mlm_loss": totals["mlm_loss_sum"] / max(totals["mlm_tokens"], 1),
                 "eval_mlm_accuracy": totals["mlm_correct"] / max(totals["mlm_tokens"], 1)}
        if totals["pairs"]:
            name = "nsp" if self.objective == "bert" else "sop"
            found[f"eval_{name}_accuracy"] = totals["pair_correct"] / totals["pairs"]
            found["eval_pairs"] = totals["pairs"]
        return found

    def on_checkpoint(self, output_dir: Path, records: list[dict[str, Any]], final: bool) -> None:
        """Redraw loss_curve.png (and write summary.json at the end)."""
        plot_curve(records, output_dir / "loss_curve.png", self.objective)
        if final:
            write_atomic(output_dir / "summary.json", (json.dumps(summarize(records), indent=2) + "\n").encode())


# ---------------------------------------------------------------------------------------- curve, summary
def summarize(records: list[dict[str, Any]], window: int = curves.SUMMARY_WINDOW) -> dict[str, Any]:
    """First and last figures of a run: the mean training MLM loss and pair accuracy over the first and the last
    ``window`` steps, and the first and last held-out evaluation."""
    return curves.summarize_run(records, ("mlm_loss", "mlm_accuracy", "nsp_accuracy", "sop_accuracy"), window)


def plot_curve(records: list[dict[str, Any]], path: Path, objective: str) -> None:
    """Training MLM loss (and pair accuracy) against the step, with held-out points; written atomically."""
    steps, evals = curves.split_records(records)
    if not steps:
        return
    window = curves.curve_window(len(steps))
    x = [r["step"] for r in steps]
    with curves.curve_figure(path, f"fastbert pretrain ({objective})", columns=2) as loss_axis:
        loss_axis.plot(x, [r["mlm_loss"] for r in steps], color="tab:blue", alpha=0.25, linewidth=0.8)
        loss_axis.plot(x, curves.moving_average([r["mlm_loss"] for r in steps], window), color="tab:blue",
                       label=f"train MLM loss (mean of {window})")
        if evals:
            loss_axis.plot([r["step"] for r in evals], [r["eval_mlm_loss"] for r in evals], "o-", color="navy",
                           label="held-out MLM loss")
        loss_axis.set_xlabel("step")
        loss_axis.set_ylabel("MLM loss")
        pair = {"bert": "nsp_accuracy", "albert": "sop_accuracy"}.get(objective)
        if pair and pair in steps[0]:
            plot_pair_accuracy(loss_axis.twinx(), x, steps, evals, pair, window)


def plot_pair_accuracy(axis: Axes, x: list[int], steps: list[dict[str, Any]], evals: list[dict[str, Any]],
                       pair: str, window: int) -> None:
    """The training (moving average) and held-out accuracy of the sentence-pair task ``pair`` on ``axis``."""
    name = pair.replace("_", " ")
    axis.plot(x, curves.moving_average([r[pair] for r in steps], window), color="tab:orange",
              label=f"train {name} (mean of {window})")
    if evals and f"eval_{pair}" in evals[0]:
        axis.plot([r["step"] for r in evals], [r[f"eval_{pair}"] for r in evals], "s-", color="darkred",
                  label=f"held-out {name}")
    axis.set_ylim(0, 1)
    axis.axhline(0.5, color="gray", linestyle=":", linewidth=0.8)
    axis.set_ylabel(name)


# ----------------------------------------------------------------------------------------------------- run
@dataclass
class PretrainSettings(RunSettings):
    """One pretraining run (the options of ``fastbert pretrain``; see the module docstring)."""

    output_dir: str
    files: tuple[str, ...] = ()  # text files; none: a built-in corpus
    corpus: str | None = None  # without files: "pydoc" (the default) or "cpython"
    objective: str = "bert"
    whole_word_masking: bool = False
    pack: bool = False
    mlm_probability: float = 0.15
    max_length: int | None = None  # None: DEFAULT_MAX_LENGTH, or a --config's positions if fewer (`settle_max_length`)
    vocab_size: int = 8000
    tokenizer: str | None = None  # a transformers tokenizer directory instead of training one
    config: str | None = None  # a JSON file of model config fields
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    intermediate_size: int | None = None
    batch_size: int = 32
    max_steps: int = 1000
    learning_rate: float = 5e-4
    warmup_steps: int | None = None  # None: 10 % of max_steps
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    held_out: float = 0.05

    def check(self) -> None:
        """UserError naming the first setting that cannot run (by its command-line option)."""
        positive = {"--max-length": self.max_length, "--batch-size": self.batch_size, "--max-steps": self.max_steps,
                    "--vocab-size": self.vocab_size, "--hidden-size": self.hidden_size, "--num-layers": self.num_layers,
                    "--num-heads": self.num_heads, "--intermediate-size": self.intermediate_size}
        for name, value in positive.items():
            if value is not None and value < 1:
                raise UserError(f"{name} must be >= 1, got {value}")
        if self.max_length is not None and self.max_length < 8:
            raise UserError(f"--max-length must be >= 8, got {self.max_length}")
        trains_bpe = self.objective == "roberta" and self.tokenizer is None and not self.resume  # (resume: its own)
        if trains_bpe and self.vocab_size < BPE_MIN_VOCAB:
            raise UserError(f"--vocab-size must be >= {BPE_MIN_VOCAB} for --objective roberta (a byte-level BPE holds "
                            f"all 256 bytes and {len(BPE_SPECIAL_TOKENS)} special tokens), got {self.vocab_size}")
        if not 0 < self.mlm_probability < 1:
            raise UserError(f"--mlm-probability must be between 0 and 1, got {self.mlm_probability}")
        if not 0 <= self.held_out < 0.5:
            raise UserError(f"--held-out must be in [0, 0.5), got {self.held_out}")
        check_number("--learning-rate", self.learning_rate, strict=True)
        check_number("--weight-decay", self.weight_decay)
        check_number("--max-grad-norm", self.max_grad_norm)
        super().check()  # the run options: --threads, checkpoints, logging
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.max_steps:
            raise UserError("--warmup-steps must be between 0 and --max-steps")

    def data_options(self) -> DataOptions:
        """How this run builds its examples (with max_length settled: `settle_max_length`)."""
        assert self.max_length is not None
        return DataOptions(objective=self.objective, max_length=self.max_length, batch_size=self.batch_size,
                           mlm_probability=self.mlm_probability, whole_word_masking=self.whole_word_masking,
                           pack=self.pack, seed=self.seed)

    def training_arguments(self) -> TrainingArguments:
        """The `fastbert.training.loop` arguments of this run."""
        warmup = self.warmup_steps if self.warmup_steps is not None else self.max_steps // 10
        return TrainingArguments(output_dir=self.output_dir, max_steps=self.max_steps,
                                 learning_rate=self.learning_rate, weight_decay=self.weight_decay,
                                 warmup_steps=warmup, max_grad_norm=self.max_grad_norm, seed=self.seed,
                                 save_every=self.save_every, eval_every=self.eval_every, log_every=self.log_every,
                                 keep_checkpoints=self.keep_checkpoints, resume=self.resume, progress=self.progress)


def pretrain(settings: PretrainSettings, log: TextIO | None = None) -> TrainResult | None:
    """Run one pretraining (module docstring), with a description of it and a summary at the end on ``log``
    (default stderr). Returns the loop's result; None on the ranks other than 0 under torchrun.

    Raises `fastbert.common.resolve.UserError` for settings, files or a corpus that cannot be used and
    `fastbert.training.loop.TrainingError` for an output directory that holds another run or a resume that cannot
    continue."""
    log = log or sys.stderr
    device = settings.start(settings.output_dir)
    overrides = model_overrides(settings)
    settings = check_model_config(settings, overrides, log)
    documents = run_documents(settings.files, settings.corpus, "pydoc")
    train_docs, held_docs = hold_out(documents, settings.held_out, settings.seed)
    tokenizer = distributed_tokenizer(settings, train_docs)
    note = vocabulary_note(settings, tokenizer)
    if note and int(os.environ.get("RANK", "0")) == 0:
        log.write(note + "\n")
    data, held_out = build_data(settings, tokenizer, train_docs, held_docs)
    model, config = build_pretraining_model(settings, tokenizer, overrides, device)
    task = PretrainingTask(data, tokenizer, run_settings(settings, documents, tokenizer, config), held_out)
    if int(os.environ.get("RANK", "0")) == 0:
        log.write(describe_run(settings, model, config, tokenizer, train_docs, data, task, device) + "\n")
    result = _train_and_leave_the_group(model, task, settings.training_arguments())
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 reports for the whole run
        return None
    log.write(summary_text(result))
    return result


def model_overrides(settings: PretrainSettings) -> dict[str, Any]:
    """Model config fields over the small default: the --config file's, then the size options."""
    overrides = read_config_file(settings.config)
    for field_name, value in (("hidden_size", settings.hidden_size), ("num_hidden_layers", settings.num_layers),
                              ("num_attention_heads", settings.num_heads),
                              ("intermediate_size", settings.intermediate_size)):
        if value is not None:
            overrides[field_name] = value
    if settings.hidden_size is not None and settings.intermediate_size is None and "intermediate_size" not in overrides:
        overrides["intermediate_size"] = 4 * settings.hidden_size
    return overrides


def read_config_file(path: str | None) -> dict[str, Any]:
    """The model config fields of a JSON file (None: none), without the ones the tokenizer decides."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except FileNotFoundError as err:
        raise UserError(f"--config {path} does not exist") from err
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"--config {path} is not readable JSON: {err}") from err
    if not isinstance(fields, dict):
        raise UserError(f"--config {path} must hold a JSON object of config fields")
    for key in ("vocab_size", "pad_token_id"):
        fields.pop(key, None)  # the tokenizer decides these
    return fields


def load_or_train_tokenizer(settings: PretrainSettings, train_docs: list[list[str]]) -> PreTrainedTokenizerBase:
    """The run's tokenizer: on resume the latest checkpoint's (never retrained: a training is reproducible, see
    `wordpiece_vocabulary`, but the checkpoint's tokenizer is the one its weights were trained with, whatever made
    it); else --tokenizer's, else one trained on the training sentences. A new run keeps a copy in
    output_dir/tokenizer."""
    from transformers import AutoTokenizer

    output_dir = Path(settings.output_dir)
    if settings.resume:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise UserError(f"--resume: {output_dir} holds no checkpoint to resume from")
        return AutoTokenizer.from_pretrained(checkpoint)
    if settings.tokenizer is not None:
        tokenizer = load_given_tokenizer(settings.tokenizer)
    else:
        tokenizer = train_tokenizer(train_docs, settings.vocab_size, settings.data_options().max_length,
                                    objective=settings.objective)
    output_dir.mkdir(parents=True, exist_ok=True)
    saved = output_dir / "tokenizer"
    written = temporary_path(saved)
    tokenizer.save_pretrained(written)
    replace_atomic(written, saved)
    return tokenizer


def load_given_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    """A --tokenizer directory's tokenizer, which must have a vocabulary and the special tokens pretraining uses."""
    try:
        tokenizer = load_auto_tokenizer(directory, label=f"--tokenizer {directory}")
    except UserError as err:  # a run's output directory: its model directory holds the tokenizer
        raise UserError(f"{err}{run_model_hint(directory)}") from err
    missing = [name for name in ("pad_token", "cls_token", "sep_token", "mask_token")
               if getattr(tokenizer, name) is None]
    if missing:
        raise UserError(f"--tokenizer {directory} has no {', '.join(missing)}; pretraining needs [PAD], "
                        "[CLS], [SEP] and [MASK]")
    return tokenizer


def distributed_tokenizer(settings: PretrainSettings, train_docs: list[list[str]]) -> PreTrainedTokenizerBase:
    """The run's tokenizer; under torchrun (WORLD_SIZE > 1) rank 0 makes it and the other ranks load its copy, since
    two trainings of the vocabulary can differ."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return load_or_train_tokenizer(settings, train_docs)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if settings.device.startswith("cuda") else "gloo")
    tokenizer = load_or_train_tokenizer(settings, train_docs) if dist.get_rank() == 0 else None
    dist.barrier()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(Path(settings.output_dir) / "tokenizer")
    return tokenizer


def tokenize_documents(tokenizer: PreTrainedTokenizerBase, docs: list[list[str]]) -> list[list[list[int]]]:
    """Each document's sentences as token ids, without special tokens (sequences are cut to length later)."""
    flat = [s for doc in docs for s in doc]
    ids = tokenizer(flat, add_special_tokens=False, verbose=False)["input_ids"] if flat else []
    out, start = [], 0
    for doc in docs:
        out.append(ids[start:start + len(doc)])
        start += len(doc)
    return out


def build_data(settings: PretrainSettings, tokenizer: PreTrainedTokenizerBase, train_docs: list[list[str]],
               held_docs: list[list[str]]) -> tuple[PretrainingData, PretrainingData | None]:
    """The training data and the held-out data (None when there is too little held out to evaluate on)."""
    options = settings.data_options()
    special = dict(cls_id=tokenizer.cls_token_id, sep_id=tokenizer.sep_token_id, pad_id=tokenizer.pad_token_id,
                   mask_id=tokenizer.mask_token_id, vocab_size=len(tokenizer),
                   continuation=continuation_table(tokenizer))
    data = PretrainingData(tokenize_documents(tokenizer, train_docs), options, **special)
    held_out = None
    if len(held_docs) >= 2 or (held_docs and settings.objective != "bert"):
        held_out = PretrainingData(tokenize_documents(tokenizer, held_docs), options, **special)
    return data, held_out


class VocabularyShape:
    """What `build_config` reads of a tokenizer, before there is one: its size and special ids (as the tokenizer
    `train_tokenizer` makes for the objective numbers them)."""

    def __init__(self, objective: str, size: int):
        self.size = size
        self.pad_token_id, self.cls_token_id, self.sep_token_id = (1, 0, 2) if objective == "roberta" else (0, 2, 3)

    def __len__(self) -> int:
        return self.size


def vocabulary_note(settings: PretrainSettings, tokenizer: PreTrainedTokenizerBase) -> str:
    """A line for a vocabulary trained larger than --vocab-size ('' otherwise): a WordPiece vocabulary keeps every
    character of the training text, however small the size asked for (a byte-level BPE's least, every byte, is
    refused before any work: `PretrainSettings.check`)."""
    if settings.tokenizer is not None or settings.resume or len(tokenizer) <= settings.vocab_size:
        return ""
    return (f"fastbert pretrain: vocabulary {len(tokenizer)}, more than --vocab-size {settings.vocab_size}: WordPiece "
            f"keeps every character of the training text (and its ## form) besides its {len(SPECIAL_TOKENS)} special "
            "tokens")


def check_model_config(settings: PretrainSettings, overrides: dict[str, Any],
                       log: TextIO | None = None) -> PretrainSettings:
    """The settings with max_length settled (`settle_max_length`, saying on ``log`` when the default is cut);
    UserError for config fields transformers refuses or the run cannot train with, found before the corpus is read
    and the tokenizer trained and written (minutes of work, and a file left behind): the model is built on the meta
    device (no memory, no initialisation) with a stand-in for the tokenizer."""
    try:
        config = build_config(settings.objective, VocabularyShape(settings.objective, settings.vocab_size),
                              settings.max_length or DEFAULT_MAX_LENGTH, overrides)
        for field_name in DEFAULT_SIZES:  # transformers takes 0, then fails (zero division, oneDNN) or trains no layer
            if getattr(config, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(config, field_name)}")
        settings = settle_max_length(settings, config, log)
        check_config_fits_data(settings, config)
        with torch.device("meta"):
            build_model(settings.objective, config)
    except _config_errors() as err:  # (a --config with zero heads divides by 0)
        raise UserError(f"model config: {' '.join(str(err).split())}") from err
    return settings


def config_positions(objective: str, config: Any) -> int:
    """How many tokens a sequence of the config's model may hold (RoBERTa's positions start past the padding id)."""
    offset = config.pad_token_id + 1 if objective == "roberta" else 0
    return config.max_position_embeddings - offset


def settle_max_length(settings: PretrainSettings, config: Any, log: TextIO | None = None) -> PretrainSettings:
    """The settings with max_length set: --max-length as given (`check_config_fits_data` refuses one the config has
    no positions for), else DEFAULT_MAX_LENGTH, cut to the config's positions when it has fewer (a --config's
    max_position_embeddings) and said on ``log``; ValueError when they are fewer than a sequence needs (8)."""
    if settings.max_length is not None:
        return settings
    positions = config_positions(settings.objective, config)
    if positions >= DEFAULT_MAX_LENGTH:
        return replace(settings, max_length=DEFAULT_MAX_LENGTH)
    if positions < 8:
        raise ValueError(f"max_position_embeddings {config.max_position_embeddings} gives {positions} positions; a "
                         "sequence needs 8 at least")
    if log is not None and int(os.environ.get("RANK", "0")) == 0:
        log.write(f"fastbert pretrain: --max-length {DEFAULT_MAX_LENGTH} (the default) capped to the model config's "
                  f"{positions} positions\n")
    return replace(settings, max_length=positions)


def _config_errors() -> tuple[type[Exception], ...]:
    """What a config with a field of the wrong type or value raises: recent transformers check fields with
    huggingface_hub's strict dataclasses, whose errors are no ValueError."""
    errors: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError, ZeroDivisionError)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: transformers raises ValueError or TypeError
        return errors
    return (*errors, StrictDataclassError)


def check_config_fits_data(settings: PretrainSettings, config: Any) -> None:
    """ValueError when the model cannot read the run's examples: fewer positions than --max-length tokens (one
    given; the default is cut to them: `settle_max_length`), or fewer token types than the objective's segments
    (bert and albert: 2)."""
    assert settings.max_length is not None
    positions = config_positions(settings.objective, config)
    if positions < settings.max_length:
        fix = f"give --max-length {positions} or less" if positions >= 8 else "a sequence needs 8 at least"
        raise ValueError(f"max_position_embeddings {config.max_position_embeddings} gives {positions} positions, "
                         f"fewer than --max-length {settings.max_length}; {fix}")
    types = 1 if settings.objective == "roberta" else 2
    if config.type_vocab_size < types:
        raise ValueError(f"type_vocab_size must be >= {types} for the {settings.objective} objective, got "
                         f"{config.type_vocab_size}")


def build_pretraining_model(settings: PretrainSettings, tokenizer: PreTrainedTokenizerBase, overrides: dict[str, Any],
                            device: torch.device) -> tuple[torch.nn.Module, Any]:
    """(model on ``device``, its transformers config), initialised from the seed and passed through
    `fastbert.optimize` unless the settings say not to; UserError for config fields transformers refuses."""
    try:
        config = build_config(settings.objective, tokenizer, settings.data_options().max_length, overrides)
    except (TypeError, ValueError) as err:
        raise UserError(f"model config: {err}") from err
    torch.manual_seed(settings.seed)  # the initialisation is part of the run
    try:
        model = build_model(settings.objective, config)
    except (TypeError, ValueError) as err:
        raise UserError(f"model config: {err}") from err
    model.to(device)
    if settings.optimize:
        import fastbert

        model = fastbert.optimize(model, backend=settings.backend)
    return model, config


def corpus_fingerprint(documents: list[list[str]]) -> str:
    """A short hash of the documents' text: the corpus by its content (a file named by another path is the same
    corpus)."""
    digest = hashlib.sha256()
    for doc in documents:
        for sentence in doc:
            digest.update(sentence.encode())
            digest.update(b"\n")
        digest.update(b"\f")
    return digest.hexdigest()[:16]


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary's tokens in id order."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256("\n".join(token for token, _ in items).encode()).hexdigest()[:16]


def run_settings(settings: PretrainSettings, documents: list[list[str]], tokenizer: PreTrainedTokenizerBase,
                 config: PretrainedConfig) -> dict[str, Any]:
    """What a resume of this run must match: data options, corpus and vocabulary fingerprints, model config."""
    found = {"data": asdict(settings.data_options()),
             "corpus": "text files" if settings.files else settings.corpus or "pydoc",
             "corpus_sha256": corpus_fingerprint(documents), "held_out": settings.held_out,
             "vocab_size": len(tokenizer), "vocab_sha256": vocab_fingerprint(tokenizer),
             "model": json.loads(config.to_json_string(use_diff=False)), "optimized": settings.optimize,
             "backend": settings.backend}
    found["model"].pop("transformers_version", None)
    return found


def describe_run(settings: PretrainSettings, model: torch.nn.Module, config: PretrainedConfig,
                 tokenizer: PreTrainedTokenizerBase, train_docs: list[list[str]], data: PretrainingData,
                 task: PretrainingTask, device: torch.device) -> str:
    """The run's first line: model, vocabulary, data, objective, threads and device."""
    parameters = sum(p.numel() for p in model.parameters())
    pair_note = {"bert": "NSP", "albert": "SOP"}.get(settings.objective, "no pair task")
    return (f"fastbert pretrain: {type(model).__name__} ({parameters / 1e6:.2f} M parameters, "
            f"H={config.hidden_size}, {config.num_hidden_layers} layers), vocabulary {len(tokenizer)}, "
            f"{sum(len(d) for d in train_docs):,} training sentences in {len(train_docs)} documents "
            f"({len(data.epoch_batches(0))} batches of {settings.batch_size} per epoch), MLM + {pair_note}, "
            f"{len(task.eval_batches)} held-out batches, {torch.get_num_threads()} threads, {device}")


def _train_and_leave_the_group(model: torch.nn.Module, task: PretrainingTask, arguments: TrainingArguments
                               ) -> TrainResult:
    """`fastbert.training.loop.train`; under torchrun the process group (started for the tokenizer) is destroyed
    after it, however it ends."""
    try:
        return train(model, task, arguments)
    finally:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def summary_text(result: TrainResult) -> str:
    """The lines written at the end: the checkpoint, the summary's figures and the last held-out evaluation."""
    summary = summarize(result.records)
    figures = {k: v for k, v in summary.items() if isinstance(v, float)}
    lines = [f"fastbert pretrain: done at step {result.step} -> {result.checkpoint}\n"]
    for key, value in figures.items():
        lines.append(f"  {key}: {value:.4f}\n" if math.isfinite(value) else f"  {key}: {value}\n")
    if "eval_last" in summary:
        last = summary["eval_last"]
        lines.append("  held-out at step {}: {}\n".format(
            last["step"], ", ".join(f"{k} {v:.4f}" for k, v in last.items() if k.startswith("eval_"))))
    return "".join(lines)
