"""What the batcher's worker runs: a tokenizer and a model, texts in, one row per text out.

- `EmbedEngine`: sentence embeddings through `fastbert.embedding.Embedder` (the numbers `fastbert embed` writes),
  pooled but not normalised, so that each request chooses its own normalisation.
- `ClassifyEngine`: a sequence-classification checkpoint (a cross-encoder reranker has one label): texts or
  (text, text) pairs in, logits out.

Tokenizing (`encode`) runs in the request's handler, so that a too-long input is refused before it queues (or cut
at the end the request names: TEI's ``truncation_direction``), and so is a text the tokenizer keeps nothing of (a
lone combining accent for an uncased BERT: `BlankInput`, blank as `fastbert embed` counts it); `run` runs in the
worker, on one batch of already tokenized inputs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastbert.common.resolve import DTYPES, UserError, model_error, resolve_device, resolve_model, resolve_precision
from fastbert.common.text import check_max_length, load_auto_tokenizer, read_tokenizer_file
from fastbert.config import FastBertConfig
from fastbert.embedding import Embedder, sentence_transformers_head
from fastbert.embedding.embedder import kept_nothing
from fastbert.loading import weight_files
from fastbert.serving.schemas import RequestError, blank_message

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TASKS = ("embed", "rerank", "classify")
Text = str | tuple[str, str]  # one text, or a (text, text) pair for a cross-encoder
DIRECTIONS = ("right", "left")  # which end of a too-long input truncation cuts


class InputTooLong(ValueError):
    """An input longer than the server's max input length, with truncation off."""

    def __init__(self, index: int, limit: int, can_truncate: bool = True, name: str | None = None):
        hint = ", or send truncate: true to cut it" if can_truncate else " (token ids are never cut)"
        super().__init__(f"{name or f'input {index}'} is longer than the maximum of {limit} tokens: shorten it{hint}")
        self.index, self.limit, self.can_truncate = index, limit, can_truncate

    def named(self, name: str) -> InputTooLong:
        """The same error naming the input as the request's body does ('source_sentence', 'sentences[1]')."""
        return InputTooLong(self.index, self.limit, self.can_truncate, name)


class BlankInput(RequestError):
    """An input the tokenizer keeps nothing of: it would embed (or score) as the special tokens alone, the same for
    every such text, so it is blank, as in `fastbert embed`; answered 422 as a blank text is (`schemas.check_text`).
    ``part``: which text of a (text, text) pair (0 or 1), None for a single text."""

    def __init__(self, index: int, why: str, part: int | None = None, name: str | None = None):
        if name is None:
            name = f"input {index}" + ("" if part is None else f" (the {('first', 'second')[part]} text of its pair)")
        super().__init__(blank_message(name, why))
        self.index, self.why, self.part = index, why, part

    def named(self, name: str) -> BlankInput:
        """The same error naming the input as the request's body does ('query', 'sentences[1]')."""
        return BlankInput(self.index, self.why, self.part, name)


def check_kept(items: Sequence[Text], kept_nothing: Callable[[list[str]], list[str | None]]) -> None:
    """BlankInput for the first text (or text of a pair) of ``items`` that ``kept_nothing`` (per text: None, or why
    the tokenizer keeps nothing of it) finds blank."""
    places = [(index, None if isinstance(item, str) else part, text) for index, item in enumerate(items)
              for part, text in enumerate((item,) if isinstance(item, str) else item)]
    for (index, part, _), why in zip(places, kept_nothing([text for _, _, text in places]), strict=True):
        if why is not None:
            raise BlankInput(index, why, part)


@dataclass
class Tokens:
    """One tokenized input: its ids and, for a model with token types, its type ids."""

    ids: list[int]
    types: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)


