"""A corpus of real English sentences available offline: CPython's own documentation, as it ships with every
Python: the language and library reference topics of ``pydoc_data.topics`` and the docstrings of the standard
library's modules, classes and functions. Deterministic for a given Python version (sorted walk, first occurrence
kept); used by the corpus-embedding benchmark and tests."""

from __future__ import annotations

import ast
import os
import re
import sysconfig
from functools import lru_cache

# A sentence ends at . ! or ? followed by whitespace and a capital letter (good enough for reference prose).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_SKIPPED_DIRS = {"site-packages", "__pycache__", "lib2to3", "ensurepip", "tkinter", "turtledemo"}


def _sentences(text: str) -> list[str]:
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        paragraph = " ".join(paragraph.split())
        for sentence in _SENTENCE_END.split(paragraph):
            if 20 <= len(sentence) <= 400 and sentence[0].isupper() and sentence.count(" ") >= 3:
                found.append(sentence)
    return found


def _docstrings(path: str) -> list[str]:
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


@lru_cache(maxsize=2)
def cpython_sentences(limit: int | None = None) -> tuple[str, ...]:
    """Distinct sentences of CPython's documentation, reference topics first, then the standard library's
    docstrings (its test suite included) in sorted path order; at most ``limit``."""
    import pydoc_data.topics

    seen: dict[str, None] = {}
    for key in sorted(pydoc_data.topics.topics):
        seen.update(dict.fromkeys(_sentences(pydoc_data.topics.topics[key])))
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        for name in sorted(names):
            if name.endswith(".py"):
                for doc in _docstrings(os.path.join(root, name)):
                    seen.update(dict.fromkeys(_sentences(doc)))
            if limit is not None and len(seen) >= limit:
                return tuple(list(seen)[:limit])
    return tuple(seen) if limit is None else tuple(list(seen)[:limit])
