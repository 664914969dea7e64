"""fastbert distill: the triple loss against a direct computation (each term alone, with its weight), the student's
initialisation (exactly the chosen teacher layers; a full-depth copy computes what the teacher computes), short runs
whose loss falls and whose output loads in transformers / sentence-transformers / fastbert, the refusals before any
training (one line each), and resume after a real SIGKILL equals an uninterrupted run."""

from __future__ import annotations

import io
import json
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from fastbert import cli  # noqa: E402
from fastbert.common.resolve import UserError, default_model_dir  # noqa: E402
from fastbert.training.corpus import split_sentences  # noqa: E402
from fastbert.training.distill import (  # noqa: E402
    DISTILBERT_LOSS,
    DistillSettings,
    LossWeights,
    SentenceBatches,
    build_layer_student,
    build_mlm_student,
    distill,
    embedding_loss,
    position_offset,
    sentence_pairs,
    student_layer_indices,
    triple_loss,
)
from fastbert.training.loop import latest_checkpoint  # noqa: E402
from fastbert.training.pretrain import train_tokenizer  # noqa: E402

FAST = ["--batch-size", "4", "--threads", "1", "--log-every", "1000", "--no-progress", "--eval-sentences", "16"]


@pytest.mark.parametrize("config_name, offset", [("BertConfig", 0), ("RobertaConfig", 2), ("XLMRobertaConfig", 2),
                                                 ("CamembertConfig", 2), ("ElectraConfig", 0)])
def test_position_offset_follows_the_family(config_name, offset):
    """RoBERTa-style families number positions from pad_token_id + 1 (pad 1 here), whatever their model_type."""
    config = getattr(transformers, config_name)(pad_token_id=1)
    assert position_offset(config) == offset


def _documents() -> list[list[str]]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [split_sentences(topics[key])[:25] for key in sorted(topics)[:24] if len(split_sentences(topics[key])) >= 4]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small real text: 24 documents (so two are held out whole) of CPython's reference topics."""
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n\n".join("\n".join(doc) for doc in _documents()) + "\n", encoding="utf-8")
    return path


def _masked_lm_teacher(objective: str, layers: int = 4, seed: int = 0, initializer_range: float = 0.02):
    """A tiny random BertForMaskedLM (WordPiece) or RobertaForMaskedLM (byte-level BPE) and its tokenizer."""
    tokenizer = train_tokenizer(_documents(), 300, 32, objective=objective)
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                  intermediate_size=32, pad_token_id=tokenizer.pad_token_id, initializer_range=initializer_range)
    if objective == "roberta":
        config = transformers.RobertaConfig(**fields, max_position_embeddings=32 + tokenizer.pad_token_id + 1,
                                            type_vocab_size=1)
        return transformers.RobertaForMaskedLM(config).eval(), tokenizer
    return transformers.BertForMaskedLM(transformers.BertConfig(**fields, max_position_embeddings=32)).eval(), \
        tokenizer


