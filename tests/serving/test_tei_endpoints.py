"""TEI's wider API on a real `fastbert serve` (task embed, all-MiniLM-L6-v2): /similarity, /tokenize, /decode,
/embed_all, /embed_sparse (a 400 without a masked-LM head; SPLADE weights equal to transformers' with one),
``dimensions`` (Matryoshka) on /embed and /v1/embeddings, OpenAI's python client with every option of
``embeddings.create``, and /health answering 503 until the warm-up is done."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import numpy as np
import pytest
import torch

TOLERANCE = 1e-5
TEXTS = ["The cat sat on the mat.", "Ein Hund bellt laut.", "How do I reset my password?"]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["--max-client-batch-size", "8"])


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=-1, keepdims=True)


def test_similarity_is_the_cosine_of_the_direct_embeddings(client, direct):
    answer = client.post("/similarity", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}})
    assert answer.status_code == 200, answer.text
    rows = direct(TEXTS)
    np.testing.assert_allclose(answer.json(), rows[1:] @ rows[0], atol=TOLERANCE)
    with_params = client.post("/similarity", json={"inputs": {"source_sentence": "word " * 400, "sentences": ["a"]},
                                                   "parameters": {"truncate": True}})
    assert with_params.status_code == 200 and len(with_params.json()) == 1


@pytest.mark.parametrize(("inputs", "name"), [
    ({"source_sentence": "a", "sentences": ["b", " "]}, "sentences[1] is empty"),
    ({"source_sentence": "a", "sentences": ["b", "\u200b"]}, "sentences[1] is empty: only invisible characters"),
    ({"source_sentence": "a", "sentences": ["\u0301", "b"]}, "sentences[0] is empty: nothing the tokenizer keeps"),
    ({"source_sentence": "\u0301", "sentences": ["b"]}, "source_sentence is empty: nothing the tokenizer keeps"),
    ({"source_sentence": "\ufeff", "sentences": ["b"]}, "source_sentence is empty: only invisible characters"),
    ({"source_sentence": "a", "sentences": ["b", "word " * 400]}, "sentences[1] is longer than the maximum"),
    ({"source_sentence": " ", "sentences": ["b"]}, "source_sentence is empty"),
    ({"source_sentence": "word " * 400, "sentences": ["b"]}, "source_sentence is longer than the maximum"),
])
def test_similarity_names_a_sentence_alike_in_every_error(client, inputs, name):
    """A blank and a too-long sentence are named alike, as the body names them (the engine numbers the source
    sentence 0 and sentences[i] i + 1)."""
    answer = client.post("/similarity", json={"inputs": inputs})
    assert answer.status_code in (413, 422) and answer.json()["error"].startswith(name), answer.text


def test_tokenize_and_decode_round_trip(client, embedder):
    answer = client.post("/tokenize", json={"inputs": TEXTS[:2]})
    assert answer.status_code == 200, answer.text
    tokens = answer.json()
    ids, _ = embedder.tokenize(TEXTS[:2])
    assert [[t["id"] for t in row] for row in tokens] == ids
    first = tokens[0]
    assert first[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert first[1]["text"] == "The" and (first[1]["start"], first[1]["stop"]) == (0, 3) and not first[1]["special"]
    plain = client.post("/tokenize", json={"inputs": TEXTS[0], "add_special_tokens": False}).json()
    assert [t["id"] for t in plain[0]] == ids[0][1:-1]
    decoded = client.post("/decode", json={"ids": ids}).json()
    assert decoded == [t.lower() for t in TEXTS[:2]]  # an uncased vocabulary
    one = client.post("/decode", json={"ids": ids[0], "skip_special_tokens": False}).json()
    assert one == ["[CLS] the cat sat on the mat. [SEP]"]


def test_embed_all_is_what_the_pooling_averages(client):
    answer = client.post("/embed_all", json={"inputs": TEXTS})
    assert answer.status_code == 200, answer.text
    tokens = client.post("/tokenize", json={"inputs": TEXTS}).json()
    pooled = np.array(client.post("/embed", json={"inputs": TEXTS, "normalize": False}).json())
    for row, toks, mean in zip(answer.json(), tokens, pooled, strict=True):
        hidden = np.array(row)
        assert hidden.shape == (len(toks), 384)
        np.testing.assert_allclose(hidden.mean(axis=0), mean, atol=TOLERANCE)


def test_embed_all_carries_teis_timing_headers(client, check_timing_headers):
    """The unbatched route times its forward (run between two batches) as the batched ones do."""
    texts = [*TEXTS, "a second, longer text about servers " * 20]
    tokens = sum(len(t) for t in client.post("/tokenize", json={"inputs": texts}).json())
    answer = client.post("/embed_all", json={"inputs": texts})
    check_timing_headers(answer, 60000, tokens, sum(map(len, texts)))


def test_dimensions_truncate_then_renormalise(client, direct):
    raw = np.array(client.post("/embed", json={"inputs": TEXTS, "normalize": False}).json())
    for dims in (1, 7, 130):
        expected = unit(raw[:, :dims])
        tei = np.array(client.post("/embed", json={"inputs": TEXTS, "dimensions": dims}).json())
        np.testing.assert_allclose(tei, expected, atol=TOLERANCE)
        openai = client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": dims}).json()
        np.testing.assert_allclose(np.array([d["embedding"] for d in openai["data"]]), expected, atol=TOLERANCE)
    full = client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 384}).json()
    np.testing.assert_allclose(np.array([d["embedding"] for d in full["data"]]), direct(TEXTS), atol=TOLERANCE)


def test_embed_sparse_without_a_masked_lm_head_is_400(client):
    answer = client.post("/embed_sparse", json={"inputs": "a text"})
    assert answer.status_code == 400 and "masked-LM head" in answer.json()["error"]


BAD_BODIES = [  # (route, body, status, words of the message)
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 422, "no inputs"),
    ("/similarity", {"inputs": {"source_sentence": " ", "sentences": ["b"]}}, 422, "source_sentence is empty"),
    ("/similarity", {"inputs": {"sentences": ["b"]}}, 422, "source_sentence"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"] * 9}}, 413, "at most 8"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"x": 1}}, 422, "x"),
    ("/tokenize", {"inputs": [""]}, 422, "empty"),
    ("/tokenize", {"inputs": "a", "prompt_name": "query"}, 422, "prompt_name"),
    ("/decode", {"ids": []}, 422, "no ids"),
    ("/decode", {"ids": [[1, 2], [-3]]}, 422, "input 1"),
    ("/decode", {"ids": [10**7]}, 422, "[0, 30522)"),
    ("/decode", {"ids": "101"}, 422, "ids"),
    ("/embed_all", {"inputs": "word " * 400}, 413, "input 0"),
    ("/embed_all", {"inputs": []}, 422, "no inputs"),
    ("/embed_all", {"inputs": ["a", "\u0301"]}, 422, "input 1 is empty: nothing the tokenizer keeps (U+0301"),
    ("/embed_all", {"inputs": ["\u200b"]}, 422, "input 0 is empty: only invisible characters (U+200B"),
    ("/tokenize", {"inputs": ["a", "\u200b"]}, 422, "input 1 is empty: only invisible characters (U+200B"),
    ("/embed_sparse", {"inputs": []}, 400, "masked-LM"),
]


@pytest.mark.parametrize(("route", "body", "status", "words"), BAD_BODIES)
def test_bad_bodies_are_4xx_with_a_message(client, route, body, status, words):
    answer = client.post(route, json=body)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]


def test_openai_client_with_every_option(server, direct, embedder):
    openai = pytest.importorskip("openai")  # the dev extra installs it
    import base64

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    expected = direct(TEXTS)
    one = client.embeddings.create(model="minilm", input=TEXTS[0], user="test-user")
    assert one.model == "minilm" and len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=TOLERANCE)
    many = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=TOLERANCE)
    assert [d.index for d in many.data] == [0, 1, 2] and many.usage.prompt_tokens > 0
    ids, _ = embedder.tokenize(TEXTS)
    by_ids = client.embeddings.create(model="minilm", input=ids)
    np.testing.assert_allclose([d.embedding for d in by_ids.data], expected, atol=TOLERANCE)
    one_row = client.embeddings.create(model="minilm", input=ids[1])
    np.testing.assert_allclose(one_row.data[0].embedding, expected[1], atol=TOLERANCE)
    short = client.embeddings.create(model="minilm", input=TEXTS, dimensions=64, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in short.data], unit(expected[:, :64]), atol=TOLERANCE)
    # base64: the client decodes it to floats when it asked for none itself; ask for it explicitly here
    raw = client.embeddings.with_raw_response.create(model="minilm", input=TEXTS, encoding_format="base64",
                                                     dimensions=32).http_response.json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_allclose(decoded, unit(expected[:, :32]), atol=TOLERANCE)
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model="minilm", input=TEXTS, dimensions=1000)
    assert refused.value.status_code == 422 and "dimensions" in str(refused.value)


@pytest.fixture(scope="module")
def splade_dir(tmp_path_factory, minilm_dir) -> str:
    """A small seeded BertForMaskedLM (2 layers, H=64) with all-MiniLM-L6-v2's tokenizer: a SPLADE-shaped model."""
    import transformers

    torch.manual_seed(7)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=512)
    directory = tmp_path_factory.mktemp("splade")
    transformers.BertForMaskedLM(config).eval().save_pretrained(directory)
    for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(minilm_dir, name)):
            shutil.copy(os.path.join(minilm_dir, name), directory)
    return str(directory)


