"""A real `fastbert serve` (task embed, all-MiniLM-L6-v2) on loopback: every endpoint, every bad input a client
can send (always a 4xx with a message, never a 500), /metrics through prometheus-client's parser, and 100
concurrent requests with distinct texts each getting exactly their own vectors."""

from __future__ import annotations

import asyncio
import base64
import json

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastbert.training.corpus import cpython_sentences

BODY_LIMIT = 65536
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(["--max-queue", "256", "--max-body-bytes", str(BODY_LIMIT), "--max-client-batch-size", "32"])


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_embed_matches_direct_embedding(client, direct):
    texts = ["The cat sat on the mat.", "Ein Hund bellt.", "How do I reset my password?"]
    answer = client.post("/embed", json={"inputs": texts})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(np.array(answer.json(), dtype=np.float32), direct(texts), atol=TOLERANCE)
    single = client.post("/embed", json={"inputs": texts[0]}).json()
    assert len(single) == 1 and len(single[0]) == 384


def test_real_texts_in_any_script_are_served(client, direct):
    """Invisible characters inside a real text stay part of it: an emoji ZWJ sequence, Arabic between direction
    marks, Devanagari with a joiner, CJK, an accented letter; each gets `fastbert embed`'s vector."""
    texts = ["\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u200f\u0645\u0631\u062d\u0628\u0627\u200f",
             "\u0915\u094d\u200d\u0937", "\u4e2d\u6587\u6587\u672c", "\u200bword", "a\u0301"]
    answer = client.post("/embed", json={"inputs": texts})
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(np.array(answer.json(), dtype=np.float32), direct(texts), atol=TOLERANCE)
    openai = client.post("/v1/embeddings", json={"input": texts})
    assert openai.status_code == 200, openai.text


def test_embed_normalize_false_gives_the_unnormalised_pooling(client, direct):
    raw = np.array(client.post("/embed", json={"inputs": ["a short text"], "normalize": False}).json())
    assert abs(np.linalg.norm(raw) - 1) > 1e-3
    np.testing.assert_allclose(raw / np.linalg.norm(raw), direct(["a short text"]), atol=TOLERANCE)


def test_too_long_input_is_413_unless_truncated(client, direct):
    long_text = "word " * 400  # > 256 tokens, the checkpoint's max_seq_length
    refused = client.post("/embed", json={"inputs": ["short", long_text]})
    assert refused.status_code == 413 and "input 1" in refused.json()["error"]
    as_null = client.post("/embed", json={"inputs": ["short", long_text], "truncate": None})  # TEI's Option<bool>
    assert as_null.status_code == 413, as_null.text
    assert client.post("/v1/embeddings", json={"input": "short", "truncate": None}).status_code == 200
    assert client.post("/embed", json={"inputs": "short", "truncate": "yes"}).status_code == 422
    cut = client.post("/embed", json={"inputs": [long_text], "truncate": True})
    assert cut.status_code == 200
    np.testing.assert_allclose(np.array(cut.json()), direct([long_text]), atol=TOLERANCE)


def test_openai_embeddings_truncate_as_the_413_says(client, direct, embedder):
    long_text = "word " * 400
    refused = client.post("/v1/embeddings", json={"input": ["short", long_text]})
    assert refused.status_code == 413 and "send truncate: true to cut it" in refused.json()["error"]["message"]
    cut = client.post("/v1/embeddings", json={"input": ["short", long_text], "truncate": True})
    assert cut.status_code == 200, cut.text
    rows = np.array([item["embedding"] for item in cut.json()["data"]])
    np.testing.assert_allclose(rows, direct(["short", long_text]), atol=TOLERANCE)
    left = client.post("/v1/embeddings", json={"input": [long_text + "tail"], "truncate": True,
                                               "truncation_direction": "Left"}).json()["data"][0]["embedding"]
    assert not np.allclose(left, rows[1], atol=1e-3)  # the other end was kept
    ids = embedder.tokenize([long_text])[0][0][:-1] * 2  # too many ids: refused, with no truncate hint
    refused_ids = client.post("/v1/embeddings", json={"input": [ids], "truncate": True})
    assert refused_ids.status_code == 413 and "token ids are never cut" in refused_ids.json()["error"]["message"]


