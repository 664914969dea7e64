"""What fastbert.bench and the other applications use from fastbert.common: mean pooling against
sentence-transformers (fastbert.common.text) and user-input checks (fastbert.common.resolve)."""

import json

import pytest
import torch

from fastbert.bench import peers
from fastbert.common import resolve, text
from fastbert.config import FastBertConfig


def test_mean_pooling_matches_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sat on the mat.", "A much longer sentence, so that the first one is padded in the batch."]
    config = FastBertConfig.from_json_file(f"{minilm_dir}/config.json")
    batch = text.TextEncoder(minilm_dir, config)(texts)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # padding really happens
    with torch.inference_mode():
        hidden = peers.load_fastbert(minilm_dir)(**batch).last_hidden_state
    ours = text.mean_pool(hidden, batch["attention_mask"])
    theirs = torch.from_numpy(SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


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
