"""fastbert pretrain: the data it builds (NSP/SOP 50/50, segment ids, masking rates, whole words, packing), the
checkpoints (transformers and fastbert load them), resume after a real SIGKILL equals an uninterrupted run, and
the CLI's refusals (one line each)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fastbert import cli  # noqa: E402
from fastbert.common.resolve import UserError  # noqa: E402
from fastbert.training.corpus import file_documents, split_sentences  # noqa: E402
from fastbert.training.loop import latest_checkpoint  # noqa: E402
from fastbert.training.masking import IGNORE_INDEX  # noqa: E402
from fastbert.training.pretrain import (  # noqa: E402
    DataOptions,
    PretrainingData,
    PretrainSettings,
    continuation_table,
    hold_out,
    mask_whole_words,
    pretrain,
    train_tokenizer,
)

PAD, UNK, CLS, SEP, MASK, VOCAB = 0, 1, 2, 3, 4, 1000
# A tiny model: these tests check the plumbing, not what it learns.
TINY = ["--hidden-size", "16", "--num-layers", "1", "--num-heads", "2", "--vocab-size", "200", "--max-length", "32",
        "--batch-size", "4", "--threads", "1", "--log-every", "1000", "--no-progress"]


def _synthetic_documents(documents: int = 40, segments: int = 12) -> list[list[list[int]]]:
    """Segment j of document d is [100 + d, 500 + j, 7, 8]: the first two ids say where it came from."""
    return [[[100 + d, 500 + j, 7, 8] for j in range(segments)] for d in range(documents)]


def _data(documents, **options) -> PretrainingData:
    return PretrainingData(documents, DataOptions(**options), cls_id=CLS, sep_id=SEP, pad_id=PAD, mask_id=MASK,
                           vocab_size=VOCAB, continuation=torch.zeros(VOCAB, dtype=torch.bool))


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small real text: paragraphs of CPython's reference topics, a blank line between documents."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    blocks = []
    for key in sorted(topics)[:12]:
        sentences = split_sentences(topics[key])[:30]
        if len(sentences) >= 4:
            blocks.append("\n".join(sentences))
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n".join(blocks) + "\n", encoding="utf-8")
    return path


# -------------------------------------------------------------------------------------------------- the data
def test_split_sentences_and_file_documents(tmp_path):
    assert split_sentences("One two three. Four five six!\n\nSeven eight nine? ten") == [
        "One two three.", "Four five six!", "Seven eight nine? ten"]
    path = tmp_path / "t.txt"
    path.write_text("First doc one. First doc two.\nFirst doc three.\n\n\nSecond doc.\n", encoding="utf-8")
    assert file_documents([str(path)]) == [["First doc one.", "First doc two.", "First doc three."],
                                           ["Second doc."]]


def test_hold_out_takes_the_end_of_long_documents():
    docs = [[f"s{i}" for i in range(40)], [f"t{i}" for i in range(5)], [f"u{i}" for i in range(12)]]
    train_docs, held = hold_out(docs, 0.1)
    assert train_docs == [[f"s{i}" for i in range(36)], [f"t{i}" for i in range(5)], [f"u{i}" for i in range(10)]]
    assert held == [[f"s{i}" for i in range(36, 40)], ["u10", "u11"]]


def test_hold_out_whole_documents_when_there_are_many():
    docs = [[f"d{d} s{i}" for i in range(3)] for d in range(40)]
    train_docs, held = hold_out(docs, 0.1, seed=2)
    assert len(held) == 4 and len(train_docs) == 36 and sorted(train_docs + held) == sorted(docs)
    assert hold_out(docs, 0.1, seed=2) == (train_docs, held) and hold_out(docs, 0.1, seed=3)[1] != held


def test_nsp_pairs_are_half_next_half_random_with_segment_ids():
    data = _data(_synthetic_documents(), max_length=16)
    examples = data.examples(epoch=0)
    assert len(examples) == 40 * 11
    labels = [e["label"] for e in examples]
    assert abs(sum(labels) / len(labels) - 0.5) < 0.06  # 440 pairs: 3 standard deviations
    for e in examples:
        ids, types = e["input_ids"], e["token_type_ids"]
        assert ids[0] == CLS and ids[5] == SEP and ids[-1] == SEP and len(ids) == 11
        assert types == [0] * 6 + [1] * 5
        (doc_a, seg_a), (doc_b, seg_b) = (ids[1], ids[2]), (ids[6], ids[7])
        if e["label"] == 0:
            assert doc_a == doc_b and seg_b == seg_a + 1
        else:
            assert doc_a != doc_b
    # each epoch draws its own pairs and order, the same ones every time it is asked for
    assert data.examples(epoch=1) != examples
    assert data.examples(epoch=0) == examples


def test_nsp_balance_on_a_large_sample():
    data = _data(_synthetic_documents(documents=200, segments=51), max_length=16)
    labels = torch.tensor([e["label"] for e in data.examples(epoch=3)], dtype=torch.float)
    assert labels.numel() == 10_000 and abs(float(labels.mean()) - 0.5) < 0.015


def test_sop_pairs_swap_half():
    data = _data(_synthetic_documents(), objective="albert", max_length=16)
    examples = data.examples(epoch=0)
    assert abs(sum(e["label"] for e in examples) / len(examples) - 0.5) < 0.06
    for e in examples:
        seg_a, seg_b = e["input_ids"][2], e["input_ids"][7]
        assert e["input_ids"][1] == e["input_ids"][6]  # same document
        assert seg_b - seg_a == (1 if e["label"] == 0 else -1)


def test_batch_masking_rate_and_determinism():
    data = _data(_synthetic_documents(documents=100, segments=30), max_length=16, batch_size=512)
    batches = data.epoch_batches(0)
    batch = batches[1]
    special = (batch["input_ids"] == CLS) | (batch["input_ids"] == SEP) | (batch["attention_mask"] == 0)
    chosen = batch["labels"] != IGNORE_INDEX
    assert not (chosen & special).any()
    assert abs(float(chosen.sum()) / float((~special).sum()) - 0.15) < 0.01
    assert batch["token_type_ids"].shape == batch["input_ids"].shape and "pair_labels" in batch
    again = data.epoch_batches(0)[1]
    assert all(torch.equal(batch[k], again[k]) for k in batch)  # same (seed, epoch, index): same masks
    assert not torch.equal(batches[0]["labels"], batches[1]["labels"])


def test_whole_word_masking_keeps_words_together():
    gen = torch.Generator().manual_seed(0)
    continuation = torch.zeros(VOCAB, dtype=torch.bool)
    continuation[500:] = True  # ids >= 500 continue the word before them
    ids = torch.randint(10, VOCAB, (64, 200), generator=gen)
    ids[:, 0] = CLS
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, 0] = True
    inputs, labels = mask_whole_words(ids, continuation, mask_token_id=MASK, vocab_size=VOCAB,
                                      special_tokens_mask=special, generator=gen)
    chosen = labels != IGNORE_INDEX
    words = 0
    for row in range(ids.shape[0]):
        start = None
        for col in range(1, ids.shape[1] + 1):
            if col == ids.shape[1] or not continuation[ids[row, col]]:
                if start is not None:
                    states = chosen[row, start:col]
                    assert states.all() or not states.any()
                    masked = inputs[row, start:col] == MASK
                    assert not states.any() or masked.all() or not masked.any()
                    words += 1
                start = col
    word_starts = (~continuation[ids]) & ~special
    word_rate = float((chosen & word_starts).sum()) / float(word_starts.sum())
    assert words == int(word_starts.sum()) and abs(word_rate - 0.15) < 0.02
    assert not chosen[special].any() and torch.equal(labels[chosen], ids[chosen])


ROUND_TRIP = ["Names refer to objects.", "Café, naïve façade: déjà vu in Zürich.", "日本語のテキスト、正しく戻ります。",
              "Привет, мир!", "Emoji 🙂🚀 and ∑ ≤ ≠ →.", "Tabs\tand  double  spaces , before punctuation .",
              "  leading and trailing spaces  "]


def test_roberta_vocabulary_is_a_byte_level_bpe_that_round_trips(tmp_path, corpus):
    documents = file_documents([str(corpus)])
    train_tokenizer(documents, 400, 64, objective="roberta").save_pretrained(tmp_path / "bpe")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "bpe")
    assert "RobertaTokenizer" in type(tokenizer).__name__ and tokenizer.is_fast
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")] == [0, 1, 2, 3, 4]
    assert (tokenizer.cls_token, tokenizer.sep_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")
    assert not any(token.startswith("##") for token in tokenizer.get_vocab())
    held = [s for doc in documents[-3:] for s in doc]
    for text in held + ROUND_TRIP:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == 0 and ids[-1] == 2 and tokenizer.unk_token_id not in ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.tokenize("the <mask> is")[1] != "\u0120"  # <mask> takes the space before it
    # whole words for BPE: a token continues the word before it unless it follows a space (a sentence's first word
    # continues <s>, which masking never chooses, so the word's tokens still share one draw)
    table = continuation_table(tokenizer)
    pieces = tokenizer.tokenize("Namespaces refer to it")
    assert len(pieces) > 4 and [bool(table[tokenizer.convert_tokens_to_ids(t)]) for t in pieces] == \
        [not t.startswith("\u0120") for t in pieces]
    assert not table[:5].any()


def test_bert_and_albert_keep_wordpiece(corpus):
    tokenizer = train_tokenizer(file_documents([str(corpus)]), 400, 64)
    assert type(tokenizer).__name__.startswith("BertTokenizer") and tokenizer.cls_token == "[CLS]"
    assert any(token.startswith("##") for token in tokenizer.get_vocab())
    assert tokenizer.decode(tokenizer("Names refer to objects.")["input_ids"], skip_special_tokens=True) == \
        "names refer to objects."  # lower-cased: WordPiece does not round-trip, which is why roberta has BPE


# A WordPiece vocabulary is the same in every process (tokenizers' WordPieceTrainer alone numbers its "##c" forms in
# hash-map order, which changes from run to run, and breaks ties between merges by those ids).
UNICODE_CORPUS = ["Café, naïve façade: déjà vu in Zürich.", "日本語のテキスト、正しく戻ります。",
                  "Emoji 🙂🚀 and ∑ ≤ →.", "Version 3.11.4 costs $12.50 (or 99%)!", "Привет, мир! Ёлка в Москве.",
                  "The xylophone and the saxophone play in 2024."]
WORDPIECE_TEXTS = ["The while statement is used for repeated execution.", "xylophone", *UNICODE_CORPUS]
WORDPIECE_IN_A_PROCESS = """
import json, sys
from fastbert.training.corpus import file_documents
from fastbert.training.pretrain import train_tokenizer
tokenizer = train_tokenizer(file_documents([sys.argv[1]]), 300, 64)
texts = json.loads(sys.argv[2])
print(json.dumps({"vocab": tokenizer.get_vocab(), "ids": [tokenizer(t)["input_ids"] for t in texts],
                  "tokens": [tokenizer.tokenize(t) for t in texts]}, sort_keys=True))
