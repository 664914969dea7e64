"""Reading a corpus: a text file (one text per line), JSONL with a text field, or stdin, read lazily as `Row`s.

Every input line is one `Row`; a blank text is a row with ``text=None`` (its result is an explicit null), never a
skipped line, so line numbers and output rows stay aligned. Blank is `is_blank`: empty, or only whitespace and
invisible characters (zero-width spaces and joiners, byte order marks, direction marks, controls), which a
tokenizer drops or a reader cannot see. Input that cannot be read (bad UTF-8, bad JSON, a missing or non-string
field) raises `InputError` naming ``file:line``."""

from __future__ import annotations

import json
import os
import sys
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from fastbert.common.resolve import UserError

INPUT_FORMATS = ("text", "jsonl")
# Unicode's control (Cc) and format (Cf) characters: nothing a reader sees, and nothing BERT's tokenizer keeps
INVISIBLE_CATEGORIES = ("Cc", "Cf")


class InputError(UserError):
    """A row of the input that cannot be embedded (the message names its line)."""


@dataclass
class Row:
    """One input line: ``line`` is its 1-based line number, ``id`` the id written with its embedding (the JSONL
    id field's value, else the line number), ``text`` None for a blank text (its embedding is null). ``why``: for
    a null row whose text was not empty nor whitespace, why it is blank (`invisible_note`), for messages."""

    line: int
    id: int | str
    text: str | None
    why: str | None = None


def is_blank(text: str | None) -> bool:
    """Whether ``text`` has nothing to embed: None, empty, or only whitespace and invisible characters (Unicode's
    control and format characters: U+200B ZERO WIDTH SPACE, U+200C/U+200D joiners, U+FEFF byte order mark, U+200E
    direction marks, U+00AD soft hyphen, NUL, BEL...). Such a text would embed as the special tokens alone
    ([CLS] [SEP]): the same vector for every one of them, which looks like a real result. A text with anything
    else, in any script, is not blank: zero-width joiners inside an emoji or direction marks around Arabic words
    stay part of their text. Checks the first characters only, for most texts the first."""
    return text is None or all(c.isspace() or unicodedata.category(c) in INVISIBLE_CATEGORIES for c in text)


def describe_characters(text: str, limit: int = 3) -> str:
    """The distinct characters of ``text`` other than whitespace (at most ``limit``) by code point and name, for
    a message: 'U+200B ZERO WIDTH SPACE, U+0007'."""
    seen = list(dict.fromkeys(c for c in text if not c.isspace()))
    named = [f"U+{ord(c):04X} {unicodedata.name(c, '')}".rstrip() for c in seen[:limit]]
    return ", ".join(named) + (f" and {len(seen) - limit} more" if len(seen) > limit else "")


def invisible_note(text: str) -> str:
    """Why a blank text that is not empty nor whitespace (`is_blank`) is blank."""
    return f"only invisible characters ({describe_characters(text)})"


def text_row(line: int, row_id: int | str, text: str | None) -> Row:
    """The `Row` of one text: null when `is_blank`, with why when the text was more than whitespace."""
    if not is_blank(text):
        return Row(line, row_id, text)
    return Row(line, row_id, None, invisible_note(text) if text and text.strip() else None)


