"""Request bodies, as pydantic models: TEI's `/embed`, `/rerank`, `/predict` and OpenAI's `/v1/embeddings`.

Types are strict (a number is not a text, "yes" is not a boolean). TEI's bodies refuse unknown fields, so that a
misspelt option is an error rather than silently ignored; OpenAI's ignore them, as OpenAI's client libraries send
fields of their own (``user``, provider extras). What pydantic cannot say (an empty text, a text that is not valid
UTF-8, more inputs than the server takes) is checked by `texts_of`. A blank text is `fastbert embed`'s:
`fastbert.embedding.is_blank`, whitespace and invisible characters only (U+200B ZERO WIDTH SPACE, U+FEFF, NUL,
direction marks...); a text the tokenizer keeps nothing of is blank too, found where the engine tokenizes
(`fastbert.serving.engines.BlankInput`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from fastbert.embedding import invisible_note, is_blank

STRICT = ConfigDict(strict=True, extra="forbid")
# TEI's truncation_direction: which end of a too-long input is cut (with truncate: true); TEI's spelling, or lower case
Direction = Literal["Left", "Right", "left", "right"]


def _null_is_false(value: object) -> object:
    return False if value is None else value


# TEI's truncate: a JSON null means "not asked", as an absent field does
Truncate = Annotated[bool, BeforeValidator(_null_is_false)]


class RequestError(ValueError):
    """A request the client must fix: answered 422 with this message."""


class TooManyInputs(ValueError):
    """More inputs in one request than the server takes: answered 413."""


class EmbedRequest(BaseModel):
    model_config = STRICT
    inputs: str | list[str]
    normalize: bool = True
    truncate: Truncate = False
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    dimensions: int | None = None  # Matryoshka: the first this many dimensions, renormalised when normalize


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: Truncate = False  # not OpenAI's (which refuses a too-long input); TEI's, for texts
    truncation_direction: Direction = "Right"


class RerankRequest(BaseModel):
    model_config = STRICT
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: Truncate = False
    truncation_direction: Direction = "Right"


class PredictRequest(BaseModel):
    model_config = STRICT
    # TEI's rule: a string is one text; a list of exactly two strings is one (text, text) pair; any other list is a
    # batch whose items are strings or lists of one string or of two (a pair)
    inputs: str | list[str | list[str]] = Field(...)
    raw_scores: bool = False
    truncate: Truncate = False
    truncation_direction: Direction = "Right"


def texts_of(values: str | Sequence[str], limit: int, field: str | None = None) -> list[str]:
    """The texts of a string-or-list field, checked: 1 to ``limit`` of them, none empty or blank, each encodable
    as UTF-8 (JSON's \\ud800 escapes give lone surrogates, which are not). A text's errors name it ``input i``, or
    ``field[i]`` when ``field`` is given (/similarity's ``sentences``)."""
    texts = [values] if isinstance(values, str) else list(values)
    if not texts:
        raise RequestError("no inputs: send at least one text")
    if len(texts) > limit:
        raise TooManyInputs(f"{len(texts)} inputs in one request; this server takes at most {limit} "
                            "(--max-client-batch-size)")
    for index, text in enumerate(texts):
        check_text(text, f"{field}[{index}]" if field else f"input {index}")
    return texts


def blank_message(name: str, why: str | None = None) -> str:
    """The message for a blank text named ``name``, with why when it was more than whitespace: 'input 1 is empty:
    only invisible characters (U+200B ZERO WIDTH SPACE); every text needs at least one non-blank character'."""
    return f"{name} is empty: {why + '; ' if why else ''}every text needs at least one non-blank character"


def check_text(text: str, name: str) -> None:
    """RequestError for a blank text (`fastbert.embedding.is_blank`: whitespace and invisible characters only),
    saying why when it is more than whitespace, and for a text that is not UTF-8."""
    if is_blank(text):
        raise RequestError(blank_message(name, invisible_note(text) if text.strip() else None))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RequestError(f"{name} is not valid UTF-8 text (a lone surrogate at character {err.start})") from err


def check_item(item: str | tuple[str, str], index: int) -> None:
    """`check_text` of a /predict input, a text or each text of a pair: 'input 3', 'input 0 (the second text of
    its pair)'."""
    if isinstance(item, str):
        check_text(item, f"input {index}")
        return
    for place, text in zip(("first", "second"), item, strict=True):
        check_text(text, f"input {index} (the {place} text of its pair)")


def predict_items(inputs: str | list[str | list[str]], limit: int) -> tuple[list[str | tuple[str, str]], bool]:
    """The texts and pairs of a /predict body, checked as `texts_of` checks texts, whatever its shape, and whether
    it was a batch (TEI answers a single input with one list of scores, a batch with one list per input)."""
    items: list[str | tuple[str, str]]
    if isinstance(inputs, str):
        items, batched = [inputs], False
    elif len(inputs) == 2 and all(isinstance(v, str) for v in inputs):
        items, batched = [(inputs[0], inputs[1])], False
    else:
        items, batched = [], True
        for index, value in enumerate(inputs):
            if isinstance(value, list) and len(value) not in (1, 2):
                raise RequestError(f"input {index} is a list of {len(value)} texts; give one text or a pair of two")
            items.append(value if isinstance(value, str) else value[0] if len(value) == 1 else (value[0], value[1]))
        if not items:
            raise RequestError("no inputs: send at least one text")
        if len(items) > limit:
            raise TooManyInputs(f"{len(items)} inputs in one request; this server takes at most {limit} "
                                "(--max-client-batch-size)")
    for index, item in enumerate(items):
        check_item(item, index)
    return items, batched


class TokenizeRequest(BaseModel):
    """TEI's /tokenize."""

    model_config = STRICT
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class DecodeRequest(BaseModel):
    """TEI's /decode: one row of ids or a batch of rows."""

    model_config = STRICT
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class SimilarityInput(BaseModel):
    model_config = STRICT
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(BaseModel):
    model_config = STRICT
    truncate: Truncate = False
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


class SimilarityRequest(BaseModel):
    """TEI's /similarity: the cosine similarity of the source sentence to each of the sentences."""

    model_config = STRICT
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class TokenLevelRequest(BaseModel):
    """TEI's /embed_all and /embed_sparse."""

    model_config = STRICT
    inputs: str | list[str]
    truncate: Truncate = False
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None


def id_rows(ids: list[int] | list[list[int]], limit: int) -> list[list[int]]:
    """The rows of a /decode body: one row or a batch, 1 to ``limit`` of them, ids >= 0."""
    if not ids:
        raise RequestError("no ids: send a list of token ids or a list of such lists")
    rows = [ids] if isinstance(ids[0], int) else ids
    if len(rows) > limit:
        raise TooManyInputs(f"{len(rows)} inputs in one request; this server takes at most {limit} "
                            "(--max-client-batch-size)")
    for index, row in enumerate(rows):
        if any(i < 0 for i in row):  # type: ignore[union-attr]
            raise RequestError(f"input {index}: token ids must be >= 0")
    return rows  # type: ignore[return-value]
