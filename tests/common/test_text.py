"""fastbert.common.text: the tokenizer wrapper and mean pooling against sentence-transformers."""

import torch

import fastbert
from fastbert.common import text
from fastbert.config import FastBertConfig


def test_mean_pooling_matches_sentence_transformers(minilm_dir):
    from sentence_transformers import SentenceTransformer

    texts = ["The cat sat on the mat.", "A much longer sentence, so that the first one is padded in the batch."]
    config = FastBertConfig.from_json_file(f"{minilm_dir}/config.json")
    batch = text.TextEncoder(minilm_dir, config)(texts)
    assert batch["attention_mask"][0].sum() < batch["attention_mask"][1].sum()  # padding really happens
    with torch.inference_mode():
        hidden = fastbert.from_pretrained(minilm_dir).eval()(**batch).last_hidden_state
    ours = text.mean_pool(hidden, batch["attention_mask"])
    theirs = torch.from_numpy(SentenceTransformer(minilm_dir, device="cpu").encode(texts, normalize_embeddings=True))
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)
