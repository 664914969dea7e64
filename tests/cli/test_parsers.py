"""fastbert.cli.parsers: the choices the options offer are the core's own (the parsers hold copies, so that building
them imports no torch; tests/cli/test_cli.py checks that it does not)."""

import pytest

from fastbert import backends, embedding
from fastbert.bench import peers
from fastbert.cli import parsers
from fastbert.serving import engines, warmup
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
    (parsers.SERVE_TASKS, engines.TASKS),
    (parsers.WARMUPS, warmup.WARMUPS),
], ids=["backends", "poolings", "output-formats", "peers", "default-peers", "finetune-tasks", "pretrain-objectives",
        "distill-objectives", "corpora", "serve-tasks", "warmups"])
def test_the_choices_are_the_cores_own(copy, source):
    assert tuple(copy) == tuple(source)
