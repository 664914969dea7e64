"""The `Embedder`: a checkpoint's tokenizer and fastbert model, embedding lists of texts in the order given.

`Embedder.embed(texts)` tokenizes the texts, sorts them by length, cuts batches by a token budget
(`fastbert.embedding.batching.real_token_batches`), runs the padding-free encoder, pools (mean or cls),
normalises, and returns one row per text (NaN for a blank text: `fastbert.embedding.reading.is_blank`, or one the
tokenizer keeps nothing of) with the counts of the call."""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fastbert.common.resolve import UserError, model_error
from fastbert.common.text import check_max_length, load_auto_tokenizer, mean_pool, read_tokenizer_file
from fastbert.embedding.batching import real_token_batches
from fastbert.embedding.checkpoint import config_digest, default_max_length, sentence_transformers_head
from fastbert.embedding.reading import InputError, describe_characters, is_blank
from fastbert.embedding.stats import INVISIBLE_LINES_KEPT, TRUNCATED_LINES_KEPT, EmbedStats

POOLINGS = ("mean", "cls")
# CPU: smaller batches stay in cache (4096 measured ~6 % faster than 8192 on all-MiniLM-L6-v2, 2 cores); GPU:
# bigger batches fill the device.
DEFAULT_BATCH_TOKENS = {"cpu": 4096, "cuda": 16384}


class NonFiniteEmbedding(ValueError):
    """Rows (indices into the texts given) whose embedding holds NaN or Inf."""

    def __init__(self, rows: list[int]):
        super().__init__(f"non-finite embeddings at rows {rows[:10]}")
        self.rows = rows


def present_texts(texts: Sequence[str | None]) -> list[int]:
    """The indices of the texts to embed: all but None and blank ones (`fastbert.embedding.reading.is_blank`:
    whitespace and invisible characters only); TypeError for a lone string (a sequence of characters) or an item
    that is neither a string nor None."""
    if isinstance(texts, (str, bytes)):
        raise TypeError("embed takes a list of texts, not a single string: embed([text])")
    present = []
    for index, text in enumerate(texts):
        if text is not None and not isinstance(text, str):
            raise TypeError(f"text {index + 1} is a {type(text).__name__}, not a string (or None for a null row)")
        if not is_blank(text):
            present.append(index)
    return present


def may_tokenize_to_nothing(text: str) -> bool:
    """Whether a tokenizer might keep nothing of ``text``: it has no letter, digit, punctuation nor symbol other
    than U+FFFD, only marks (accents, which an uncased BERT strips), private-use characters, separators and the
    like. A cheap filter before tokenizing (it stops at the first letter: for most texts the first character)."""
    return all(unicodedata.category(c)[0] in "CMZ" or c == "\ufffd" for c in text)


def kept_nothing(texts: Sequence[str], tokenize: Callable[[list[str]], Sequence[Sequence[int]]],
                 special_only: Callable[[Sequence[int]], bool]) -> list[str | None]:
    """Per text, None when the tokenizer keeps something of it, else why it is blank: a text of only characters
    the tokenizer drops (a lone accent or private-use character for an uncased BERT) would be encoded as the special
    tokens alone, like a blank text, so it is one. Only the texts `may_tokenize_to_nothing` are tokenized
    (``tokenize``: token id lists of texts; ``special_only``: whether a list holds the special tokens alone)."""
    candidates = [i for i, text in enumerate(texts) if text and may_tokenize_to_nothing(text)]
    found: list[str | None] = [None] * len(texts)
    if candidates:
        for index, ids in zip(candidates, tokenize([texts[i] for i in candidates]), strict=True):
            if special_only(ids):
                found[index] = f"nothing the tokenizer keeps ({describe_characters(texts[index])})"
    return found


