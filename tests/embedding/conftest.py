"""What the embedding tests share: a tiny checkpoint, a corpus of real sentences, and running `fastbert embed`."""

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

from fastbert.training.corpus import cpython_sentences

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, minilm_dir) -> str:
    """A random 2-layer BERT (H 32) with all-MiniLM-L6-v2's tokenizer: fast enough for corpus-sized inputs."""
    import shutil

    import transformers

    directory = tmp_path_factory.mktemp("tiny-embedder")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config).eval().save_pretrained(directory)
    shutil.copy(os.path.join(minilm_dir, "tokenizer.json"), directory)
    return str(directory)


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return list(cpython_sentences(limit=3000))


@pytest.fixture
def write_lines() -> Callable[[Path, Iterable[str]], Path]:
    """Writes one text per line (UTF-8) to a path and returns it."""

    def write(path: Path, lines: Iterable[str]) -> Path:
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    return write


@pytest.fixture
def embed_cli() -> Callable[..., subprocess.CompletedProcess]:
    """Runs ``fastbert embed ARGV`` in a subprocess from the repository root; ``check`` asserts it succeeded."""

    def run(*argv: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "fastbert.cli", "embed", *argv], capture_output=True,
                              text=True, cwd=ROOT, timeout=timeout)
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    return run