class EmbedEngine:
    """Mean (or cls) pooled embeddings [n, H] float32 of the model's checkpoint, unnormalised."""

    task = "embed"

    def __init__(self, model_dir: str | None, device: str | None, dtype: str | None, backend: str,
                 max_length: int | None):
        self.embedder = Embedder(model_dir, device=device, dtype=dtype, backend=backend, normalize=False,
                                 max_length=max_length, max_batch_tokens=1 << 30, length_option="--max-input-length")
        self.model_dir, self.config = self.embedder.model_dir, self.embedder.config
        self.device, self.dtype, self.max_length = self.embedder.device, self.embedder.dtype, self.embedder.max_length
        self.precision = self.embedder.precision  # float32, float16, bfloat16 or int8 ("auto" resolved)
        self.pooling = self.embedder.pooling
        # what a client gets by default on /v1/embeddings: what the checkpoint declares (all-MiniLM-L6-v2: on)
        declared = sentence_transformers_head(self.model_dir)[1]
        self.default_normalize = True if declared is None else declared
        self.dimension = self.config.hidden_size
        self.labels: list[str] = []
        self.prompts = checkpoint_prompts(self.model_dir)
        self.left = PairTokenizer(self.model_dir, self.max_length, "left")
        self.mlm: torch.nn.Module | None = None
        self.plain = plain_tokenizer(self.model_dir)

    def encode(self, texts: Sequence[Text], truncate: bool, direction: str = "right",
               originals: Sequence[str] | None = None) -> list[Tokens]:
        """Token ids of each text (special tokens added); InputTooLong for the first too-long one unless
        ``truncate``, which cuts it at the end ``direction`` names (right: the ids `fastbert embed` uses);
        BlankInput for the first one the tokenizer keeps nothing of (`Embedder.kept_nothing`, `fastbert embed`'s
        check: only the few texts without a letter, digit or symbol are tokenized for it). ``originals``: the
        texts before a prompt was put before them, which are the ones checked (default: ``texts``)."""
        check_kept(texts if originals is None else originals, self.embedder.kept_nothing)
        ids, truncated = self.embedder.tokenize(list(texts))
        check_lengths(truncated, ids, truncate, self.max_length)
        if direction == "left" and any(truncated):
            cut = [i for i, flag in enumerate(truncated) if flag]
            for i, row in zip(cut, self.left([texts[i] for i in cut])[0], strict=True):
                ids[i] = row
        return [Tokens(row) for row in ids]

    def with_prompt(self, texts: list[str], name: str | None) -> list[str]:
        """The texts with the checkpoint's prompt ``name`` (sentence-transformers' ``prompts``) put before each;
        RequestError for a name the checkpoint does not declare."""
        if name is None:
            return texts
        if name not in self.prompts:
            known = ", ".join(repr(p) for p in self.prompts) or "none"
            raise RequestError(f"prompt_name {name!r}: this model's prompts (config_sentence_transformers.json) are "
                             f"{known}")
        return [self.prompts[name] + text for text in texts]

    def check_ids(self, rows: Sequence[Sequence[int]]) -> list[Tokens]:
        """Token ids given by a client (OpenAI's token input): in the vocabulary and not too long."""
        vocab = self.config.vocab_size
        for index, row in enumerate(rows):
            if len(row) > self.max_length:
                raise InputTooLong(index, self.max_length, can_truncate=False)
            if not row or min(row) < 0 or max(row) >= vocab:
                raise RequestError(f"input {index}: token ids must be a non-empty list of integers in [0, {vocab})")
        return [Tokens(list(row)) for row in rows]

    def run(self, batch: Sequence[Tokens]) -> np.ndarray:
        return self.embedder.embed_batch([t.ids for t in batch]).numpy()

    def token_embeddings(self, batch: Sequence[Tokens]) -> list[np.ndarray]:
        """The last hidden states [len(t), H] float32 of each input, special tokens included (TEI's /embed_all,
        sentence-transformers' ``output_value="token_embeddings"``): what the pooling averages."""
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.ids) for t in batch], batch_first=True,
                                              padding_value=self.config.pad_token_id)
        lengths = [len(t) for t in batch]
        mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
        inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.config.type_vocab_size:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            hidden = self.embedder.model(**inputs).last_hidden_state.float().cpu().numpy()
        return [hidden[i, :n] for i, n in enumerate(lengths)]

    def has_mlm_head(self) -> bool:
        """Whether the checkpoint holds a masked-LM head's weights (what /embed_sparse needs)."""
        return checkpoint_has_mlm_head(self.model_dir)

    def sparse(self, batch: Sequence[Tokens]) -> list[tuple[np.ndarray, np.ndarray]]:
        """SPLADE: log(1 + relu(MLM logits)) max-pooled over each input's tokens, as (vocabulary ids, values) of
        its non-zero entries. The masked-LM model is loaded at the first call."""
        if self.mlm is None:
            import fastbert

            self.mlm = fastbert.from_pretrained(self.model_dir, task="masked-lm", device=self.device,
                                                dtype=self.dtype).eval()
        out = []
        with torch.inference_mode():
            for tokens in batch:  # one at a time: [len, vocab] logits per text are large
                logits = self.mlm(input_ids=torch.tensor([tokens.ids], device=self.device)).logits[0].float()
                weights = torch.log1p(torch.relu(logits)).amax(dim=0).cpu()
                index = torch.nonzero(weights > 0).flatten()
                out.append((index.numpy(), weights[index].numpy()))
        return out


    def tokenize_details(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[dict]]:
        """TEI's /tokenize: per text, each token's id, text, whether it is special, and its character span in the
        text (none for a special token); not truncated."""
        tokenizer = self.require_plain()
        answers = []
        for text, encoding in zip(texts, tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens),
                                  strict=True):
            row = []
            for token_id, token, special, (start, stop) in zip(encoding.ids, encoding.tokens,
                                                               encoding.special_tokens_mask, encoding.offsets,
                                                               strict=True):
                row.append({"id": token_id, "text": token if special else text[start:stop], "special": bool(special),
                            "start": None if special else start, "stop": None if special else stop})
            answers.append(row)
        return answers

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool) -> list[str]:
        """TEI's /decode: the text of each row of ids; RequestError for an id outside the vocabulary."""
        tokenizer = self.require_plain()
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        for index, row in enumerate(rows):
            if any(i >= size for i in row):
                raise RequestError(f"input {index}: token ids must lie in [0, {size})")
        return tokenizer.decode_batch([list(row) for row in rows], skip_special_tokens=skip_special_tokens)

    def require_plain(self) -> Tokenizer:
        if self.plain is None:
            raise RequestError(f"{self.model_dir} has no tokenizer.json: /tokenize and /decode need one")
        return self.plain