class Embedder:
    """A checkpoint's tokenizer and fastbert model, embedding lists of texts with token-budget batching.

    pooling: "mean" (over real tokens) or "cls" (the first token's vector); normalize: L2-normalise each embedding;
    both default to what the checkpoint's sentence-transformers files declare (``modules.json``, ``1_Pooling``,
    a Normalize module), else mean and normalised. max_length: tokens per text after truncation (default: the
    checkpoint's sentence-transformers ``max_seq_length``, else the model's limit); a longer text is truncated and
    counted.
    max_batch_tokens: a batch holds at most this many real tokens (texts sorted by length first; the encoder runs
    them packed, without padding); default `DEFAULT_BATCH_TOKENS` of the device, at least
    max_length. max_batch_size caps the texts per batch.
    load_model False (a Ray driver): read the checkpoint's settings and width only, the actors hold the models; the
    device may then be one only the actors have. cuda_graphs: on CUDA, batches replay CUDA graphs of the packed
    encoder (`fastbert.cuda_graphs`); False launches every op; nothing on CPU. length_option: how errors name
    max_length (the option of the command that builds the embedder)."""

    def __init__(self, model_dir: str | None = None, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, backend: str = "auto", pooling: str | None = None,
                 normalize: bool | None = None, max_length: int | None = None, max_batch_tokens: int | None = None,
                 max_batch_size: int | None = None, load_model: bool = True, cuda_graphs: bool = True,
                 length_option: str = "--max-length"):
        from fastbert.common.resolve import resolve_dtype, resolve_model

        self.model_dir, self.config = resolve_model(model_dir)
        # the quick checks before any slow step (a dtype's measuring, the model's loading) and anything printed
        self.max_length = self._max_length(max_length)
        if load_model:  # a directory without weights is the likelier mistake than its tokenizer
            self._check_weights()
        self._load_tokenizer(length_option)
        self.pooling, self.normalize = self._head(pooling, normalize)
        self.device = self._device(device, load_model)
        self.max_batch_tokens = self._max_batch_tokens(max_batch_tokens)
        if max_batch_size is not None and max_batch_size < 1:
            raise UserError("--batch-size must be >= 1")
        self.max_batch_size = max_batch_size
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).replace("torch.", "")
        # "int8" (CPU: int8 GEMMs) or a float dtype's name; "auto" resolved here (`fastbert.quantization`)
        self.precision = self._precision(dtype, load_model)
        self.dtype = resolve_dtype("float32" if self.precision == "int8" else self.precision, self.device)
        self.dimension = self.config.hidden_size
        self.uses_token_types = bool(self.config.type_vocab_size)
        self.cuda_graphs = cuda_graphs
        self.model = self._load_model(backend) if load_model else None

    def _head(self, pooling: str | None, normalize: bool | None) -> tuple[str, bool]:
        """The pooling and normalisation: as given, else as the checkpoint declares, else mean and normalised."""
        if pooling is None or normalize is None:
            declared_pooling, declared_normalize = (sentence_transformers_head(self.model_dir) if pooling is None
                                                    else (pooling, None))
            pooling = pooling or declared_pooling or "mean"
            if normalize is None:
                normalize = declared_normalize if declared_normalize is not None else True
        if pooling not in POOLINGS:
            raise UserError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        return pooling, normalize

    def _precision(self, dtype: str | None, load_model: bool) -> str:
        """The precision to run: as given, or for "auto" the float one `precision_for` picks, or int8 where it
        measured faster and accurate for this checkpoint (`fastbert.embedding.precision`; not on a Ray driver,
        which loads no model: its actors run what it resolved)."""
        from fastbert.embedding.precision import auto_precision
        from fastbert.quantization import precision_for

        considers_int8 = dtype == "auto" and load_model
        try:
            resolved, reason = precision_for(dtype or "float32", self.device, announce=not considers_int8)
        except ValueError as err:
            raise UserError(str(err)) from err
        return auto_precision(self.model_dir, resolved, reason, self.device) if considers_int8 else resolved

    @staticmethod
    def _device(device: str | torch.device | None, load_model: bool) -> torch.device:
        from fastbert.common.resolve import resolve_device

        if load_model:
            return resolve_device(None if device is None else str(device))
        return torch.device(str(device) if device is not None else "cpu")

    def _max_length(self, max_length: int | None) -> int:
        """As given, else the checkpoint's default (checked with the tokenizer, by `_load_tokenizer`)."""
        return max_length if max_length is not None else default_max_length(self.model_dir,
                                                                             self.config.token_positions)

    def _max_batch_tokens(self, max_batch_tokens: int | None) -> int:
        if max_batch_tokens is None:  # never below one longest text
            return max(DEFAULT_BATCH_TOKENS[self.device.type], self.max_length)
        if max_batch_tokens < self.max_length:
            raise UserError(f"--max-batch-tokens ({max_batch_tokens}) must be at least --max-length "
                            f"({self.max_length}): one text of the longest kind must fit in a batch")
        return max_batch_tokens

    def _check_weights(self) -> None:
        from fastbert.loading import weight_files

        try:
            weight_files(self.model_dir)
        except ValueError as err:  # CheckpointError: none, or a broken shard index
            raise model_error(self.model_dir, err) from err

    def _load_model(self, backend: str) -> torch.nn.Module:
        import fastbert

        try:
            dtype = "int8" if self.precision == "int8" else self.dtype
            return fastbert.from_pretrained(self.model_dir, dtype=dtype, device=self.device,
                                            backend=backend, cuda_graphs=self.cuda_graphs).eval()
        except ValueError as err:  # CheckpointError, an unsupported family
            raise model_error(self.model_dir, err) from err

    def _load_tokenizer(self, length_option: str) -> None:
        """The checkpoint's tokenizer.json through the tokenizers library, else transformers' AutoTokenizer; a
        max_length with no room for text beside its special tokens is an error."""
        tokenizer = read_tokenizer_file(self.model_dir)
        if tokenizer is not None:
            check_max_length(self.max_length, tokenizer, self.config.token_positions, length_option)
            tokenizer.no_padding()
            tokenizer.enable_truncation(max_length=self.max_length)
            self._tokenizer, self._hf_tokenizer = tokenizer, None
        else:
            self._hf_tokenizer = load_auto_tokenizer(self.model_dir)
            self._tokenizer = None
            check_max_length(self.max_length, self._hf_tokenizer, self.config.token_positions, length_option)

    def tokenize(self, texts: Sequence[str]) -> tuple[list[list[int]], list[bool]]:
        """Token ids of each text (special tokens added, truncated to max_length) and whether it was truncated."""
        if self._tokenizer is not None:
            encodings = self._tokenizer.encode_batch(list(texts))
            return [e.ids for e in encodings], [bool(e.overflowing) for e in encodings]
        full = self._hf_tokenizer(list(texts), truncation=False)["input_ids"]
        cut = self._hf_tokenizer(list(texts), truncation=True, max_length=self.max_length)["input_ids"]
        return cut, [len(ids) > self.max_length for ids in full]

    def _special_tokens_only(self, ids: Sequence[int]) -> bool:
        """Whether token ids are those of an empty text: the special tokens alone ([CLS] [SEP] for BERT)."""
        if getattr(self, "_empty_ids", None) is None:
            self._empty_ids = list(self.tokenize([""])[0][0])
        return len(ids) == len(self._empty_ids) and list(ids) == self._empty_ids

    def kept_nothing(self, texts: Sequence[str]) -> list[str | None]:
        """`kept_nothing` with this checkpoint's tokenizer."""
        return kept_nothing(texts, lambda chosen: self.tokenize(chosen)[0], self._special_tokens_only)

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Indices of the texts, longest first, cut into batches of at most max_batch_tokens real tokens (and at
        most max_batch_size texts)."""
        return real_token_batches(lengths, self.max_batch_tokens, self.max_batch_size)

    def embed_batch(self, token_lists: Sequence[list[int]]) -> torch.Tensor:
        """Pooled (and normalised) embeddings [n, H] float32 on the CPU of one batch of token lists: packed once
        on the host (`fastbert.packing.PackedBatch`) and encoded without padding; on CUDA with graphs, through the
        padded entry, which replays the captured packed graphs (`fastbert.cuda_graphs`)."""
        if self.device.type == "cuda" and self.cuda_graphs:
            return self._embed_padded(token_lists)
        from fastbert.packing import PackedBatch

        batch = PackedBatch.from_token_lists(self.config, token_lists, device=self.device)
        with torch.inference_mode():
            hidden = self.model.forward_packed(batch).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden.index_select(0, batch.cu_seqlens[:-1].long()).float()
            else:  # mean over each sequence's rows (fp32 sums), as sentence-transformers pools
                owner = torch.repeat_interleave(torch.arange(batch.batch_size), torch.tensor(batch.lengths))
                sums = hidden.new_zeros(batch.batch_size, hidden.shape[1], dtype=torch.float32)
                sums.index_add_(0, owner.to(hidden.device), hidden.float())
                pooled = sums / torch.tensor(batch.lengths, dtype=torch.float32, device=hidden.device)[:, None]
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu()

    def _embed_padded(self, token_lists: Sequence[list[int]]) -> torch.Tensor:
        """`embed_batch` through the model's [B, S] entry."""
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(tokens) for tokens in token_lists], batch_first=True,
                                              padding_value=self.config.pad_token_id)
        lengths = torch.tensor([len(tokens) for tokens in token_lists])
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.uses_token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state
            if self.pooling == "cls":
                pooled = hidden[:, 0].float()
                if self.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            else:
                pooled = mean_pool(hidden, inputs["attention_mask"], normalize=self.normalize)
        return pooled.cpu()

    def embed(self, texts: Sequence[str | None], lines: Sequence[int] | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> tuple[np.ndarray, EmbedStats]:
        """Embeddings [len(texts), H] float32 in the order given; a None or blank text (whitespace and invisible
        characters only, `fastbert.embedding.reading.is_blank`, or nothing the tokenizer keeps) gives a row of NaN
        (a null result), as a blank line does in `fastbert embed`; those that were more than whitespace are
        counted in ``stats.invisible``.
        ``lines`` (the texts' line numbers) name truncated and invisible texts in the stats and rows in errors. A
        real text whose embedding is not finite (an overflow in float16, say) raises `InputError` naming its lines.
        ``on_batch``: called after each batch with its texts and tokens (a progress line)."""
        try:
            embeddings, stats, per_row = self.embed_rows(texts, on_batch)
        except NonFiniteEmbedding as err:
            named = [lines[i] if lines is not None else i + 1 for i in err.rows]
            raise InputError(f"line{'s' if len(named) > 1 else ''} {', '.join(map(str, named[:10]))}: the embedding "
                             f"is not finite (NaN or Inf; with --dtype float16 try float32)") from err
        cut = np.flatnonzero(per_row["truncated"])
        stats.truncated_lines = [(lines[i] if lines is not None else int(i) + 1) for i in cut[:TRUNCATED_LINES_KEPT]]
        hidden = np.flatnonzero(per_row["invisible"])
        stats.invisible_lines = [(lines[i] if lines is not None else int(i) + 1)
                                 for i in hidden[:INVISIBLE_LINES_KEPT]]
        return embeddings, stats

    def embed_rows(self, texts: Sequence[str | None], on_batch: Callable[[int, int], None] | None = None
                   ) -> tuple[np.ndarray, EmbedStats, dict[str, np.ndarray]]:
        """`embed`, plus per row: ``tokens`` (int64, 0 for a null row), ``truncated`` (bool) and ``invisible``
        (bool: a null row whose text was more than whitespace)."""
        present = present_texts(texts)
        stats = EmbedStats(rows=len(texts))
        out = np.full((len(texts), self.dimension), np.nan, dtype=np.float32)
        per_row = {"tokens": np.zeros(len(texts), dtype=np.int64), "truncated": np.zeros(len(texts), dtype=bool),
                   "invisible": np.array([text is not None and text.strip() != "" for text in texts], dtype=bool)}
        token_lists, truncated = self.tokenize([texts[i] for i in present]) if present else ([], [])
        kept = [k for k, ids in enumerate(token_lists) if not self._special_tokens_only(ids)]
        if len(kept) < len(present):  # the others are blank too: the special tokens alone are no embedding of them
            present = [present[k] for k in kept]
            token_lists, truncated = [token_lists[k] for k in kept], [truncated[k] for k in kept]
        per_row["invisible"][present] = False
        stats.null_rows, stats.invisible = len(texts) - len(present), int(per_row["invisible"].sum())
        if not present:
            return out, stats, per_row
        lengths = [len(ids) for ids in token_lists]
        for batch in self.batches(lengths):
            out[[present[i] for i in batch]] = self.embed_batch([token_lists[i] for i in batch]).numpy()
            stats.batches += 1
            if on_batch is not None:
                on_batch(len(batch), sum(lengths[i] for i in batch))
        bad = [i for i in present if not np.isfinite(out[i]).all()]
        if bad:  # a NaN would read as a null row, and NaN/Inf is not JSON: never write one as an embedding
            raise NonFiniteEmbedding(bad)
        per_row["tokens"][present] = lengths
        per_row["truncated"][present] = truncated
        stats.embedded, stats.tokens, stats.truncated = len(present), sum(lengths), sum(truncated)
        return out, stats, per_row

    def settings(self) -> dict:
        """What determines the numbers written (a resumed run must match them)."""
        return {"model_dir": os.path.realpath(self.model_dir), "model_config": config_digest(self.model_dir),
                "dtype": self.precision, "pooling": self.pooling,
                "normalize": self.normalize, "max_length": self.max_length}
