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