def test_openai_embeddings_float_base64_and_token_ids(client, embedder, direct):
    texts = ["first text", "a second, longer text about servers"]
    floats = client.post("/v1/embeddings", json={"input": texts, "model": "minilm"}).json()
    assert floats["object"] == "list" and floats["model"] == "minilm"
    assert [d["index"] for d in floats["data"]] == [0, 1]
    expected = direct(texts)
    np.testing.assert_allclose(np.array([d["embedding"] for d in floats["data"]]), expected, atol=TOLERANCE)
    ids, _ = embedder.tokenize(texts)
    assert floats["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    packed = client.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"}).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]])
    np.testing.assert_array_equal(decoded, np.array([d["embedding"] for d in floats["data"]], dtype=np.float32))
    by_ids = client.post("/v1/embeddings", json={"input": ids}).json()
    np.testing.assert_allclose(np.array([d["embedding"] for d in by_ids["data"]]), expected, atol=TOLERANCE)
    one = client.post("/embeddings", json={"input": ids[0]}).json()  # the route without /v1, one row of ids
    np.testing.assert_allclose(np.array(one["data"][0]["embedding"]), expected[0], atol=TOLERANCE)


def test_health_info_and_wrong_task(client):
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/info").json()
    assert info["task"] == "embed" and info["dimension"] == 384 and info["dtype"] == "float32"
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == 32 and info["max_queue"] == 256
    refused = client.post("/rerank", json={"query": "q", "texts": ["a"]})
    assert refused.status_code == 400 and "task 'embed'" in refused.json()["error"]


BAD_BODIES = [  # (route, body, status, words of the message)
    ("/embed", {"inputs": [""]}, 422, "empty"),
    ("/embed", {"inputs": ["fine", "   "]}, 422, "input 1 is empty"),
    # blank as in `fastbert embed`: invisible characters only, or nothing the tokenizer keeps (was [CLS] [SEP])
    ("/embed", {"inputs": ["fine", "\u200b"]}, 422, "input 1 is empty: only invisible characters (U+200B ZERO WIDTH "
                                                    "SPACE); every text needs at least one non-blank character"),
    ("/embed", {"inputs": ["fine", "\u0301"]}, 422, "input 1 is empty: nothing the tokenizer keeps (U+0301 COMBINING "
                                                    "ACUTE ACCENT); every text needs at least one non-blank character"),
    ("/embed", {"inputs": "\ufeff\x00 \u200e"}, 422, "input 0 is empty: only invisible characters (U+FEFF ZERO WIDTH "
                                                     "NO-BREAK SPACE, U+0000, U+200E LEFT-TO-RIGHT MARK)"),
    ("/v1/embeddings", {"input": ["fine", "\u2060"]}, 422, "input 1 is empty: only invisible characters (U+2060"),
    ("/v1/embeddings", {"input": "\ue000"}, 422, "input 0 is empty: nothing the tokenizer keeps (U+E000)"),
    ("/embed", {"inputs": []}, 422, "no inputs"),
    ("/embed", {"inputs": 5}, 422, "valid string"),
    ("/embed", {"inputs": ["a", 3]}, 422, "valid string"),
    ("/embed", {"inputs": "a", "normalize": "yes"}, 422, "normalize"),
    ("/embed", {"inputs": "a", "nromalize": False}, 422, "nromalize"),
    ("/embed", {"texts": ["a"]}, 422, "inputs"),
    ("/embed", ["a"], 422, "dictionary"),
    ("/embed", {"inputs": ["t"] * 33}, 413, "at most 32"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 422, "encoding_format"),
    ("/v1/embeddings", {"input": [10**9]}, 422, "token ids"),
    ("/v1/embeddings", {"input": [[101, 102], []]}, 422, "token ids"),
    ("/v1/embeddings", {"input": "a", "dimensions": 385}, 422, "dimensions"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, 422, "dimensions"),
    ("/embed", {"inputs": "a", "dimensions": 400}, 422, "dimensions"),
    ("/v1/embeddings", {"input": ["x"] * 40}, 413, "at most 32"),
]


