"""Rerank and classification servers on checkpoints built offline (all-MiniLM-L6-v2 under
BertForSequenceClassification, seeded heads): /rerank against transformers' cross-encoder scores, /predict of texts
and pairs against transformers' logits."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

QUERY = "How do I reset my password?"
TEXTS = ["Click 'forgot password' on the login page to get a reset link.", "The weather is sunny today.",
         "Passwords must be at least twelve characters long.", "Our office opens at nine."]


def transformers_logits(model_dir: str, first: list[str], second: list[str] | None = None) -> np.ndarray:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(**tokenizer(first, second, padding=True, return_tensors="pt")).logits.numpy()


@pytest.fixture(scope="module")
def reranker(start_server, reranker_dir):
    return start_server(["--task", "rerank", "--model", reranker_dir])


def test_rerank_scores_sorted_raw_and_sigmoid(reranker, reranker_dir):
    logits = transformers_logits(reranker_dir, [QUERY] * len(TEXTS), TEXTS)[:, 0]
    raw = httpx.post(reranker.url + "/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True,
                                                     "return_text": True}, timeout=60).json()
    assert [r["index"] for r in raw] == list(np.argsort(-logits))
    assert [r["text"] for r in raw] == [TEXTS[r["index"]] for r in raw]
    np.testing.assert_allclose([r["score"] for r in raw], np.sort(logits)[::-1], atol=1e-4)
    squashed = httpx.post(reranker.url + "/rerank", json={"query": QUERY, "texts": TEXTS}, timeout=60).json()
    np.testing.assert_allclose([r["score"] for r in squashed], 1 / (1 + np.exp(-np.sort(logits)[::-1])), atol=1e-5)
    assert "text" not in squashed[0]


def test_rerank_bad_inputs_and_wrong_endpoint(reranker):
    for body, status in (({"query": "", "texts": ["a"]}, 422), ({"query": "q", "texts": []}, 422),
                         ({"query": "q", "texts": ["a", ""]}, 422), ({"query": "q"}, 422),
                         ({"query": "q", "texts": ["word " * 600]}, 413)):
        answer = httpx.post(reranker.url + "/rerank", json=body, timeout=60)
        assert answer.status_code == status, (body, answer.text)
    assert httpx.post(reranker.url + "/embed", json={"inputs": "a"}).status_code == 400
    assert httpx.get(reranker.url + "/info").json()["labels"] == ["relevance"]


def test_rerank_and_predict_carry_teis_timing_headers(reranker, check_timing_headers):
    """The pairs' characters (query + text each) and tokens, and the times in whole milliseconds: 32 pairs are
    milliseconds of forward, so a route that dropped its timing (all 0) fails."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(httpx.get(reranker.url + "/info").json()["model_dir"] + "/tokenizer.json")
    tokenizer.no_padding()  # the checkpoint's file pads to 128
    texts = TEXTS * 8
    tokens = sum(len(tokenizer.encode(QUERY, text).ids) for text in texts)
    characters = sum(len(QUERY) + len(text) for text in texts)
    for route, body in (("/rerank", {"query": QUERY, "texts": texts}),
                        ("/predict", {"inputs": [[QUERY, text] for text in texts]})):
        answer = httpx.post(reranker.url + route, json=body, timeout=60)
        check_timing_headers(answer, 60000, tokens, characters)


@pytest.fixture(scope="module")
def classifier(start_server, classifier_dir):
    return start_server(["--task", "classify", "--model", classifier_dir])


def test_predict_texts_and_pairs(classifier, classifier_dir):
    server = classifier
    texts = ["I loved this film.", "Terrible service, never again."]
    probabilities = torch.softmax(torch.from_numpy(transformers_logits(classifier_dir, texts)), dim=1).numpy()
    batch = httpx.post(server.url + "/predict", json={"inputs": [[t] for t in texts]}, timeout=60).json()
    for answer, expected in zip(batch, probabilities, strict=True):
        assert [a["label"] for a in answer] == [["negative", "neutral", "positive"][i] for i in np.argsort(-expected)]
        np.testing.assert_allclose([a["score"] for a in answer], np.sort(expected)[::-1], atol=1e-5)
    pair_logits = transformers_logits(classifier_dir, [texts[0]], [texts[1]])[0]
    pair = httpx.post(server.url + "/predict", json={"inputs": texts, "raw_scores": True}, timeout=60).json()
    np.testing.assert_allclose(sorted(a["score"] for a in pair), np.sort(pair_logits), atol=1e-4)
    single = httpx.post(server.url + "/predict", json={"inputs": texts[0]}, timeout=60).json()
    assert single[0]["label"] == batch[0][0]["label"]
    bad = httpx.post(server.url + "/predict", json={"inputs": [["a", "b", "c"]]}, timeout=60)
    assert bad.status_code == 422 and "pair" in bad.json()["error"]
    assert httpx.post(server.url + "/rerank", json={"query": "q", "texts": ["a"]}).status_code == 400


