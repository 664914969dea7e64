"""fastbert.embedding.reading: every input line is one row (blank ones null), and input that cannot be read
names its line."""

import pytest

from fastbert.common.resolve import UserError
from fastbert.embedding import InputError, open_input, read_rows


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
    (b'{"text": "x"', "in.jsonl:2: not valid JSON"),
    (b'["text"]', "in.jsonl:2: expected a JSON object"),
], ids=["missing-field", "not-a-string", "bad-json", "not-an-object"])
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