@pytest.mark.parametrize(("route", "body", "status", "words"), BAD_BODIES)
def test_bad_bodies_are_4xx_with_a_message(client, route, body, status, words):
    answer = client.post(route, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    message = error["message"] if route.startswith("/v1") else error
    assert words in message


@pytest.mark.parametrize(("content", "status", "words"), [
    (b'{"inputs": "\xff\xfe caf\xe9"}', 422, "UTF-8"),
    (b'{"inputs": "\\ud800 lone"}', 422, "UTF-8"),
    (b'{"inputs": ["a", }', 422, "not valid JSON"),
    (b"", 422, "empty: send a JSON object"),
    (b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}", 422, "not valid JSON"),  # deeper than the parser goes
])
def test_bad_bytes_are_4xx(client, content, status, words):
    answer = client.post("/embed", content=content, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]


@pytest.mark.parametrize("route", ["/embed", "/v1/embeddings"])
def test_a_compressed_body_is_415_naming_its_content_encoding(client, route):
    import gzip

    body = gzip.compress(json.dumps({"inputs" if route == "/embed" else "input": "a text"}).encode())
    answer = client.post(route, content=body, headers={"content-type": "application/json",
                                                        "content-encoding": "gzip"})
    assert answer.status_code == 415, answer.text
    error = answer.json()["error"]
    message = error["message"] if route.startswith("/v1") else error
    assert "Content-Encoding gzip is not supported" in message
    assert answer.headers["accept-encoding"] == "identity"
    plain = client.post(route, content=gzip.decompress(body),
                        headers={"content-type": "application/json", "content-encoding": "identity"})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/json", None])
def test_a_json_body_sent_as_another_type_says_which_header_to_send(client, content_type):
    headers = {"content-type": content_type} if content_type else {}
    answer = client.post("/embed", content=b'{"inputs": "a text"}', headers=headers)
    assert answer.status_code == 422
    assert answer.json()["error"].startswith("send the body with 'Content-Type: application/json' (it came as "
                                             f"{content_type or 'none'}); ")
    for accepted in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        assert client.post("/embed", content=b'{"inputs": "a text"}', headers={"content-type": accepted}).status_code \
            == 200, accepted


def test_a_json_body_of_a_wrong_shape_gets_no_content_type_hint(client):
    answer = client.post("/embed", content=b'{"inputs": 3}', headers={"content-type": "Application/JSON"})
    assert answer.status_code == 422 and not answer.json()["error"].startswith("send the body with"), answer.text


def test_body_over_the_limit_is_refused_before_parsing(client, server):
    huge = json.dumps({"inputs": ["x" * 1000] * 100}).encode()  # 100 kB > 64 kB
    declared = client.post("/embed", content=huge, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "limit" in declared.json()["error"]

    def chunks():  # no Content-Length: refused while reading
        for start in range(0, len(huge), 8192):
            yield huge[start:start + 8192]

    streamed = client.post("/embed", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert client.get("/health").status_code == 200


def test_metrics_parse_and_count(client):
    client.post("/embed", json={"inputs": ["count me"]})
    client.post("/embed", json={"inputs": [""]})
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    requests = {(s.labels["endpoint"], s.labels["status"]): s.value for s in families["fastbert_requests"].samples
                if s.name == "fastbert_requests_total"}
    assert requests[("/embed", "200")] >= 1 and requests[("/embed", "422")] >= 1
    assert "fastbert_queue_depth" in families and "fastbert_request_seconds" in families
    batch_count = [s.value for s in families["fastbert_batch_tokens"].samples if s.name.endswith("_count")]
    assert batch_count and batch_count[0] >= 1
    tokens = [s.value for s in families["fastbert_tokens"].samples if s.name == "fastbert_tokens_total"]
    assert tokens[0] >= 3


def test_100_concurrent_requests_get_their_own_vectors(server, direct):
    sentences = list(cpython_sentences(limit=400))
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, 400), size=99, replace=False))
    groups = [list(g) for g in np.split(np.array(sentences, dtype=object), cuts)]  # distinct texts per request

    async def ask(client, texts):
        return await client.post("/embed", json={"inputs": texts})

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(ask(client, g) for g in groups))

    answers = asyncio.run(all_at_once())
    assert [a.status_code for a in answers] == [200] * 100
    expected = direct(sentences)
    got = np.concatenate([np.array(a.json(), dtype=np.float32) for a in answers])
    np.testing.assert_allclose(got, expected, atol=TOLERANCE)