class ClassifyEngine:
    """Logits [n, num_labels] float32 of a sequence-classification checkpoint, for texts or pairs."""

    def __init__(self, task: str, model_dir: str | None, device: str | None, dtype: str | None, backend: str,
                 max_length: int | None):
        import fastbert

        self.task = task
        # the quick checks first: the checkpoint, its tokenizer and the length, then the dtype (auto may measure),
        # then the model
        self.model_dir, self.config, self.max_length, self.tokenizers = pair_tokenizers(model_dir, max_length)
        self.device = resolve_device(device)
        self.precision = resolve_precision(dtype or "float32", self.device)  # auto resolved and announced here
        self.dtype = DTYPES["float32" if self.precision == "int8" else self.precision]
        try:
            self.model = fastbert.from_pretrained(self.model_dir, task="sequence-classification",
                                                  dtype="int8" if self.precision == "int8" else self.dtype,
                                                  device=self.device, backend=backend, require_head=True).eval()
        except ValueError as err:  # CheckpointError (no head), an unsupported family
            raise model_error(self.model_dir, err) from err
        self.labels = checkpoint_labels(self.model_dir, self.config.num_labels)
        if task == "rerank" and len(self.labels) != 1:
            raise UserError(f"{self.model_dir} has {len(self.labels)} labels; a reranker (cross-encoder) has one")
        self.dimension = len(self.labels)
        self.prompts: dict[str, str] = {}  # a classifier takes none

    def encode(self, texts: Sequence[Text], truncate: bool, direction: str = "right",
               originals: Sequence[Text] | None = None) -> list[Tokens]:
        """Token ids (and type ids) of each text or pair; InputTooLong for the first too-long one unless
        ``truncate``; BlankInput for the first text (of a pair too) the tokenizer keeps nothing of."""
        check_kept(texts if originals is None else originals, self.kept_nothing)
        ids, types, truncated = self.tokenizers[direction](texts)
        check_lengths(truncated, ids, truncate, self.max_length)
        keep_types = bool(self.config.type_vocab_size)
        return [Tokens(i, t if keep_types else None) for i, t in zip(ids, types, strict=True)]

    def kept_nothing(self, texts: Sequence[str]) -> list[str | None]:
        """`fastbert.embedding.embedder.kept_nothing` with this model's tokenizer (each text alone, not in its
        pair)."""
        tokenizer = self.tokenizers["right"]
        return kept_nothing(texts, lambda chosen: tokenizer(chosen)[0],
                            lambda ids: list(ids) == list(tokenizer([""])[0][0]))  # ([CLS] [SEP] alone)

    def run(self, batch: Sequence[Tokens]) -> np.ndarray:
        pad = self.config.pad_token_id
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.ids) for t in batch], batch_first=True,
                                              padding_value=pad)
        lengths = torch.tensor([len(t) for t in batch])
        inputs = {"input_ids": ids, "attention_mask": (torch.arange(ids.shape[1]) < lengths[:, None]).long()}
        if batch[0].types is not None:
            inputs["token_type_ids"] = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.types) for t in batch],
                                                                       batch_first=True)
        with torch.inference_mode():
            logits = self.model(**{k: v.to(self.device) for k, v in inputs.items()}).logits
        return logits.float().cpu().numpy()