class ByteCounter:
    """Wraps a binary stream and counts the bytes read (the progress line's fraction of a file)."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.bytes_read = 0

    def __iter__(self) -> Iterator[bytes]:
        for line in self.stream:
            self.bytes_read += len(line)
            yield line


def check_input_path(path: str) -> None:
    """UserError unless ``path`` ('-' for stdin) names something to read rows from: checked before a model loads."""
    if path == "-":
        return
    if not os.path.exists(path):
        raise UserError(f"input file {path} does not exist")
    if os.path.isdir(path):
        raise UserError(f"input {path} is a directory, not a file")
    if is_parquet(path):
        raise UserError(f"input file {path} is a Parquet file: embed reads UTF-8 text, one text per line, or JSONL "
                        "(export the text column as either)")


def is_parquet(path: str) -> bool:
    """Whether ``path`` is a Parquet file (its magic at both ends), which read as text gives garbage rows; other
    binary files fail as invalid UTF-8 at their first line. False for what cannot be read here (a FIFO, no
    permission: reading it later says)."""
    if not os.path.isfile(path) or os.path.getsize(path) < 8:
        return False
    try:
        with open(path, "rb") as stream:
            head = stream.read(4)
            stream.seek(-4, os.SEEK_END)
            return head == stream.read(4) == b"PAR1"
    except OSError:
        return False


def open_input(path: str) -> tuple[ByteCounter, int | None, str]:
    """The byte stream of ``path`` ('-' for stdin), its size when known, and a name for messages."""
    if path == "-":
        return ByteCounter(sys.stdin.buffer), None, "<stdin>"
    check_input_path(path)
    try:
        stream = open(path, "rb")  # closed by read_rows' caller through the generator's end
    except OSError as err:
        raise UserError(f"cannot read input file {path}: {err.strerror}") from err
    size = os.fstat(stream.fileno()).st_size
    return ByteCounter(stream), (size if size > 0 else None), path


def read_rows(lines: Iterable[bytes], input_format: str = "text", text_field: str = "text",
              id_field: str | None = None, name: str = "<input>") -> Iterator[Row]:
    """Rows of a text or JSONL input, lazily. ``lines``: raw lines (bytes, with or without their newline).

    text: one text per line, a blank line (`is_blank`) is a null row. jsonl: one JSON object per line whose
    ``text_field`` is a string (blank or null: a null row); ``id_field``, when given, names each row's id (else the
    line number). A blank JSONL line is a null row too, so line numbers and rows stay aligned, unless ``id_field``
    is given: then it has no id (its line number could be another row's id) and is skipped. Anything else raises
    `InputError` with ``name:line``."""
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be 'text' or 'jsonl', got {input_format!r}")
    for number, raw in enumerate(lines, start=1):
        line = decode_line(raw, number, name)
        if input_format == "jsonl" and id_field is not None and not line.strip():
            continue
        if input_format == "text" or not line.strip():
            yield text_row(number, number, line)
        else:
            yield jsonl_row(line, number, text_field, id_field, name)


def decode_line(raw: bytes, number: int, name: str) -> str:
    """One raw input line as text, without its newline (nor, on line 1, a byte order mark)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{name}:{number}: not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 4]!r});"
                         " re-encode the file as UTF-8") from err
    line = line.rstrip("\r\n")
    if number == 1:
        line = line.removeprefix("\ufeff")  # a byte order mark is not part of the first text
    return line


def jsonl_row(line: str, number: int, text_field: str, id_field: str | None, name: str) -> Row:
    """The `Row` of one non-blank JSONL line (see `read_rows`)."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{name}:{number}: not valid JSON ({err.msg} at column {err.colno})") from err
    if not isinstance(record, dict):
        raise InputError(f"{name}:{number}: expected a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise InputError(f"{name}:{number}: the object has no field {text_field!r} (fields: "
                         f"{', '.join(list(record)[:8]) or 'none'}); choose one with --field")
    text = record[text_field]
    if text is not None and not isinstance(text, str):
        raise InputError(f"{name}:{number}: field {text_field!r} holds {type(text).__name__}, not a string")
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as err:  # JSON's "\ud800": valid JSON, not Unicode text, and no tokenizer takes it
        raise InputError(f"{name}:{number}: field {text_field!r} holds a lone surrogate "
                         f"U+{ord(err.object[err.start]):04X}, which is not Unicode text") from None
    row_id = number if id_field is None else record_id(record, id_field, number, name)
    return text_row(number, row_id, text)


def record_id(record: dict, id_field: str, number: int, name: str) -> int | str:
    """The value of a JSONL record's id field: a string or an integer."""
    if id_field not in record:
        raise InputError(f"{name}:{number}: the object has no id field {id_field!r}")
    value = record[id_field]
    if not isinstance(value, (int, str)) or isinstance(value, bool):
        raise InputError(f"{name}:{number}: id field {id_field!r} must be a string or an integer, got "
                         f"{type(value).__name__}")
    return value
