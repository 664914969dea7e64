"""fastbert.common.resolve: what a user names (checkpoint, device, dtype) is checked, and every problem they can fix
is a UserError (one line, no traceback, in the CLI)."""

import json

import pytest
import torch

from fastbert.common import resolve


def test_resolve_errors_are_user_errors(tmp_path):
    with pytest.raises(resolve.UserError, match="does not exist"):
        resolve.resolve_model(str(tmp_path / "absent"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(resolve.UserError, match="not supported"):
        resolve.resolve_model(str(tmp_path))
    with pytest.raises(resolve.UserError, match="dtype"):
        resolve.resolve_dtype("float64", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(resolve.UserError, match="not present"):
            resolve.resolve_device("cuda")