def pair_tokenizers(model_dir: str | None, max_length: int | None
                    ) -> tuple[str, FastBertConfig, int, dict[str, PairTokenizer]]:
    """(checkpoint directory, config, max input length, tokenizer per truncation direction) of a classifier;
    UserError for a length out of the model's range or without room for a pair's texts beside the special
    tokens."""
    model_dir, config = resolve_model(model_dir)
    limit = config.token_positions
    max_length = limit if max_length is None else max_length
    # built at the model's limit, a length that is always valid, to count the special tokens; then cut to the one
    # asked for once it is checked
    tokenizers = {d: PairTokenizer(model_dir, limit, d) for d in DIRECTIONS}
    # a request may hold pairs, which need room for a token of each text
    check_max_length(max_length, tokenizers["right"].tokenizer, limit, "--max-input-length", pair=True)
    for tokenizer in tokenizers.values():
        tokenizer.truncate_at(max_length)
    return model_dir, config, max_length, tokenizers


class PairTokenizer:
    """A checkpoint's tokenizer for texts and (text, text) pairs, truncating to ``max_length`` (longest first) at
    the end ``direction`` names (right or left)."""

    def __init__(self, model_dir: str, max_length: int, direction: str = "right"):
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        self.direction = direction
        self.fast = read_tokenizer_file(model_dir)
        if self.fast is not None:
            self.fast.no_padding()
        else:
            self.fast, self.slow = None, load_auto_tokenizer(model_dir, truncation_side=direction)
        self.truncate_at(max_length)

    def truncate_at(self, max_length: int) -> None:
        """Cut what is longer than ``max_length`` tokens from now on."""
        self.max_length = max_length
        if self.fast is not None:
            self.fast.enable_truncation(max_length=max_length, direction=self.direction)

    @property
    def tokenizer(self) -> Any:
        """The tokenizers library's tokenizer, else transformers'."""
        return self.fast if self.fast is not None else self.slow

    def __call__(self, texts: Sequence[Text]) -> tuple[list[list[int]], list[list[int]], list[bool]]:
        """(ids, type ids, truncated) per text or pair."""
        if self.fast is not None:
            encodings = self.fast.encode_batch(list(texts))
            return [e.ids for e in encodings], [e.type_ids for e in encodings], [bool(e.overflowing)
                                                                                for e in encodings]
        ids: list[list[int]] = [[] for _ in texts]
        types: list[list[int]] = [[] for _ in texts]
        truncated = [False] * len(texts)
        # transformers takes a batch of single texts or a batch of pairs, not both: a batch of the server's
        # requests may hold both
        for paired in (False, True):
            where = [i for i, t in enumerate(texts) if isinstance(t, tuple) == paired]
            if not where:
                continue
            first = [texts[i][0] if paired else texts[i] for i in where]
            second = [texts[i][1] for i in where] if paired else None
            full = self.slow(first, second, truncation=False)["input_ids"]
            out = self.slow(first, second, truncation=True, max_length=self.max_length)
            for row, i in enumerate(where):
                ids[i] = out["input_ids"][row]
                types[i] = out["token_type_ids"][row] if "token_type_ids" in out else [0] * len(ids[i])
                truncated[i] = len(full[row]) > self.max_length
        return ids, types, truncated


