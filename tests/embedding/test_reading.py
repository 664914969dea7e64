"""fastbert.embedding.reading: every input line is one row (blank ones null), and input that cannot be read
names its line."""

import json

import pytest

from fastbert.common.resolve import UserError
from fastbert.embedding import InputError, Row, open_input, read_rows


def test_text_rows_keep_every_line_blank_ones_as_null():
    rows = list(read_rows([b"\xef\xbb\xbfone\r\n", b"\n", b"   \n", b"two\n", b"three"]))
    assert [(r.line, r.id, r.text) for r in rows] == [(1, 1, "one"), (2, 2, None), (3, 3, None), (4, 4, "two"),
                                                      (5, 5, "three")]


def test_jsonl_rows_with_field_and_id():
    lines = [b'{"body": "a text", "key": "doc-1"}\n', b'{"body": "", "key": 7}\n', b'\n',
             b'{"body": null, "key": "x"}\n']
    rows = list(read_rows(lines, "jsonl", "body", "key"))
    assert [(r.id, r.text) for r in rows] == [("doc-1", "a text"), (7, None), ("x", None)]  # the blank line: no id
    assert [(r.id, r.text) for r in read_rows(lines, "jsonl", "body")] == [(1, "a text"), (2, None), (3, None),
                                                                            (4, None)]


# Blank: nothing to embed. A zero-width space, a joiner, a byte order mark, direction marks, a soft hyphen, NUL
# and BEL: a reader sees nothing and BERT's tokenizer keeps nothing, so they embedded as [CLS] [SEP] alone.
INVISIBLE = ["\u200b", "\u200b\u200c", "\x00\x07", "\ufeff", "\u200d", "\u200e\u200f", "\u00ad", "\u2060",
             " \u200b\t\u200b ", "\x1b", "\U000e0041"]
# Not blank: real text in any script, with the same characters mixed in where they belong.
VISIBLE = ["\u200bhello\u200c world", "\u202b\u0645\u0631\u062d\u0628\u0627\u202c",  # Arabic in RTL embedding marks
           "\u200f\u05e9\u05dc\u05d5\u05dd\u200f", "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # Hebrew; a ZWJ emoji
           "\u65e5\u672c\u8a9e", "\U0001f44d", "\u0915\u094d\u200d\u0937", "a\u00adb", "\x07bell", ".", "0",
           "\u3164"]  # CJK, emoji, Devanagari with a ZWJ, soft hyphen inside a word, HANGUL FILLER (a letter)


@pytest.mark.parametrize("text", INVISIBLE)
def test_a_text_of_only_invisible_characters_is_blank_and_says_why(text):
    _, row = read_rows([b"first\n", text.encode() + b"\n"])  # (on line 1 a byte order mark is no text's)
    [record] = read_rows([json.dumps({"text": text}).encode()], "jsonl")
    assert row.text is None and record.text is None
    from fastbert.embedding import is_blank, text_row

    assert row.why.startswith("only invisible characters (U+") and record.why == row.why
    assert is_blank(text) and text_row(3, "a", text) == Row(3, "a", None, row.why)


@pytest.mark.parametrize("text", VISIBLE)
def test_a_text_with_anything_visible_is_kept_whole(text):
    from fastbert.embedding import is_blank

    assert not is_blank(text)
    [row] = read_rows([text.encode() + b"\n"])
    assert row.text == text and row.why is None
    [row] = read_rows([json.dumps({"text": text}).encode()], "jsonl")
    assert row.text == text and row.why is None


def test_whitespace_is_blank_without_a_why_and_the_why_names_the_characters():
    from fastbert.embedding import invisible_note

    assert [(r.text, r.why) for r in read_rows([b"\n", b" \t\n", "\u00a0\u3000".encode()])] == [(None, None)] * 3
    assert invisible_note("\u200b\u200b\u200c") == ("only invisible characters (U+200B ZERO WIDTH SPACE, U+200C "
                                                     "ZERO WIDTH NON-JOINER)")
    assert invisible_note("\x00\x07\x1b\x7f") == "only invisible characters (U+0000, U+0007, U+001B and 1 more)"