@pytest.mark.parametrize(("inputs", "name"), [
    ("", "input 0"), ("   ", "input 0"), (["", "b"], "input 0 (the first text of its pair)"),
    (["b", "  "], "input 0 (the second text of its pair)"), ([""], "input 0"),
    ([["", "b"]], "input 0 (the first text of its pair)"), ([["a"], [" "]], "input 1"),
    # blank as in `fastbert embed`: invisible characters only, or nothing the tokenizer keeps (said why)
    ("\u200b", "input 0"), (["b", "\ufeff"], "input 0 (the second text of its pair)"),
    ([["a"], ["\x00", "b"]], "input 1 (the first text of its pair)"),
    ("\u0301", "input 0"), (["b", "\ue000"], "input 0 (the second text of its pair)"),
    ([["a"], ["b", "\u0301"]], "input 1 (the second text of its pair)"), ([["a"], ["\u0301"]], "input 1"),
])
def test_predict_refuses_a_blank_text_in_every_shape(classifier, inputs, name):
    """As /rerank and /embed: 422 naming the input, whether the body is one text, one pair or a batch."""
    answer = httpx.post(classifier.url + "/predict", json={"inputs": inputs}, timeout=60)
    assert answer.status_code == 422, (inputs, answer.text)
    assert answer.json()["error"].startswith(f"{name} is empty: "), answer.text


def test_a_rerankers_predict_refuses_a_blank_text_of_its_pair(reranker):
    for inputs in (["q", ""], ["", "q"], [["q", " "]], ["q", "\u200b"], [["\u0301", "q"]]):
        answer = httpx.post(reranker.url + "/predict", json={"inputs": inputs}, timeout=60)
        assert answer.status_code == 422 and "is empty" in answer.json()["error"], (inputs, answer.text)


@pytest.mark.parametrize(("body", "words"), [
    ({"query": "\u200b", "texts": ["a"]}, "query is empty: only invisible characters (U+200B ZERO WIDTH SPACE)"),
    ({"query": "q", "texts": ["a", "\u200e"]}, "input 1 is empty: only invisible characters (U+200E"),
    ({"query": "\u0301", "texts": ["a", "b"]}, "query is empty: nothing the tokenizer keeps (U+0301 COMBINING ACUTE"),
    ({"query": "q", "texts": ["a", "\ue000"]}, "input 1 is empty: nothing the tokenizer keeps (U+E000)"),
])
def test_rerank_refuses_a_blank_query_or_text_saying_why(reranker, body, words):
    """Blank as in `fastbert embed`; the query and the texts named as a blank one of whitespace is."""
    answer = httpx.post(reranker.url + "/rerank", json=body, timeout=60)
    assert answer.status_code == 422 and answer.json()["error"].startswith(words), (body, answer.text)


def test_real_texts_in_any_script_are_scored(reranker, classifier):
    texts = ["\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u200f\u0645\u0631\u062d\u0628\u0627\u200f",
             "\u0915\u094d\u200d\u0937", "\u4e2d\u6587\u6587\u672c", "a\u0301"]
    ranked = httpx.post(reranker.url + "/rerank", json={"query": "\u200bq", "texts": texts}, timeout=60)
    assert ranked.status_code == 200 and len(ranked.json()) == len(texts), ranked.text
    predicted = httpx.post(classifier.url + "/predict", json={"inputs": [[t] for t in texts]}, timeout=60)
    assert predicted.status_code == 200 and len(predicted.json()) == len(texts), predicted.text


def test_predict_and_rerank_truncation_direction(reranker, reranker_dir):
    """truncation_direction Left cuts the start of a too-long input: the scores equal those of the text made of
    the tokens kept; Right (the default) keeps the start."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{reranker_dir}/tokenizer.json")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    assert len(tokenizer.encode("alpha omega").ids) == 4  # [CLS] alpha omega [SEP]: one token per word
    text = "alpha " * 300 + "omega " * 300  # 600 tokens, the limit is 512
    tail = "alpha " * 210 + "omega " * 300  # the 510 tokens Left keeps
    head = "alpha " * 300 + "omega " * 210  # the 510 tokens Right keeps

    def predict(inputs, **options):
        answer = httpx.post(reranker.url + "/predict", json={"inputs": inputs, "raw_scores": True, **options},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()[0]["score"]

    left = predict(text, truncate=True, truncation_direction="Left")
    assert left == pytest.approx(predict(tail), abs=1e-5)
    assert predict(text, truncate=True) == pytest.approx(predict(head), abs=1e-5)
    assert abs(left - predict(head)) > 1e-4
    ranked = httpx.post(reranker.url + "/rerank", json={"query": "q", "texts": [text], "raw_scores": True,
                                                        "truncate": True, "truncation_direction": "left"},
                        timeout=60).json()
    pair = httpx.post(reranker.url + "/predict", json={"inputs": ["q", text], "raw_scores": True, "truncate": True,
                                                       "truncation_direction": "Left"}, timeout=60).json()
    assert ranked[0]["score"] == pytest.approx(pair[0]["score"], abs=1e-5)
    assert httpx.post(reranker.url + "/predict", json={"inputs": text, "truncation_direction": "Left"},
                      timeout=60).status_code == 413