def plain_tokenizer(model_dir: str) -> Tokenizer | None:
    """The checkpoint's tokenizer.json without truncation or padding (what /tokenize and /decode show), or None."""
    tokenizer = read_tokenizer_file(model_dir)
    if tokenizer is None:
        return None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def checkpoint_has_mlm_head(model_dir: str) -> bool:
    """Whether the checkpoint's weights (safetensors or pytorch_model.bin, one file or shards) hold a masked-LM
    head; the tensors' names are read, not their data."""
    names: list[str] = []
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                names += list(f.keys())
        else:
            names += list(torch.load(path, map_location="meta", weights_only=True))
    heads = ("cls.predictions.", "lm_head.", "decoder.", "vocab_projector.")  # BERT, RoBERTa, ModernBERT, DistilBERT
    return any(name.startswith(heads) for name in names)


def check_lengths(truncated: Sequence[bool], ids: Sequence[list[int]], truncate: bool, limit: int) -> None:
    """InputTooLong for the first truncated input when the client did not ask for truncation."""
    if truncate:
        return
    for index, cut in enumerate(truncated):
        if cut:
            raise InputTooLong(index, limit)


def checkpoint_prompts(model_dir: str) -> dict[str, str]:
    """The prompts of a sentence-transformers checkpoint (``prompts`` in config_sentence_transformers.json): name to
    the text put before an input; {} when it declares none."""
    path = os.path.join(model_dir, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        prompts = json.load(f).get("prompts") or {}
    return {str(name): str(text) for name, text in prompts.items()}


def checkpoint_labels(model_dir: str, num_labels: int) -> list[str]:
    """The label names of config.json's ``id2label`` in id order, else LABEL_0, LABEL_1, ..."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    names = raw.get("id2label") or {}
    count = raw.get("num_labels") or len(names) or num_labels
    return [str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(count)]


def check_engine_settings(task: str, model_dir: str | None = None, max_length: int | None = None) -> int:
    """What an engine of ``task`` checks before its dtype and model (the checkpoint, its tokenizer, the input
    length), for a process that loads no model yet: `fastbert serve --ray`'s driver, whose replicas would otherwise
    fail inside Ray Serve, and a `Service` before it loads its engine. The max input length the engine will have
    (``max_length``, else the checkpoint's default)."""
    if task not in TASKS:
        raise UserError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "embed":
        return Embedder(model_dir, max_length=max_length, length_option="--max-input-length",
                        load_model=False).max_length
    return pair_tokenizers(model_dir, max_length)[2]


def load_engine(task: str, model_dir: str | None = None, device: str | None = None, dtype: str | None = None,
                backend: str = "auto", max_length: int | None = None) -> EmbedEngine | ClassifyEngine:
    """The engine of a task: ``embed`` (sentence embeddings), ``rerank`` or ``classify``."""
    if task not in TASKS:
        raise UserError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    if task == "embed":
        return EmbedEngine(model_dir, device, dtype, backend, max_length)
    return ClassifyEngine(task, model_dir, device, dtype, backend, max_length)