@pytest.fixture(scope="module")
def bert_teacher(tmp_path_factory) -> Path:
    """A tiny BertForMaskedLM checkpoint with its WordPiece tokenizer; large random weights give it peaked output
    distributions (soft targets far from uniform: something for a student to learn)."""
    model, tokenizer = _masked_lm_teacher("bert", initializer_range=0.5)
    path = tmp_path_factory.mktemp("teacher")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(args: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(args)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- loss
def _outputs(seed: int = 0):
    """Teacher and student outputs of a tiny BERT teacher and its DistilBERT student on a padded, masked batch."""
    teacher, tokenizer = _masked_lm_teacher("bert", seed=seed)
    torch.manual_seed(seed + 1)
    student = build_mlm_student(teacher, [0, 3], from_teacher=False).eval()
    batch = tokenizer(["Names refer to objects.", "A class definition defines a class object."], padding=True,
                      return_tensors="pt")
    labels = torch.full_like(batch["input_ids"], -100)
    labels[0, 2], labels[1, 3], labels[1, 5] = batch["input_ids"][0, 2], batch["input_ids"][1, 3], \
        batch["input_ids"][1, 5]
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        t = teacher(**inputs, output_hidden_states=True)
        s = student(**inputs, output_hidden_states=True)
    return s.logits, s.hidden_states[-1], t.logits, t.hidden_states[-1], labels, batch["attention_mask"]


def _direct_terms(s_logits, s_hidden, t_logits, t_hidden, labels, mask, temperature):
    """The three terms written out token by token, in float64."""
    ce, cos, real = 0.0, 0.0, 0
    for b in range(mask.shape[0]):
        for i in range(mask.shape[1]):
            if not mask[b, i]:
                continue
            real += 1
            p_t = torch.softmax(t_logits[b, i].double() / temperature, -1)
            log_p_s = torch.log_softmax(s_logits[b, i].double() / temperature, -1)
            ce += float((p_t * (p_t.log() - log_p_s)).sum())
            a, c = s_hidden[b, i].double(), t_hidden[b, i].double()
            cos += 1 - float(a @ c / (a.norm() * c.norm()))
    positions = (labels != -100).nonzero().tolist()
    mlm = sum(-float(torch.log_softmax(s_logits[b, i].double(), -1)[labels[b, i]]) for b, i in positions)
    return {"ce_loss": ce / real * temperature ** 2, "mlm_loss": mlm / len(positions), "cos_loss": cos / real}


@pytest.mark.parametrize("term, weights", [
    ("ce_loss", LossWeights(temperature=2.0, alpha_ce=5.0, alpha_mlm=0.0, alpha_cos=0.0)),
    ("ce_loss", LossWeights(temperature=1.0, alpha_ce=0.5, alpha_mlm=0.0, alpha_cos=0.0)),
    ("mlm_loss", LossWeights(alpha_ce=0.0, alpha_mlm=2.0, alpha_cos=0.0)),
    ("cos_loss", LossWeights(alpha_ce=0.0, alpha_mlm=0.0, alpha_cos=3.0)),
])
def test_each_term_of_the_triple_loss_alone(term, weights):
    s_logits, s_hidden, t_logits, t_hidden, labels, mask = (t.double() if t.is_floating_point() else t
                                                            for t in _outputs())
    total, terms = triple_loss(s_logits, s_hidden, labels, mask, weights, t_logits, t_hidden)  # in float64
    expected = _direct_terms(s_logits, s_hidden, t_logits, t_hidden, labels, mask, weights.temperature)[term]
    assert list(terms) == [term]
    assert float(terms[term]) == pytest.approx(expected, rel=1e-5)
    alpha = {"ce_loss": weights.alpha_ce, "mlm_loss": weights.alpha_mlm, "cos_loss": weights.alpha_cos}[term]
    assert float(total) == pytest.approx(alpha * expected, rel=1e-5)
    assert expected > 1e-3  # the student is random: a term near 0 would not test much


def test_triple_loss_with_distilbert_weights_is_the_weighted_sum():
    s_logits, s_hidden, t_logits, t_hidden, labels, mask = (t.double() if t.is_floating_point() else t
                                                            for t in _outputs(seed=3))
    total, terms = triple_loss(s_logits, s_hidden, labels, mask, DISTILBERT_LOSS, t_logits, t_hidden)
    direct = _direct_terms(s_logits, s_hidden, t_logits, t_hidden, labels, mask, 2.0)
    assert (DISTILBERT_LOSS.temperature, DISTILBERT_LOSS.alpha_ce, DISTILBERT_LOSS.alpha_mlm,
            DISTILBERT_LOSS.alpha_cos) == (2.0, 5.0, 2.0, 1.0)
    assert float(total) == pytest.approx(5 * direct["ce_loss"] + 2 * direct["mlm_loss"] + direct["cos_loss"],
                                         rel=1e-5)
    # the padded positions take no part: changing the logits there changes nothing
    poisoned = s_logits.clone()
    poisoned[mask == 0] = 1e4
    assert float(triple_loss(poisoned, s_hidden, labels, mask, DISTILBERT_LOSS, t_logits, t_hidden)[0]) == \
        pytest.approx(float(total), rel=1e-6)


def test_embedding_loss_terms():
    gen = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
    total, terms = embedding_loss(student, teacher, LossWeights(alpha_mse=2.0, alpha_cos=0.0))
    assert list(terms) == ["mse_loss"]
    assert float(total) == pytest.approx(2.0 * float(((student - teacher) ** 2).mean()), rel=1e-6)
    total, terms = embedding_loss(student, teacher, LossWeights(alpha_mse=0.0, alpha_cos=0.5))
    direct = float((1 - (student * teacher).sum(-1) / (student.norm(dim=-1) * teacher.norm(dim=-1))).mean())
    assert list(terms) == ["cos_loss"] and float(total) == pytest.approx(0.5 * direct, rel=1e-6)


@pytest.mark.parametrize("hidden_size", [1, 7, 384])
def test_hidden_state_term_of_the_embedding_loss(hidden_size):
    gen = torch.Generator().manual_seed(hidden_size)
    s_hidden, t_hidden = (torch.randn(3, 5, hidden_size, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    student, teacher = s_hidden.mean(1), t_hidden.mean(1)
    weights = LossWeights(alpha_mse=1.0, alpha_cos=0.0, alpha_hidden=0.25)
    total, terms = embedding_loss(student, teacher, weights, (s_hidden, t_hidden, mask))
    real = [(b, i) for b in range(3) for i in range(5) if mask[b, i]]
    direct = sum(1 - float(s_hidden[b, i] @ t_hidden[b, i] / (s_hidden[b, i].norm() * t_hidden[b, i].norm()))
                 for b, i in real) / len(real)
    assert list(terms) == ["mse_loss", "hidden_loss"]
    assert float(terms["hidden_loss"]) == pytest.approx(direct, rel=1e-9)
    assert float(total) == pytest.approx(float(((student - teacher) ** 2).mean()) + 0.25 * direct, rel=1e-9)
    poisoned = s_hidden.clone()
    poisoned[mask == 0] = 1e4  # padding takes no part
    assert float(embedding_loss(student, teacher, weights, (poisoned, t_hidden, mask))[1]["hidden_loss"]) == \
        pytest.approx(direct, rel=1e-9)
    with pytest.raises(ValueError, match="needs the hidden states"):
        embedding_loss(student, teacher, weights)


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_layer_term_of_the_embedding_loss_pairs_each_layer(layers):
    """alpha_layers: the mean over the paired layers of each layer's token cosine loss, padding left out."""
    gen = torch.Generator().manual_seed(layers)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    s_states = [torch.randn(2, 4, 7, generator=gen, dtype=torch.float64) for _ in range(layers)]
    t_states = [torch.randn(2, 4, 7, generator=gen, dtype=torch.float64) for _ in range(layers)]
    last = torch.randn(2, 4, 7, generator=gen, dtype=torch.float64)
    student, teacher = last.mean(1), last.mean(1) + 1
    weights = LossWeights(alpha_mse=0.0, alpha_cos=0.0, alpha_layers=3.0)
    total, terms = embedding_loss(student, teacher, weights, (last, last, mask), (s_states, t_states))
    real = mask.bool()
    direct = sum(float((1 - F.cosine_similarity(s[real], t[real], dim=-1)).mean())
                 for s, t in zip(s_states, t_states, strict=True)) / layers
    assert list(terms) == ["layers_loss"]
    assert float(terms["layers_loss"]) == pytest.approx(direct, rel=1e-9)
    assert float(total) == pytest.approx(3.0 * direct, rel=1e-9)
    s_states[-1] = s_states[-1].clone()
    s_states[-1][~real] = 1e4  # padding takes no part
    assert float(embedding_loss(student, teacher, weights, (last, last, mask), (s_states, t_states))[1][
        "layers_loss"]) == pytest.approx(direct, rel=1e-9)
    with pytest.raises(ValueError, match="student layers against"):
        embedding_loss(student, teacher, weights, (last, last, mask), (s_states, t_states[:-1] or t_states * 2))


@pytest.mark.parametrize("batch_size, share, pair_rows", [(1, 0.0, 0), (7, 0.5, 4), (8, 0.5, 4), (7, 1.0, 7)])
def test_sentence_batches_mix_single_sentences_and_pairs(batch_size, share, pair_rows):
    documents = _documents()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    sentences = [s for doc in documents for s in doc]
    sources = sentence_pairs(documents)
    assert len(sources) == sum(len(doc) - 1 for doc in documents)
    assert all(documents[d][documents[d].index(a) + 1] == b for d, a, b in sources[:50])
    epoch = SentenceBatches(sentences, tokenizer, batch_size, 32, seed=0, epoch=1, token_types=True, pairs=share,
                            pair_sources=sources)
    singles = batch_size - pair_rows
    assert len(epoch) == (len(sentences) // singles if singles else len(sources) // batch_size)
    decoded = {}
    for _, a, b in sources:
        for text in (a, b):
            decoded.setdefault(text, tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]))
    follows = others = 0
    for index in (0, 1, len(epoch) - 1):
        batch = epoch[index]
        assert batch["input_ids"].shape[0] == batch_size
        is_pair = (batch["token_type_ids"] == 1).any(dim=1)
        assert is_pair.tolist() == [False] * singles + [True] * pair_rows
        for row in range(singles, batch_size):  # [CLS] A [SEP] B [SEP], each segment cut from its end if too long
            ids = batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist()
            separator = ids.index(tokenizer.sep_token_id)
            first, second = tokenizer.decode(ids[1:separator]), tokenizer.decode(ids[separator + 1:-1])
            assert batch["token_type_ids"][row][:separator + 1].eq(0).all()
            assert batch["token_type_ids"][row][separator + 1:len(ids)].eq(1).all()
            anchors = [(a, b) for _, a, b in sources if decoded[a].startswith(first)]
            assert anchors, first
            if any(decoded[b].startswith(second) for _, b in anchors):
                follows += 1
            else:  # a partner from another document
                others += 1
                assert any(decoded[b].startswith(second) for _, _, b in sources), second
        again = SentenceBatches(sentences, tokenizer, batch_size, 32, seed=0, epoch=1, token_types=True,
                                pairs=share, pair_sources=sources)[index]
        assert all(torch.equal(batch[k], again[k]) for k in batch)  # (seed, epoch, index) decides: exact resume
    if pair_rows >= 4:
        assert follows and others  # both kinds of pair occur
    other = SentenceBatches(sentences, tokenizer, batch_size, 32, seed=0, epoch=2, token_types=True, pairs=share,
                            pair_sources=sources)[0]
    assert not torch.equal(other["input_ids"], epoch[0]["input_ids"])


# ------------------------------------------------------------------------------------------------ the student
def test_student_layer_choice():
    assert student_layer_indices(12) == [0, 2, 4, 7, 9, 11]  # DistilBERT's own 12 -> 6
    assert student_layer_indices(6, 3) == [0, 3, 5]
    assert student_layer_indices(4) == [0, 3]
    assert student_layer_indices(6, 6) == list(range(6))
    assert student_layer_indices(6, 1) == [5]
    assert student_layer_indices(6, chosen=(1, 2)) == [1, 2]
    with pytest.raises(UserError, match="cannot be deeper than its teacher"):
        student_layer_indices(6, 7)
    with pytest.raises(UserError, match="the teacher has layers 0 to 5"):
        student_layer_indices(6, chosen=(0, 6))
    with pytest.raises(UserError, match="increasing"):
        student_layer_indices(6, chosen=(3, 1))


@pytest.mark.parametrize("objective", ["bert", "roberta"])
def test_distilbert_student_copies_exactly_the_chosen_layers(objective):
    teacher, _ = _masked_lm_teacher(objective)
    with torch.no_grad():  # non-zero biases and LayerNorm parameters, so a missed copy shows
        for parameter in teacher.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    chosen = [1, 3]
    student = build_mlm_student(teacher, chosen)
    base = teacher.base_model
    names = {"attention.q_lin": "attention.self.query", "attention.k_lin": "attention.self.key",
             "attention.v_lin": "attention.self.value", "attention.out_lin": "attention.output.dense",
             "sa_layer_norm": "attention.output.LayerNorm", "ffn.lin1": "intermediate.dense",
             "ffn.lin2": "output.dense", "output_layer_norm": "output.LayerNorm"}
    copied = 0
    for j, i in enumerate(chosen):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                got = student.distilbert.transformer.layer[j].get_parameter(f"{ours}.{kind}")
                assert torch.equal(got, base.encoder.layer[i].get_parameter(f"{theirs}.{kind}")), (j, ours, kind)
                assert not torch.equal(got, base.encoder.layer[0 if i else 1].get_parameter(f"{theirs}.{kind}"))
                copied += 1
    assert copied == 2 * 8 * 2
    embeddings, ours = base.embeddings, student.distilbert.embeddings
    offset = teacher.config.pad_token_id + 1 if objective == "roberta" else 0
    assert torch.equal(ours.word_embeddings.weight, embeddings.word_embeddings.weight)
    rows = ours.position_embeddings.num_embeddings
    assert torch.equal(ours.position_embeddings.weight,
                       embeddings.position_embeddings.weight[offset:offset + rows]
                       + embeddings.token_type_embeddings.weight[0])
    assert torch.equal(student.vocab_projector.bias, teacher.get_output_embeddings().bias)
    assert student.vocab_projector.weight.data_ptr() == ours.word_embeddings.weight.data_ptr()  # tied


@pytest.mark.parametrize("objective", ["bert", "roberta"])
def test_a_full_depth_student_computes_what_its_teacher_computes(objective):
    teacher, tokenizer = _masked_lm_teacher(objective, layers=3)
    student = build_mlm_student(teacher, [0, 1, 2]).eval()
    batch = tokenizer(["Names refer to objects.", "Café au lait, 日本"], padding=True, return_tensors="pt")
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        expected, got = teacher(**inputs).logits, student(**inputs).logits
    real = batch["attention_mask"].bool()
    assert torch.allclose(got[real], expected[real], atol=1e-4, rtol=1e-4)


def test_layer_student_keeps_the_chosen_layers_of_minilm():
    teacher = transformers.AutoModel.from_pretrained(default_model_dir())
    student = build_layer_student(teacher, [0, 2, 5])
    assert student.config.num_hidden_layers == 3 and teacher.config.num_hidden_layers == 6
    theirs, ours = teacher.state_dict(), student.state_dict()
    for key, tensor in ours.items():
        source = key
        for j, i in enumerate([0, 2, 5]):
            source = source.replace(f"encoder.layer.{j}.", f"encoder.layer.{i}.") if f"layer.{j}." in key else source
        assert torch.equal(tensor, theirs[source]), key
    assert not any(k.startswith("encoder.layer.3.") for k in ours)


# ----------------------------------------------------------------------------------------------------- runs
def test_mlm_distillation_learns_and_loads_everywhere(tmp_path, corpus, bert_teacher, capsys, one_thread):
    import fastbert

    out = tmp_path / "student"
    code, err = _run(["distill", str(corpus), "--teacher", str(bert_teacher), "-o", str(out), "--init", "random",
                      "--max-steps", "40", "--learning-rate", "3e-3", "--save-every", "0", "--eval-every", "0",
                      *FAST], capsys)
    assert code == 0, err
    assert err.startswith("fastbert distill (mlm): teacher BertForMaskedLM (4 layers")
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if not r.get("eval")]
    assert {"ce_loss", "mlm_loss", "cos_loss"} <= set(steps[1])
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses
    soft = [r["ce_loss"] for r in steps if not r.get("eval")]  # the student's outputs come closer to the teacher's
    assert sum(soft[-5:]) < 0.75 * sum(soft[:5]), soft
    assert (out / "loss_curve.png").stat().st_size > 0 and "teacher" in json.loads((out / "summary.json").read_text())
    model_dir = out / "model"
    assert not (model_dir / "trainer_state.pt").exists()
    loaded = transformers.DistilBertForMaskedLM.from_pretrained(model_dir).eval()
    assert loaded.config.n_layers == 2 and not hasattr(loaded.distilbert.embeddings, "token_type_embeddings")
    assert type(transformers.AutoModel.from_pretrained(model_dir)).__name__ == "DistilBertModel"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    batch = tokenizer(["Names refer to objects."], return_tensors="pt")
    assert set(batch) == {"input_ids", "attention_mask"}  # DistilBERT takes no token types
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fastbert's encoder notes that it leaves the MLM head's keys unused
        expected = loaded.distilbert(**batch).last_hidden_state
        got = fastbert.from_pretrained(model_dir).eval()(**batch).last_hidden_state
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def _sentence_transformers_teacher(path: Path) -> Path:
    """A tiny sentence-transformers checkpoint: a random 4-layer BertModel, mean pooling, normalised."""
    tokenizer = train_tokenizer(_documents(), 300, 32)
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=16,
                                                           num_hidden_layers=4, num_attention_heads=2,
                                                           intermediate_size=32, max_position_embeddings=32))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 16, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    return path