def test_a_blank_jsonl_line_takes_no_id_another_row_has():
    rows = read_rows([b'{"id": 1, "text": "a"}\n', b"\n", b'{"id": 2, "text": "b"}\n'], "jsonl", id_field="id")
    assert [(r.line, r.id, r.text) for r in rows] == [(1, 1, "a"), (3, 2, "b")]


@pytest.mark.parametrize("line, message", [
    (b"\xff\xfe bad bytes\n", "demo.txt:2: not valid UTF-8"),
], ids=["bad-utf8"])
def test_unreadable_text_line_names_its_line(line, message):
    rows = read_rows([b"fine\n", line, b"later\n"], name="demo.txt")
    assert next(rows).text == "fine"
    with pytest.raises(InputError, match=message):
        next(rows)


@pytest.mark.parametrize("line, message", [
    (b'{"other": "x"}', "in.jsonl:2: the object has no field 'text'"),
    (b'{"text": 3}', "in.jsonl:2: field 'text' holds int"),
    (b'{"text": "a \\ud800 b"}', "in.jsonl:2: field 'text' holds a lone surrogate U.D800, which is not Unicode"),
    (b'{"text": "x"', "in.jsonl:2: not valid JSON"),
    (b'["text"]', "in.jsonl:2: expected a JSON object"),
], ids=["missing-field", "not-a-string", "lone-surrogate", "bad-json", "not-an-object"])
def test_invalid_jsonl_row_names_its_line(line, message):
    rows = read_rows([b'{"text": "ok"}\n', line], "jsonl", name="in.jsonl")
    assert next(rows).text == "ok"
    with pytest.raises(InputError, match=message):
        next(rows)


@pytest.mark.parametrize("line, message", [
    (b'{"text": "x"}', "in.jsonl:1: the object has no id field 'key'"),
    (b'{"text": "x", "key": true}', "in.jsonl:1: id field 'key' must be a string or an integer, got bool"),
    (b'{"text": "x", "key": 1.5}', "in.jsonl:1: id field 'key' must be a string or an integer, got float"),
], ids=["missing", "bool", "float"])
def test_an_unusable_id_names_its_line(line, message):
    with pytest.raises(InputError, match=message):
        list(read_rows([line], "jsonl", id_field="key", name="in.jsonl"))


def test_an_unknown_input_format_is_refused():
    with pytest.raises(ValueError, match="input format must be"):
        list(read_rows([b"x\n"], "csv"))


def test_open_input_counts_the_bytes_read_and_knows_the_size(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes(b"one\ntwo\n")
    counter, size, name = open_input(str(path))
    with counter.stream:
        assert [r.text for r in read_rows(counter, name=name)] == ["one", "two"]
    assert (counter.bytes_read, size, name) == (8, 8, str(path))


def test_open_input_refuses_a_missing_file_and_a_directory(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_input(str(tmp_path / "missing.txt"))
    with pytest.raises(UserError, match="is a directory"):
        open_input(str(tmp_path))


def test_a_parquet_input_is_refused_before_a_row_is_read(tmp_path):
    """Read as text, a Parquet file gave a garbage row before failing on invalid UTF-8."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastbert.embedding import check_input_path

    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "table.parquet")
    with pytest.raises(UserError, match=f"^input file {tmp_path / 'table.parquet'} is a Parquet file: embed reads "):
        check_input_path(str(tmp_path / "table.parquet"))
    texts = {"par1.txt": b"PAR1 starts this line\nand a second one\n", "nul.txt": b"a stray \0 in a line\n",
             "short.txt": b"PAR1", "utf8.txt": "zw\u00f6lf Boxk\u00e4mpfer\n".encode()}
    for name, content in texts.items():  # text, however it starts: read as text
        (tmp_path / name).write_bytes(content)
        check_input_path(str(tmp_path / name))