def test_embed_sparse_equals_transformers_splade(start_server, splade_dir, check_timing_headers):
    import transformers

    server = start_server(["--model", splade_dir, "--warmup", "none"])
    answer = httpx.post(server.url + "/embed_sparse", json={"inputs": TEXTS[:2]}, timeout=60)
    assert answer.status_code == 200, answer.text
    model = transformers.BertForMaskedLM.from_pretrained(splade_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(splade_dir)
    tokens = sum(len(ids) for ids in tokenizer(TEXTS[:2])["input_ids"])
    check_timing_headers(answer, 60000, tokens, sum(map(len, TEXTS[:2])))  # the MLM head: ms of forward
    for text, pairs in zip(TEXTS[:2], answer.json(), strict=True):
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
        expected = torch.log1p(torch.relu(logits)).amax(dim=0)
        got = torch.zeros_like(expected)
        got[[p["index"] for p in pairs]] = torch.tensor([p["value"] for p in pairs])
        assert all(p["value"] > 0 for p in pairs)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # a server of its own with a full warm-up: ~14 s here
def test_health_is_503_until_the_warm_up_is_done(start_server):
    server = start_server(["--warmup", "full", "--warmup-seconds", "30"], wait=False)
    seen, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        seen.append((answer.status_code, answer.json()["status"]))
        if answer.status_code == 200:
            break
        time.sleep(0.05)
    assert seen and seen[-1] == (200, "ok"), server.output()
    assert (503, "warming up") in seen  # the server answered while it warmed, and said it was not ready
    assert "warm-up full" in server.output()
