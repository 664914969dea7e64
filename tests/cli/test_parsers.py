"""fastbert.cli.parsers: the choices the options offer are the core's own (the parsers hold copies, so that building
them imports no torch; tests/cli/test_cli.py checks that it does not)."""

import pytest

from fastbert import backends, embedding
from fastbert.bench import peers
from fastbert.cli import parsers
from fastbert.training import corpus, distill, finetune, pretrain


@pytest.mark.parametrize("copy, source", [
    (parsers.BACKENDS, backends.BACKENDS),
    (parsers.POOLINGS, embedding.POOLINGS),
    (parsers.OUTPUT_FORMATS, embedding.FORMATS),
    (parsers.PEERS, peers.PEERS),
    (parsers.DEFAULT_PEERS, peers.DEFAULT_PEERS),
    (parsers.FINETUNE_TASKS, finetune.TASK_NAMES),
    (parsers.PRETRAIN_OBJECTIVES, pretrain.OBJECTIVES),
    (parsers.DISTILL_OBJECTIVES, distill.OBJECTIVES),
    (parsers.CORPORA, tuple(corpus.CORPORA)),
], ids=["backends", "poolings", "output-formats", "peers", "default-peers", "finetune-tasks", "pretrain-objectives",
        "distill-objectives", "corpora"])
def test_the_choices_are_the_cores_own(copy, source):
    assert tuple(copy) == tuple(source)


def test_the_serve_choices_are_the_servers_own():
    pytest.importorskip("fastapi", reason="fastbert.serving needs the serve extra")
    from fastbert.serving import engines, warmup

    assert parsers.SERVE_TASKS == engines.TASKS
    assert parsers.WARMUPS == warmup.WARMUPS


def embed_option_help(option: str) -> str:
    import argparse

    from fastbert.cli.parsers import embed as embed_parser

    parser = embed_parser.add_parser(argparse.ArgumentParser().add_subparsers())
    return " ".join(next(a for a in parser._actions if option in a.option_strings).help.split())


def test_embed_output_help_says_what_the_output_code_does():
    """-o - is stdout; a stream (fastbert.embedding.is_stream) takes JSONL only and is written through its
    descriptor, never emptied: what fastbert.cli.embed and fastbert.embedding.outputs do."""
    text = embed_option_help("--output")
    assert "'-': JSONL on stdout" in text
    assert "A stream takes JSONL only and is never emptied nor replaced" in text
    assert "(-o /dev/stdout >> FILE appends)" in text and "a named pipe, a terminal or another device" in text


def test_embed_on_blank_help_counts_invisible_texts_as_blank():
    """fastbert.embedding.is_blank (Unicode control and format characters) and Embedder.kept_nothing."""
    text = embed_option_help("--on-blank")
    assert "only invisible characters (Unicode control and format characters: U+200B" in text
    assert "a text the tokenizer keeps nothing of" in text
    assert embedding.is_blank("\u200b\ufeff\u200e\x00") and not embedding.is_blank("\u200bword")
