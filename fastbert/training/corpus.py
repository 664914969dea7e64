"""Corpora of real English text available offline: CPython's own documentation, as it ships with every Python (the
language and library reference topics of ``pydoc_data.topics`` and the docstrings of the standard library's
modules, classes and functions), and plain text files. Deterministic for a given Python version (sorted walks).

Readers of three kinds, for three users: `cpython_sentences` (distinct sentences: the corpus-embedding benchmark
and tests), `pydoc_documents` / `stdlib_documents` / `file_documents` (documents as lists of sentences:
`fastbert pretrain` and `fastbert distill`, through `run_documents`), and the pieces `fastbert finetune` builds its
labelled sets from (`prose_sentences`, `file_docstrings`, `stdlib_python_files`)."""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from collections.abc import Iterator, Sequence
from functools import lru_cache

from fastbert.common.resolve import UserError

# A sentence ends at . ! or ? followed by whitespace and a capital letter (good enough for reference prose).
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
# Standard-library folders without documentation prose of their own (installed packages, bytecode, vendored code).
UNDOCUMENTED_DIRS = frozenset({"site-packages", "__pycache__", "lib2to3", "ensurepip", "turtledemo"})
# The standard library's test suites: their docstrings describe tests, not the package.
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
CORPORA = {"pydoc": "CPython's reference topics (pydoc_data.topics)",
           "cpython": "pydoc_data.topics plus the standard library's docstrings, one document per module"}


def sentence_pieces(text: str) -> Iterator[str]:
    """The candidate sentences of a text, unfiltered: paragraphs (split at blank lines, whitespace collapsed), each
    split after ``. ! ?`` followed by a capital letter."""
    for paragraph in re.split(r"\n\s*\n", text):
        yield from SENTENCE_END.split(" ".join(paragraph.split()))


def prose_sentences(text: str) -> list[str]:
    """The sentences of a text that read as prose: 20 to 400 characters, a capital first, at least four words."""
    return [s for s in sentence_pieces(text) if 20 <= len(s) <= 400 and s[0].isupper() and s.count(" ") >= 3]


def split_sentences(text: str, min_words: int = 3) -> list[str]:
    """The sentences of a text (`sentence_pieces`) with at least ``min_words`` words."""
    return [s for s in sentence_pieces(text) if len(s.split()) >= min_words]


def file_docstrings(path: str) -> list[str]:
    """The module, class and function docstrings of a Python file in `ast.walk` order; [] when it does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    texts = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                texts.append(doc)
    return texts


def stdlib_python_files(skipped: frozenset[str] | set[str]) -> Iterator[str]:
    """The paths of the standard library's ``.py`` files, in sorted walk order, leaving out folders named in
    ``skipped`` (at any depth)."""
    for root, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(d for d in dirs if d not in skipped)
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(root, name)


@lru_cache(maxsize=2)
def cpython_sentences(limit: int | None = None) -> tuple[str, ...]:
    """Distinct sentences of CPython's documentation, reference topics first, then the standard library's
    docstrings (its test suite included, tkinter left out) in sorted path order; at most ``limit``."""
    import pydoc_data.topics

    seen: dict[str, None] = {}
    for key in sorted(pydoc_data.topics.topics):
        seen.update(dict.fromkeys(prose_sentences(pydoc_data.topics.topics[key])))
    for path in stdlib_python_files(UNDOCUMENTED_DIRS | {"tkinter"}):
        for doc in file_docstrings(path):
            seen.update(dict.fromkeys(prose_sentences(doc)))
        if limit is not None and len(seen) >= limit:
            return tuple(list(seen)[:limit])
    return tuple(seen) if limit is None else tuple(list(seen)[:limit])


def pydoc_documents() -> list[list[str]]:
    """CPython's reference documentation (``pydoc_data.topics``): one document of sentences per topic, in sorted
    topic order; empty documents dropped."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    documents = [split_sentences(topics[key]) for key in sorted(topics)]
    return [doc for doc in documents if doc]


def stdlib_documents() -> list[list[str]]:
    """The docstrings of CPython's standard library (test suites left out): one document per module file, its
    docstrings in source order (module, classes, functions), in sorted path order."""
    documents = []
    for path in stdlib_python_files(UNDOCUMENTED_DIRS | TEST_DIRS):
        doc = [s for text in file_docstrings(path) for s in split_sentences(text)]
        if doc:
            documents.append(doc)
    return documents


def cpython_documents(corpus: str) -> list[list[str]]:
    """The documents of a built-in corpus (`CORPORA`)."""
    if corpus not in CORPORA:
        raise UserError(f"unknown corpus {corpus!r}; expected one of {', '.join(CORPORA)}")
    documents = pydoc_documents()
    return documents + stdlib_documents() if corpus == "cpython" else documents


def run_documents(files: Sequence[str], corpus: str | None, default: str) -> list[list[str]]:
    """A run's documents: those of the text ``files``, else of the built-in ``corpus`` (``default`` when None).
    UserError for both given, or for no sentence at all."""
    if files and corpus is not None:
        raise UserError("give text FILEs or --corpus, not both")
    documents = file_documents(files) if files else cpython_documents(corpus or default)
    if not documents:
        raise UserError("the corpus holds no sentences")
    return documents


def file_documents(paths: Sequence[str]) -> list[list[str]]:
    """Documents of text files: a blank line ends a document (and a file ends one); each document's lines are
    joined and split into sentences. UserError for a missing or unreadable file."""
    documents = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"text file {path} does not exist" if not os.path.exists(path) else
                            f"{path} is not a file")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"cannot read {path} as UTF-8 text: {err}") from err
        for block in re.split(r"\n\s*\n", text):
            sentences = []
            for line in block.splitlines():
                sentences += split_sentences(line, min_words=1)
            if sentences:
                documents.append(sentences)
    return documents