@pytest.mark.parametrize("extra", [[], ["--pairs", "0.5", "--alpha-hidden", "1", "--alpha-layers", "1"]])
def test_embedding_distillation_learns_and_loads_in_sentence_transformers(tmp_path, corpus, capsys, one_thread,
                                                                          extra):
    teacher = _sentence_transformers_teacher(tmp_path / "teacher")
    out = tmp_path / "student"
    code, err = _run(["distill", str(corpus), "--objective", "embedding", "--teacher", str(teacher), "-o", str(out),
                      "--student-layers", "2", "--init", "random", "--max-steps", "40", "--learning-rate", "3e-3",
                      "--alpha-cos", "1", "--save-every", "0", "--eval-every", "0", *FAST, *extra], capsys)
    assert code == 0, err
    records = list(map(json.loads, (out / "metrics.jsonl").read_text().splitlines()))
    evals = [r for r in records if r.get("eval")]
    assert evals[-1]["eval_cosine"] > evals[0]["eval_cosine"] + 0.1, evals
    steps = [r for r in records if not r.get("eval")]
    if extra:  # the hidden-state term is trained on, and falls
        assert steps[-1]["hidden_loss"] < steps[0]["hidden_loss"] - 0.1, (steps[0], steps[-1])
        assert steps[-1]["layers_loss"] < steps[0]["layers_loss"] - 0.1, (steps[0], steps[-1])
        assert "alpha_hidden 1" in err and "alpha_layers 1" in err and json.loads((out / "summary.json").read_text())[
            "train_hidden_loss_last_40_steps"] > 0
    else:
        assert "hidden_loss" not in steps[-1] and "layers_loss" not in steps[-1]
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(out / "model"), device="cpu")
    texts = ["Names refer to objects.", "A class definition defines a class object."]
    got = torch.as_tensor(model.encode(texts))
    assert got.shape == (2, 16) and torch.allclose(got.norm(dim=-1), torch.ones(2), atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    student = transformers.AutoModel.from_pretrained(out / "model").eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = student(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    expected = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert torch.allclose(got, expected, atol=1e-5)
    assert student.config.num_hidden_layers == 2


def test_distill_runs_from_python(tmp_path, corpus, bert_teacher, one_thread):
    log = io.StringIO()
    settings = DistillSettings(output_dir=str(tmp_path / "run"), teacher=str(bert_teacher), files=(str(corpus),),
                               batch_size=4, max_steps=2, save_every=0, eval_sentences=8, progress=False)
    result = distill(settings, log=log)
    assert result.step == 2 and result.checkpoint == latest_checkpoint(tmp_path / "run")
    lines = log.getvalue().splitlines()
    assert "teacher layers 0,3" in lines[0] and "eval_teacher_mlm_loss" in lines[-1]


# ---------------------------------------------------------------------------------------------- refusals
def _mismatched_teacher(path: Path, bert_teacher: Path) -> Path:
    """The tiny teacher with another model's tokenizer (all-MiniLM-L6-v2's 30,522 tokens for its 300 rows)."""
    import shutil

    shutil.copytree(bert_teacher, path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (path / name).unlink(missing_ok=True)
    transformers.AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return path


@pytest.mark.parametrize("args, message", [
    (["--teacher", "{minilm}"], "has no masked-LM head (architectures: BertModel)"),
    (["--teacher", "{bert}", "--student-layers", "5"], "a student cannot be deeper than its teacher (4 layers)"),
    (["--objective", "embedding", "--student-layers", "7"], "a student cannot be deeper than its teacher (6 layers)"),
    (["--teacher", "{mismatch}"], "tokenizer/model mismatch: the tokenizer has"),
    (["--objective", "embedding", "--teacher", "{bert}"], "is not a sentence-transformers checkpoint"),
    ([], "--objective mlm needs --teacher DIR"),
    (["--teacher", "{tmp}/nothing"], "is not a directory"),
    (["--teacher", "{bert}", "--max-length", "64"], "--max-length 64: the teacher has 32 positions"),
    (["--teacher", "{bert}", "--alpha-mse", "1"], "--alpha-mse is not a term of the mlm objective"),
    (["--teacher", "{bert}", "--teacher-layers", "0,x"], "--teacher-layers must be comma-separated"),
    (["--objective", "bert"], "invalid choice: 'bert'"),
    (["--teacher", "{bert}", "--alpha-hidden", "1"], "--alpha-hidden is not a term of the mlm objective"),
    (["--teacher", "{bert}", "--pairs", "0.5"], "--pairs is an option of the embedding objective"),
    (["--objective", "embedding", "--pairs", "1.5"], "--pairs must be between 0 and 1, got 1.5"),
    (["--objective", "embedding", "--alpha-hidden", "-1"], "--alpha-hidden must be a number >= 0, got -1.0"),
    (["--teacher", "{bert}", "--temperature", "nan"], "--temperature must be a number > 0, got nan"),
    (["--teacher", "{bert}", "--alpha-ce", "nan"], "--alpha-ce must be a number >= 0, got nan"),
    (["--teacher", "{bert}", "--alpha-mlm", "inf"], "--alpha-mlm must be a number >= 0, got inf"),
    (["--teacher", "{bert}", "--learning-rate", "nan"], "--learning-rate must be a number > 0, got nan"),
    (["--teacher", "{bert}", "--max-grad-norm", "nan"], "--max-grad-norm must be a number >= 0, got nan"),
    (["--teacher", "{bert}", "--weight-decay", "-1"], "--weight-decay must be a number >= 0, got -1.0"),
    (["--teacher", "{bert}", "--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
    (["--teacher", "{bert}", "--alpha-layers", "1"], "--alpha-layers is not a term of the mlm objective"),
    (["--objective", "embedding", "--student-layers", "1", "--alpha-layers", "1"],
     "a student of one layer has none"),
])
def test_bad_input_is_one_line_before_training(tmp_path, bert_teacher, capsys, args, message):
    places = {"{minilm}": default_model_dir(), "{bert}": str(bert_teacher), "{tmp}": str(tmp_path)}
    if "{mismatch}" in args:
        places["{mismatch}"] = str(_mismatched_teacher(tmp_path / "mismatch", bert_teacher))

    def fill(text: str) -> str:
        for key, value in places.items():
            text = text.replace(key, value)
        return text

    code, err = _run(["distill", "-o", str(tmp_path / "out"), *map(fill, args)], capsys)
    assert code != 0
    assert err.count("\n") == 1 and err.startswith("fastbert: error: "), err
    assert fill(message) in err
    assert not (tmp_path / "out").exists() or latest_checkpoint(tmp_path / "out") is None


@pytest.mark.parametrize("objective, kept, needed", [
    ("mlm", "checkpoint-0000002", "has no config.json (expected an HF checkpoint directory)"),
    ("embedding", "model", "is not a sentence-transformers checkpoint (no modules.json); the embedding objective "
     "distils one (e.g. the embedded all-MiniLM-L6-v2)"),
], ids=["pretrain-run", "distill-run"])
def test_a_run_directory_as_teacher_is_pointed_at_its_model(tmp_path, capsys, objective, kept, needed):
    """--teacher given a run's output directory: one line naming the model in it (a pretrain run's latest
    checkpoint, a distill run's DIR/model), as finetune's --model and --teacher do."""
    run = tmp_path / "earlier-run"
    (run / kept).mkdir(parents=True)
    for name in ("config.json", "modules.json", "trainer_state.pt"):
        (run / kept / name).write_text("{}")
    code, err = _run(["distill", "--objective", objective, "--teacher", str(run), "-o", str(tmp_path / "out"),
                      *FAST], capsys)
    assert code == 1
    assert err == f"fastbert: error: --teacher {run} {needed}; did you mean {run / kept}?\n"


def test_every_option_reaches_the_settings():
    import dataclasses

    from fastbert.cli import distill as distill_command

    args = cli.build_parser(["distill"]).parse_args(["distill", "a.txt", "-o", "out", "--teacher-layers", "0,2",
                                                     "--no-optimize", "--alpha-ce", "3"])
    settings = distill_command.settings_of(args)
    fields = {f.name for f in dataclasses.fields(settings)}
    for option, value in vars(args).items():
        if option == "command":
            continue
        field = {"no_optimize": "optimize"}.get(option, option)
        assert field in fields, option
        expected = {"no_optimize": False, "files": ("a.txt",), "teacher_layers": (0, 2)}.get(option, value)
        assert getattr(settings, field) == expected, option
    assert settings.alpha_ce == 3.0 and settings.loss_weights().alpha_ce == 3.0
    embedding = distill_command.settings_of(cli.build_parser(["distill"]).parse_args(
        ["distill", "-o", "out", "--objective", "embedding", "--pairs", "0.25", "--alpha-hidden", "2"]))
    assert embedding.pairs == 0.25 and embedding.loss_weights().alpha_hidden == 2.0


# ---------------------------------------------------------------------------------------------------- resume
@pytest.mark.slow  # two fresh processes, ~10 s each here just to import torch and transformers
def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path, corpus, bert_teacher, capsys, one_thread):
    # imported here, not at the top: importing tests.helpers with this module moves a loss test of test_distill
    # past its 1e-5 tolerance when that file runs alone
    from tests.helpers import assert_same_final_weights, kill_and_resume, logged_losses

    steps = "30"
    common = ["distill", str(corpus), "--teacher", str(bert_teacher), "--max-steps", steps, "--save-every", "3",
              "--eval-every", "0", "--seed", "5", *FAST]
    whole = tmp_path / "whole"
    code, err = _run([*common, "-o", str(whole)], capsys)
    assert code == 0, err

    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "fastbert.cli", *common, "-o", str(killed)]
    kill_and_resume(command, killed, int(steps), wait_s=180)
    assert_same_final_weights(whole, killed)
    losses, resumed_losses = logged_losses(whole), logged_losses(killed)
    assert resumed_losses == losses

    code, err = _run([*common, "-o", str(killed), "--resume", "--alpha-ce", "1"], capsys)
    assert code == 1 and "--resume: the settings differ" in err and "alpha_ce" in err


def test_a_resume_of_a_complete_run_changes_nothing_and_says_so(tmp_path, corpus, bert_teacher, capsys, one_thread):
    """It evaluated the teacher again and copied model/ again; a run stopped before model/ was copied gets it."""
    out = tmp_path / "out"
    common = ["distill", str(corpus), "--teacher", str(bert_teacher), "--max-steps", "2", "--eval-every", "0",
              "-o", str(out), *FAST]
    code, err = _run(common, capsys)
    assert code == 0, err
    model, summary = (out / "model").stat(), (out / "summary.json").read_bytes()
    code, err = _run([*common, "--resume"], capsys)
    assert code == 0 and (f"fastbert distill: the run in {out} is already complete (step 2 of 2): nothing to train, "
                          f"nothing changed; its student is in {out / 'model'}") in err, err
    assert (out / "model").stat().st_ino == model.st_ino and (out / "summary.json").read_bytes() == summary
    shutil.rmtree(out / "model")
    code, err = _run([*common, "--resume"], capsys)
    assert code == 0 and "nothing changed" not in err and f"student -> {out / 'model'}" in err, err
    assert (out / "model" / "config.json").is_file() and (out / "summary.json").read_bytes() == summary


def test_an_empty_teacher_is_an_error_not_the_default_model(tmp_path, capsys):
    code, err = _run(["distill", "--teacher", "", "-o", str(tmp_path / "out"), *FAST], capsys)
    assert code == 1 and err == ("fastbert: error: --teacher is empty (give a checkpoint directory, or leave it out "
                                 "for the default model)\n")
    assert not (tmp_path / "out" / "model").exists()