"""


def _greedy_longest_match(word: str, vocab: dict[str, int]) -> list[str]:
    """WordPiece's inference for one pre-tokenised word: the longest vocabulary prefix, then the longest ``##``
    piece, and so on; the whole word is [UNK] when some rest has no piece."""
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start and (word[start:end] if start == 0 else "##" + word[start:end]) not in vocab:
            end -= 1
        if end == start:
            return ["[UNK]"]
        pieces.append(word[start:end] if start == 0 else "##" + word[start:end])
        start = end
    return pieces


def test_a_wordpiece_vocabulary_is_the_same_in_every_process(tmp_path, corpus):
    text = tmp_path / "corpus.txt"
    text.write_text(corpus.read_text(encoding="utf-8") + "\n\n" + "\n".join(UNICODE_CORPUS * 3) + "\n",
                    encoding="utf-8")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-c", WORDPIECE_IN_A_PROCESS, str(text), json.dumps(WORDPIECE_TEXTS)]
    processes = [subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(3)]  # side by side: each imports torch and transformers
    outputs = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        outputs.append(json.loads(out))
    assert outputs[0]["tokens"][1] == outputs[1]["tokens"][1] == outputs[2]["tokens"][1]  # "xylophone"
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]  # the vocabulary, its ids, the encodings


def test_wordpiece_special_ids_and_layout(corpus):
    tokenizer = train_tokenizer(file_documents([str(corpus)]) + [UNICODE_CORPUS], 400, 64)
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")] == \
        [PAD, UNK, CLS, SEP, MASK]
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id,
            tokenizer.mask_token_id) == (PAD, UNK, CLS, SEP, MASK)
    assert len(tokenizer) == 400 and sorted(tokenizer.all_special_ids) == [PAD, UNK, CLS, SEP, MASK]
    assert tokenizer("a b", "c")["token_type_ids"] == [0, 0, 0, 0, 1, 1]
    # after the specials, WordPieceTrainer's layout in a fixed order: the alphabet, the "##c" forms (each in
    # code-point order), the merges
    tokens = sorted(tokenizer.get_vocab(), key=tokenizer.get_vocab().get)
    alphabet = [t for t in tokens[5:] if len(t) == 1]
    forms = [t for t in tokens[5 + len(alphabet):] if len(t) == 3 and t.startswith("##")]
    assert tokens[5:5 + len(alphabet)] == alphabet == sorted(alphabet) and len(alphabet) > 60
    assert tokens[5 + len(alphabet):5 + len(alphabet) + len(forms)] == forms == sorted(forms) and len(forms) > 40
    assert all(len(t.removeprefix("##")) > 1 for t in tokens[5 + len(alphabet) + len(forms):])  # merges


def test_wordpiece_round_trips_unicode_text_as_bert_does():
    # a lower-casing WordPiece strips accents, pads CJK ideographs with spaces and splits off punctuation, as BERT's
    documents = [UNICODE_CORPUS * 4]
    tokenizer = train_tokenizer(documents, 160, 64)
    assert tokenizer.do_lower_case and len(tokenizer) == 160
    expected = ["cafe, naive facade : deja vu in zurich.", "日 本 語 のテキスト 、 正 しく 戻 ります 。",
                "emoji 🙂🚀 and ∑ ≤ →.", "version 3. 11. 4 costs $ 12. 50 ( or 99 % )!", "привет, мир! елка в москве.",
                "the xylophone and the saxophone play in 2024."]
    vocab = tokenizer.get_vocab()
    backend = tokenizer.backend_tokenizer
    for text, decoded in zip(UNICODE_CORPUS, expected, strict=True):
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == CLS and ids[-1] == SEP and UNK not in ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == decoded
        # WordPiece's greedy longest match over the trained vocabulary, word by word
        words = [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(text))]
        assert tokenizer.tokenize(text) == [p for w in words for p in _greedy_longest_match(w, vocab)], text
    assert tokenizer.tokenize("Zürich 2024") == tokenizer.tokenize("zurich 2024")
    assert tokenizer.tokenize("🚀🙂")[0] == "[UNK]"  # no "##🙂" was trained: a word WordPiece cannot cover is [UNK]
    # and the same in a second training, ids included
    again = train_tokenizer(documents, 160, 64)
    assert again.get_vocab() == vocab
    assert [again(t)["input_ids"] for t in UNICODE_CORPUS] == [tokenizer(t)["input_ids"] for t in UNICODE_CORPUS]

def test_packing():
    docs = [[[10 + d] * 5 for _ in range(9)] for d in range(4)]  # 4 documents of 9 sentences of 5 tokens
    bert = _data(docs, max_length=27, pack=True)  # segments of up to (27 - 3) // 2 = 12 tokens: two sentences
    assert all(len(seg) == 10 for doc in bert.documents for seg in doc[:-1])
    roberta = _data(docs, objective="roberta", max_length=24, pack=True)  # up to 22 tokens per sequence
    lengths = [len(s) for s in roberta.sequences]
    assert max(lengths) <= 22 and sum(lengths) == 4 * 9 * 5 + 3  # every token, plus [SEP] between documents
    assert any(SEP in s for s in roberta.sequences)
    example = roberta.examples(0)[0]
    assert example["input_ids"][0] == CLS and example["input_ids"][-1] == SEP and "label" not in example
    assert set(example["token_type_ids"]) == {0}
    plain = _data(docs, objective="roberta", max_length=24)
    assert len(plain.sequences) == 36


# ----------------------------------------------------------------------------------------- runs, checkpoints
def _run(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(["pretrain", *args])
    return code, capsys.readouterr().err


def test_bert_checkpoint_loads_in_transformers_and_fastbert(tmp_path, corpus, capsys, one_thread):
    import fastbert

    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "6", "--save-every", "3", "--eval-every", "3",
                      "--whole-word-masking", *TINY], capsys)
    assert code == 0, err
    assert "held-out at step 6" in err
    checkpoint = latest_checkpoint(out)
    assert checkpoint.name == "checkpoint-0000006"
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval_first"]["step"] == 0 and "eval_nsp_accuracy" in summary["eval_last"]

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    batch = tokenizer(["The while statement is used for repeated execution."], return_tensors="pt")
    assert int(tokenizer.pad_token_id) == PAD and batch["input_ids"][0, 0] == tokenizer.cls_token_id
    pretraining = transformers.AutoModelForPreTraining.from_pretrained(checkpoint).eval()
    assert type(pretraining).__name__ == "BertForPreTraining"
    encoder = transformers.AutoModel.from_pretrained(checkpoint).eval()
    ours = fastbert.from_pretrained(checkpoint).eval()
    ours_pretraining = fastbert.from_pretrained(checkpoint, task="pretraining").eval()
    with torch.no_grad():
        expected = encoder(**batch).last_hidden_state
        got = ours(**batch).last_hidden_state
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
        expected_nsp = pretraining(**batch).seq_relationship_logits
        assert torch.allclose(ours_pretraining(**batch).seq_relationship_logits, expected_nsp, rtol=1e-5, atol=1e-5)


def test_a_short_run_learns(tmp_path, corpus, capsys, one_thread):
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "60", "--learning-rate", "5e-3", "--save-every",
                      "0", *TINY], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    first, last = summary["eval_first"], summary["eval_last"]
    assert first["step"] == 0 and last["step"] == 60
    assert last["eval_mlm_loss"] < first["eval_mlm_loss"] - 0.3  # held-out text, fixed masks


@pytest.mark.parametrize("objective, model_class", [("roberta", "RobertaForMaskedLM"),
                                                    ("albert", "AlbertForPreTraining")])
def test_other_objectives(tmp_path, corpus, capsys, one_thread, objective, model_class):
    import fastbert

    out = tmp_path / objective
    code, err = _run([str(corpus), "-o", str(out), "--objective", objective, "--pack", "--max-steps", "3",
                      "--save-every", "0", *TINY, "--vocab-size", "300"], capsys)  # (a byte-level BPE: 261 at least)
    assert code == 0, err
    checkpoint = latest_checkpoint(out)
    loaded = transformers.AutoModelForPreTraining.from_pretrained(checkpoint)
    assert type(loaded).__name__ == model_class
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if not r.get("eval")][-1]
    pair = {"roberta": None, "albert": "sop_accuracy"}[objective]
    assert last["step"] == 3 and "mlm_loss" in last and (pair is None or pair in last)
    assert "nsp_accuracy" not in last
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    if objective == "roberta":  # byte-level BPE, and the masked-LM auto class takes the checkpoint
        assert "RobertaTokenizer" in type(tokenizer).__name__ and tokenizer.mask_token == "<mask>"
        assert type(transformers.AutoModelForMaskedLM.from_pretrained(checkpoint)).__name__ == model_class
    batch = tokenizer(["Names refer to objects."], return_tensors="pt")
    batch.pop("token_type_ids", None)  # a RoBERTa (BPE) tokenizer gives none
    with torch.no_grad():
        expected = transformers.AutoModel.from_pretrained(checkpoint).eval()(**batch).last_hidden_state
        got = fastbert.from_pretrained(checkpoint).eval()(**batch).last_hidden_state
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # two fresh processes (~7 s each just to import torch and transformers here)
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, corpus, capsys, one_thread):
    # imported here, not at the top: importing tests.helpers with this module moves a loss test of test_distill
    # past its 1e-5 tolerance when that file runs alone
    from tests.helpers import assert_same_final_weights, kill_and_resume, logged_losses

    steps = "40"
    common = [str(corpus), "--max-steps", steps, "--save-every", "4", "--eval-every", "0", "--seed", "5", *TINY]
    whole = tmp_path / "whole"
    code, err = _run([*common, "-o", str(whole)], capsys)
    assert code == 0, err
    # the killed run trains its own vocabulary in its own process: the same as the first's (test above)
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "fastbert.cli", "pretrain", *common, "-o", str(killed)]
    kill_and_resume(command, killed, int(steps), wait_s=120)
    assert_same_final_weights(whole, killed)
    assert latest_checkpoint(killed).name == latest_checkpoint(whole).name
    losses, resumed_losses = logged_losses(whole), logged_losses(killed)
    assert len(losses) == int(steps) + 2 and resumed_losses == losses  # + the evaluations before and after


def test_pretrain_runs_from_python_without_argparse(tmp_path, corpus, one_thread):
    log = io.StringIO()
    settings = PretrainSettings(output_dir=str(tmp_path / "run"), files=(str(corpus),), objective="roberta",
                                hidden_size=16, num_layers=1, num_heads=2, vocab_size=300, max_length=32,
                                batch_size=4, max_steps=2, save_every=0, threads=1, progress=False)
    result = pretrain(settings, log=log)
    assert result.step == 2 and result.checkpoint == latest_checkpoint(tmp_path / "run")
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("fastbert pretrain: RobertaForMaskedLM") and "held-out at step 2" in lines[-1]
    with pytest.raises(UserError, match="--max-length must be >= 8"):
        pretrain(PretrainSettings(output_dir=str(tmp_path / "other"), max_length=4))


def test_resume_with_changed_settings_is_refused(tmp_path, corpus, capsys, one_thread):
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "2", *TINY], capsys)
    assert code == 0, err
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "2", "--learning-rate", "1e-3", "--resume",
                      *TINY], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("fastbert: error: --resume: the settings differ")
    assert "learning_rate 0.001 (checkpoint: 0.0005)" in lines[-1]
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "2", "--whole-word-masking", "--resume", *TINY],
                     capsys)
    assert code == 1 and "whole_word_masking" in err.strip().splitlines()[-1]
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "2", *TINY], capsys)
    assert code == 1 and "already holds a run" in err


@pytest.mark.parametrize("args, message", [
    (["missing.txt", "-o", "{tmp}/a"], "text file missing.txt does not exist"),
    (["-o", "{tmp}/a", "--max-length", "0"], "--max-length must be >= 1"),
    (["-o", "{tmp}/a", "--mlm-probability", "1.5"], "--mlm-probability must be between 0 and 1"),
    (["-o", "{tmp}/a", "--config", "{tmp}/nope.json"], "does not exist"),
    (["-o", "{tmp}/nothing", "--resume"], "--resume: {tmp}/nothing does not exist"),
    (["-o", "{tmp}/a", "--objective", "gpt"], "invalid choice: 'gpt'"),
    (["{tmp}/empty.txt", "-o", "{tmp}/a"], "the corpus holds no sentences"),
    (["{tmp}/empty.txt", "--corpus", "pydoc", "-o", "{tmp}/a"], "give text FILEs or --corpus, not both"),
])
def test_cli_errors_are_one_line(tmp_path, capsys, args, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    try:
        code = cli.main(["pretrain", *args])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("fastbert: error: ")
    assert message.replace("{tmp}", str(tmp_path)) in err


@pytest.mark.parametrize("fields, message", [
    ({"num_attention_heads": 3}, ""),  # H=16 is no multiple of 3 heads
    ({"max_position_embeddings": 16}, "16 positions, fewer than --max-length 32; give --max-length 16 or less"),
    ({"type_vocab_size": 0}, "type_vocab_size must be >= 2 for the bert objective, got 0"),
    ({"intermediate_size": "big"}, "intermediate_size"),  # transformers' own check of the field's type
])
def test_an_invalid_model_config_fails_before_a_tokenizer_is_trained_or_written(tmp_path, corpus, capsys, fields,
                                                                                message):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps(fields))
    out = tmp_path / "run"
    sizes = TINY[:TINY.index("--num-heads")] + TINY[TINY.index("--num-heads") + 2:]  # the heads from --config
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "1", *sizes, "--config", str(config)], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("fastbert: error: model config:"), err
    assert message in err and "Training the tokenizer" not in err and not out.exists()


def test_a_roberta_vocabulary_smaller_than_its_bytes_is_refused_before_any_work(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), *TINY, "--objective", "roberta", "--vocab-size", "260"], capsys)
    assert code == 1 and err == ("fastbert: error: --vocab-size must be >= 261 for --objective roberta (a byte-level "
                                 "BPE holds all 256 bytes and 5 special tokens), got 260\n")
    assert not out.exists()
    PretrainSettings(output_dir=str(out), objective="roberta", vocab_size=261).check()  # the least is taken
    PretrainSettings(output_dir=str(out), objective="roberta", vocab_size=5, tokenizer="tok").check()  # unused
    # a run started before the minimum was checked (its vocabulary was trained at 261) still resumes
    PretrainSettings(output_dir=str(out), objective="roberta", vocab_size=200, resume=True).check()


def test_a_wordpiece_vocabulary_larger_than_asked_says_so(tmp_path, corpus, capsys, one_thread):
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), *TINY, "--vocab-size", "20", "--max-steps", "1", "--eval-every",
                      "0"], capsys)
    assert code == 0, err
    size = len(transformers.AutoTokenizer.from_pretrained(out / "tokenizer"))
    assert size > 20
    assert (f"fastbert pretrain: vocabulary {size}, more than --vocab-size 20: WordPiece keeps every character of "
            "the training text (and its ## form) besides its 5 special tokens\n") in err
    code, err = _run([str(corpus), "-o", str(tmp_path / "big"), *TINY, "--max-steps", "1", "--eval-every", "0"],
                     capsys)
    assert code == 0 and "more than --vocab-size" not in err, err  # 200 asked, fewer found in this small text


@pytest.mark.parametrize("objective, positions", [("bert", 40), ("roberta", 38)])
def test_the_default_max_length_is_capped_to_a_small_configs_positions(tmp_path, corpus, capsys, one_thread,
                                                                       objective, positions):
    config = tmp_path / "small.json"
    config.write_text(json.dumps({"max_position_embeddings": 40}))  # roberta's positions start past its padding id
    sizes = TINY[:TINY.index("--max-length")] + TINY[TINY.index("--max-length") + 2:]  # no --max-length
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), *sizes, "--objective", objective, "--config", str(config),
                      "--max-steps", "1", "--eval-every", "0", "--vocab-size", "300"], capsys)
    assert code == 0, err
    assert (f"fastbert pretrain: --max-length 128 (the default) capped to the model config's {positions} "
            "positions\n") in err
    assert transformers.AutoTokenizer.from_pretrained(out / "tokenizer").model_max_length == positions
    # asked for explicitly, a length the config has no positions for is still refused, before any work
    code, err = _run([str(corpus), "-o", str(tmp_path / "asked"), *sizes, "--objective", objective, "--config",
                      str(config), "--max-length", "128", "--vocab-size", "300"], capsys)
    assert code == 1 and err == (f"fastbert: error: model config: max_position_embeddings 40 gives {positions} "
                                 f"positions, fewer than --max-length 128; give --max-length {positions} or less\n")
    assert not (tmp_path / "asked").exists()


def test_the_default_max_length_stays_128_when_nothing_limits_it(tmp_path):
    from fastbert.training.pretrain import check_model_config

    log = io.StringIO()
    assert check_model_config(PretrainSettings(output_dir=str(tmp_path)), {}, log).max_length == 128
    assert check_model_config(PretrainSettings(output_dir=str(tmp_path)), {"max_position_embeddings": 512},
                              log).max_length == 128
    assert log.getvalue() == ""
    with pytest.raises(UserError, match=r"^model config: max_position_embeddings 6 gives 6 positions; a sequence "
                                        r"needs 8 at least$"):
        check_model_config(PretrainSettings(output_dir=str(tmp_path)), {"max_position_embeddings": 6}, log)


def test_a_run_directory_as_tokenizer_is_pointed_at_its_model(tmp_path, corpus, capsys):
    """--tokenizer given a run's output directory: one line naming the checkpoint in it that holds the tokenizer
    (the helper finetune's --model and distill's --teacher use)."""
    run = tmp_path / "earlier-run"
    (run / "checkpoint-0000002").mkdir(parents=True)
    for name in ("config.json", "trainer_state.pt"):
        (run / "checkpoint-0000002" / name).write_text("{}")
    code, err = _run([str(corpus), "-o", str(tmp_path / "out"), "--max-steps", "1", *TINY, "--tokenizer", str(run)],
                     capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fastbert: error: --tokenizer {run} has no tokenizer (none of ")
    assert err.endswith(f"; did you mean {run / 'checkpoint-0000002'}?\n")


@pytest.mark.parametrize("option, value, message", [
    ("--learning-rate", "nan", "--learning-rate must be a number > 0, got nan"),
    ("--learning-rate", "inf", "--learning-rate must be a number > 0, got inf"),
    ("--weight-decay", "-1", "--weight-decay must be a number >= 0, got -1.0"),
    ("--max-grad-norm", "nan", "--max-grad-norm must be a number >= 0, got nan"),
    ("--max-grad-norm", "-1", "--max-grad-norm must be a number >= 0, got -1.0"),
    ("--save-every", "-1", "--save-every must be >= 0, got -1"),
    ("--keep-checkpoints", "0", "--keep-checkpoints must be >= 1, got 0"),
    ("--log-every", "0", "--log-every must be >= 1, got 0"),
])
def test_option_values_are_refused_before_any_work(tmp_path, corpus, capsys, option, value, message):
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), *TINY, option, value], capsys)
    assert code == 1 and err == f"fastbert: error: {message}\n"
    assert not out.exists()


def test_a_diverging_run_stops_with_one_line_and_keeps_its_finite_checkpoints(tmp_path, corpus, capsys, one_thread):
    from safetensors.torch import load_file

    from fastbert.training.loop import list_checkpoints

    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "6", "--save-every", "1", "--keep-checkpoints",
                      "9", "--learning-rate", "1e30", *TINY], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert re.search(r"^fastbert: error: the training loss is (nan|inf) at step \d: the run diverged", err, re.M), err
    checkpoints = list_checkpoints(out)
    assert len(checkpoints) < 6 and not (out / "summary.json").exists()
    for checkpoint in checkpoints:
        assert all(bool(t.isfinite().all()) for t in load_file(checkpoint / "model.safetensors").values())


@pytest.mark.parametrize("files, message", [
    ({}, "has no tokenizer (none of tokenizer.json"),
    ({"tokenizer_config.json": json.dumps({"tokenizer_class": "BertTokenizer"})},
     "has no vocabulary, only special or added tokens"),
], ids=["empty", "config-only"])
def test_a_given_tokenizer_without_a_vocabulary_is_refused(tmp_path, corpus, capsys, files, message):
    given = tmp_path / "tok"
    given.mkdir()
    for name, content in files.items():
        (given / name).write_text(content)
    out = tmp_path / "run"
    code, err = _run([str(corpus), "-o", str(out), "--max-steps", "1", *TINY, "--tokenizer", str(given)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"fastbert: error: --tokenizer {given}") and message in err, err
