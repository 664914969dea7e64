"""The server's checks that need no model: blank texts (whitespace and invisible characters only, as in `fastbert
embed`) refused in every shape of a /predict body (naming the input, saying why),
one name per sentence for every /similarity error, the token budget against the input length (`fastbert serve`
refuses a budget below it before loading a model), and messages that count in the singular for one."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from fastbert.common.resolve import UserError
from fastbert.common.text import plural
from fastbert.serving import app, batcher, engines, schemas, warmup
from fastbert.serving.engines import BlankInput, InputTooLong

LIMIT = 32


@pytest.mark.parametrize(("inputs", "name"), [
    ("", "input 0"),
    ("   ", "input 0"),
    (["", "b"], "input 0 (the first text of its pair)"),
    (["b", "  "], "input 0 (the second text of its pair)"),
    ([""], "input 0"),
    ([["", "b"]], "input 0 (the first text of its pair)"),
    ([["a"], ["b", "\t\n"]], "input 1 (the second text of its pair)"),
    (["a", "b", " "], "input 2"),
    ([["a"], [" "]], "input 1"),
])
def test_predict_refuses_a_blank_text_in_every_shape(inputs, name):
    with pytest.raises(schemas.RequestError) as refused:
        schemas.predict_items(inputs, LIMIT)
    assert str(refused.value).startswith(f"{name} is empty: "), str(refused.value)


# texts of whitespace and invisible characters only: blank, as in `fastbert embed` (fastbert.embedding.is_blank);
# before, the server embedded each as [CLS] [SEP], the same vector for all of them
INVISIBLE = [("\u200b", "U+200B ZERO WIDTH SPACE"), ("\ufeff", "U+FEFF ZERO WIDTH NO-BREAK SPACE"), ("\x00", "U+0000"),
             (" \x07\t", "U+0007"), ("\u200e\u200f", "U+200E LEFT-TO-RIGHT MARK, U+200F RIGHT-TO-LEFT MARK"),
             ("\u200d \u00ad", "U+200D ZERO WIDTH JOINER, U+00AD SOFT HYPHEN")]
# real texts whose invisible characters are part of them: served
SCRIPTS = ["\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u200f\u0645\u0631\u062d\u0628\u0627\u200f",
           "\u0915\u094d\u200d\u0937", "\u4e2d\u6587\u6587\u672c", "\u200bword", "a\u0301"]


@pytest.mark.parametrize(("text", "named"), INVISIBLE)
def test_a_text_of_invisible_characters_only_is_blank_with_why(text, named):
    why = f"only invisible characters ({named}); every text needs at least one non-blank character"
    with pytest.raises(schemas.RequestError) as refused:
        schemas.texts_of(["fine", text], LIMIT)
    assert str(refused.value) == f"input 1 is empty: {why}"
    for inputs, name in ((text, "input 0"), (["a", text], "input 0 (the second text of its pair)"),
                         ([["a"], [text, "b"]], "input 1 (the first text of its pair)")):
        with pytest.raises(schemas.RequestError) as refused:
            schemas.predict_items(inputs, LIMIT)
        assert str(refused.value) == f"{name} is empty: {why}", inputs
    with pytest.raises(schemas.RequestError, match=r"^sentences\[0\] is empty: only invisible characters \("):
        schemas.texts_of([text], LIMIT, field="sentences")
    with pytest.raises(schemas.RequestError, match=r"^query is empty: only invisible characters \("):
        schemas.check_text(text, "query")


def test_a_whitespace_text_says_no_more_than_before():
    with pytest.raises(schemas.RequestError) as refused:
        schemas.texts_of([" \t\n"], LIMIT)
    assert str(refused.value) == "input 0 is empty: every text needs at least one non-blank character"


def test_real_texts_in_any_script_pass():
    assert schemas.texts_of(SCRIPTS, LIMIT) == SCRIPTS
    assert schemas.predict_items([[t] for t in SCRIPTS], LIMIT) == (SCRIPTS, True)


def test_a_blank_input_the_tokenizer_finds_is_named_as_the_body_names_it():
    """The engine's BlankInput (nothing the tokenizer keeps) names the input, or its text of a pair, as
    `schemas.check_text` names a blank one; /similarity renames it as it renames a too-long one."""
    why = "nothing the tokenizer keeps (U+0301 COMBINING ACUTE ACCENT)"
    assert str(BlankInput(2, why)) == f"input 2 is empty: {why}; every text needs at least one non-blank character"
    assert str(BlankInput(0, why, part=1)).startswith(f"input 0 (the second text of its pair) is empty: {why}; ")
    assert str(app.similarity_input_error(BlankInput(0, why))).startswith(f"source_sentence is empty: {why}; ")
    renamed = app.similarity_input_error(BlankInput(3, why))
    assert isinstance(renamed, schemas.RequestError) and str(renamed).startswith(f"sentences[2] is empty: {why}; ")


def test_check_kept_names_the_first_blank_text_or_text_of_a_pair():
    def kept_nothing(texts):
        return [f"nothing the tokenizer keeps ({t})" if t.startswith("x") else None for t in texts]

    engines.check_kept(["a", ("b", "c")], kept_nothing)
    with pytest.raises(BlankInput) as found:
        engines.check_kept(["a", ("b", "c"), ("d", "x1"), "x2"], kept_nothing)
    assert (found.value.index, found.value.part) == (2, 1)
    assert str(found.value).startswith("input 2 (the second text of its pair) is empty: nothing the tokenizer "
                                       "keeps (x1); ")
    with pytest.raises(BlankInput, match=r"^input 1 is empty: nothing the tokenizer keeps \(x2\); "):
        engines.check_kept(["a", "x2"], kept_nothing)


@pytest.mark.parametrize("inputs", ["\ud800 lone", ["a", "\ud800"], [["\ud800"]]])
def test_predict_refuses_a_text_that_is_not_utf8_in_every_shape(inputs):
    with pytest.raises(schemas.RequestError, match="input 0.* is not valid UTF-8"):
        schemas.predict_items(inputs, LIMIT)


def test_predict_items_keep_teis_shapes():
    assert schemas.predict_items("a", LIMIT) == (["a"], False)
    assert schemas.predict_items(["a", "b"], LIMIT) == ([("a", "b")], False)
    assert schemas.predict_items([["a"], ["b", "c"], "d"], LIMIT) == (["a", ("b", "c"), "d"], True)


def test_texts_of_names_a_field_as_the_request_writes_it():
    with pytest.raises(schemas.RequestError, match=r"^sentences\[1\] is empty: "):
        schemas.texts_of(["b", " "], LIMIT, field="sentences")
    with pytest.raises(schemas.RequestError, match=r"^input 1 is empty: "):
        schemas.texts_of(["b", " "], LIMIT)


def test_a_too_long_similarity_sentence_is_named_as_a_blank_one_is():
    """The engine numbers the texts it was given (source first); /similarity names them as its body does."""
    assert str(app.similarity_input_error(InputTooLong(0, 256))).startswith("source_sentence is longer than the "
                                                                            "maximum of 256 tokens")
    renamed = app.similarity_input_error(InputTooLong(2, 256))
    assert isinstance(renamed, InputTooLong) and str(renamed).startswith("sentences[1] is longer than the maximum")
    assert "truncate: true" in str(renamed)


@pytest.mark.parametrize(("budget", "length", "refused"), [(10, 256, True), (255, 256, True), (256, 256, False),
                                                          (None, 256, False)])
def test_a_budget_below_the_input_length_is_refused(budget, length, refused):
    if refused:
        with pytest.raises(UserError, match=rf"--max-batch-tokens \({budget}\) must be at least --max-input-length "
                                            rf"\({length}\)"):
            app.batch_budget(budget, length, "cpu")
    else:
        assert app.batch_budget(budget, length, "cpu") == (budget or 4096)


def test_the_default_budget_holds_the_longest_input():
    assert app.batch_budget(None, 8192, "cpu") == 8192


def test_serve_refuses_a_budget_below_the_input_length_before_loading_the_model(monkeypatch, capsys):
    """`fastbert serve --max-batch-tokens 10` (the checkpoint's max input length is 256; a classifier's default is
    the model's 512 positions): one line, exit status 1 as the CLI's other usage errors, and no model loaded; an
    explicit --max-input-length is the one compared."""
    from fastbert import cli
    from fastbert.serving import engines

    monkeypatch.setattr(engines, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(app, "load_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    for args, length in ((["--max-batch-tokens", "10"], 256),
                         (["--max-batch-tokens", "100", "--max-input-length", "128"], 128),
                         (["--task", "classify", "--max-batch-tokens", "10"], 512)):
        assert cli.main(["serve", "--port", "0", *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fastbert: error: --max-batch-tokens"), err
        assert f"must be at least --max-input-length ({length})" in err


def test_a_service_refuses_a_budget_below_its_engines_input_length():
    engine = SimpleNamespace(task="classify", max_length=512, device=SimpleNamespace(type="cpu"))
    with pytest.raises(UserError, match=r"--max-batch-tokens \(100\) must be at least --max-input-length \(512\)"):
        app.Service(app.ServeSettings(task="classify", max_batch_tokens=100, warmup="none"), engine=engine)


def test_counts_of_one_are_singular(capsys):
    class Engine:
        config = SimpleNamespace(vocab_size=100, type_vocab_size=0)
        task, max_length = "embed", 16

        def run(self, batch):
            time.sleep(0.05)  # past the warm-up's seconds: the first forward is its last

    assert warmup.warm(Engine(), 64, "quick", 0.01) == 1
    assert "warm-up quick: 1 forward in " in capsys.readouterr().err
    queue = batcher.Batcher(Engine(), max_batch_tokens=64, max_queue=1)
    queue.reserve()
    with pytest.raises(batcher.QueueFull, match=r"\(1 request waiting\)"):
        queue.check_room()
    assert plural(1, "byte") == "1 byte" and plural(2, "byte") == "2 bytes" and plural(4096, "byte") == "4,096 bytes"


def test_the_body_limit_of_one_byte_is_singular():
    service = SimpleNamespace(settings=SimpleNamespace(api_key=None, max_body_bytes=1),
                              batcher=SimpleNamespace(check_room=lambda: None),
                              metrics=SimpleNamespace(record_request=lambda *args: None))
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": [], "query_string": b""}
    asyncio.run(app.Gate(lambda *a: pytest.fail("the app ran"), service)(scope, receive, send))
    assert sent[0]["status"] == 413, sent
    assert json.loads(sent[1]["body"])["error"] == "the body is larger than the limit of 1 byte"
