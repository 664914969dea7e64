"""What a checkpoint directory declares for embedding: the pooling, normalisation and ``max_seq_length`` of its
sentence-transformers files, and a digest of its config (a resumed run must use the same checkpoint)."""

from __future__ import annotations

import hashlib
import json
import os

from fastbert.common.resolve import UserError

POOLING_MODES = {"mean_tokens": "mean", "cls_token": "cls"}  # sentence-transformers' mode -> ours


def read_json(path: str) -> object | None:
    """The JSON value of ``path``, None when it is missing or unreadable (a checkpoint's optional file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sentence_transformers_head(model_dir: str) -> tuple[str | None, bool | None]:
    """The pooling ("mean" or "cls") and normalisation a sentence-transformers checkpoint declares
    (``modules.json``: its Pooling module's ``config.json``, a Normalize module), None where it declares nothing.
    A pooling fastbert does not implement (max, mean-sqrt-len, weighted mean, last token) raises UserError."""
    modules = read_json(os.path.join(model_dir, "modules.json"))
    if modules is None:
        return None, None
    modules = [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling = None
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            settings = read_json(os.path.join(model_dir, module.get("path", ""), "config.json"))
            if not isinstance(settings, dict):
                break
            pooling = declared_pooling(model_dir, settings)
    return pooling, normalize


def declared_pooling(model_dir: str, settings: dict) -> str:
    """"mean" or "cls" for a sentence-transformers Pooling module's ``settings``; UserError for any other mode."""
    modes = sorted(k.removeprefix("pooling_mode_") for k, v in settings.items()
                   if k.startswith("pooling_mode_") and v is True)
    if len(modes) == 1 and modes[0] in POOLING_MODES:
        return POOLING_MODES[modes[0]]
    raise UserError(f"{model_dir} pools with {', '.join(modes) or 'nothing'} (sentence-transformers' "
                    "1_Pooling); fastbert embed pools mean or cls: give --pooling to choose one")


def default_max_length(model_dir: str, model_limit: int) -> int:
    """sentence-transformers' ``max_seq_length`` when the checkpoint has one (all-MiniLM-L6-v2: 256), else the
    model's position limit."""
    path = os.path.join(model_dir, "sentence_bert_config.json")
    settings = read_json(path) if os.path.isfile(path) else None
    value = settings.get("max_seq_length") if isinstance(settings, dict) else None
    if isinstance(value, int) and value > 0:
        return min(value, model_limit)
    return model_limit


def config_digest(model_dir: str) -> str:
    """A short digest of the checkpoint's ``config.json`` (part of the settings a resumed run must match)."""
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]