def test_truncation_direction_left_keeps_the_end_of_the_text(client, minilm_dir):
    """TEI's truncation_direction: Left keeps [CLS] + the last 254 tokens + [SEP], the same vector as those ids
    sent as token ids; Right (the default) keeps the start."""
    from tokenizers import Tokenizer

    text = "alpha beta " * 150 + "omega " * 200  # 500 words: the start and the end read differently
    tokenizer = Tokenizer.from_file(f"{minilm_dir}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    full = tokenizer.encode(text).ids
    assert len(full) > 256
    left_ids = full[:1] + full[-255:]
    by_ids = np.array(client.post("/v1/embeddings", json={"input": [left_ids]}).json()["data"][0]["embedding"])
    for direction in ("Left", "left"):
        left = client.post("/embed", json={"inputs": [text, "short"], "truncate": True,
                                           "truncation_direction": direction})
        assert left.status_code == 200, left.text
        np.testing.assert_allclose(np.array(left.json()[0]), by_ids, atol=TOLERANCE)
    right = np.array(client.post("/embed", json={"inputs": [text], "truncate": True,
                                                 "truncation_direction": "Right"}).json()[0])
    default = np.array(client.post("/embed", json={"inputs": [text], "truncate": True}).json()[0])
    np.testing.assert_array_equal(right, default)
    assert np.abs(right - by_ids).max() > 0.01
    short = client.post("/embed", json={"inputs": ["short"], "truncation_direction": "Left"}).json()[0]
    np.testing.assert_allclose(short, left.json()[1], atol=TOLERANCE)  # nothing to cut: the direction is moot
    refused = client.post("/embed", json={"inputs": [text], "truncation_direction": "Left"})
    assert refused.status_code == 413  # a direction without truncate: true still refuses a too-long input
    wrong = client.post("/embed", json={"inputs": "a", "truncation_direction": "Middle"})
    assert wrong.status_code == 422 and "truncation_direction" in wrong.json()["error"]


def test_prompt_name_is_refused_when_the_model_has_no_prompts(client):
    answer = client.post("/embed", json={"inputs": "a", "prompt_name": "query"})
    assert answer.status_code == 422
    assert "prompt_name 'query'" in answer.json()["error"] and "none" in answer.json()["error"]
    assert client.get("/info").json()["prompts"] == []


def test_prompt_name_puts_the_checkpoints_prompt_first(start_server, minilm_dir, tmp_path, direct):
    """A copy of all-MiniLM-L6-v2 whose sentence-transformers config declares prompts: prompt_name 'query' embeds
    'query: ' + text; an unknown name is a 422 naming the prompts there are."""
    import os

    for name in os.listdir(minilm_dir):
        os.symlink(os.path.join(minilm_dir, name), tmp_path / name)
    (tmp_path / "config_sentence_transformers.json").unlink()
    prompts = {"query": "query: ", "passage": "passage: "}
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
    server = start_server(["--model", str(tmp_path)])
    texts = ["How do I reset my password?", "Ein Hund bellt."]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/info").json()["prompts"] == ["query", "passage"]
        answer = client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(np.array(answer.json()), direct([f"query: {t}" for t in texts]), atol=TOLERANCE)
        plain = client.post("/embed", json={"inputs": texts}).json()
        np.testing.assert_allclose(np.array(plain), direct(texts), atol=TOLERANCE)
        unknown = client.post("/embed", json={"inputs": texts, "prompt_name": "document"})
        assert unknown.status_code == 422 and "'query', 'passage'" in unknown.json()["error"]


def test_embed_and_openai_answers_carry_teis_timing_headers(client, embedder, check_timing_headers):
    import time

    texts = ["first text", "a second, longer text about servers " * 20]
    ids, _ = embedder.tokenize(texts)
    for route, body in (("/embed", {"inputs": texts}), ("/v1/embeddings", {"input": texts}),
                        ("/similarity", {"inputs": {"source_sentence": texts[0], "sentences": texts[1:]}})):
        start = time.perf_counter()
        answer = client.post(route, json=body)
        check_timing_headers(answer, (time.perf_counter() - start) * 1000, sum(map(len, ids)), sum(map(len, texts)))
    answer = client.post("/v1/embeddings", json={"input": ids})
    # ~140 tokens: milliseconds of work (a forward timed as 0 fails); token ids count one character each (TEI's rule)
    check_timing_headers(answer, 60000, sum(map(len, ids)), sum(map(len, ids)))
