"""fastbert's task models (`fastbert.from_pretrained(dir, task=...)`) against the transformers head classes.

Every family x every head class: a tiny seeded transformers model (all parameters perturbed so that no bias is
zero and no LayerNorm is the identity) is saved, loaded by fastbert, and both run in float32 on CPU on a padded
batch of mixed lengths. Outputs must match to 1e-5 relative to their largest magnitude (per-token outputs at real
positions only: fastbert has zeros at padding where transformers has padding garbage), and so must the losses.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fastbert
from fastbert.heads import TASKS
from fastbert.loading import CheckpointError
from tests.helpers import VOCAB, tiny_config, tiny_model

SEQ = 9
LENGTHS = (SEQ, 1, 5)  # mixed: full, a single token, in between
MC_LENGTHS = ((SEQ, 1, 5), (3, SEQ, 7))  # [batch=2, choices=3]

HF_SUFFIX = {"masked-lm": "ForMaskedLM", "next-sentence": "ForNextSentencePrediction",
             "pretraining": "ForPreTraining", "sequence-classification": "ForSequenceClassification",
             "token-classification": "ForTokenClassification", "question-answering": "ForQuestionAnswering",
             "multiple-choice": "ForMultipleChoice"}
NO_PAIR_TASKS = tuple(t for t in TASKS if t not in ("next-sentence", "pretraining"))
FAMILY_TASKS = {
    "bert": TASKS,
    "roberta": NO_PAIR_TASKS,
    "xlm-roberta": NO_PAIR_TASKS,
    "camembert": ("masked-lm", "sequence-classification"),
    "distilbert": NO_PAIR_TASKS,
    "albert": ("masked-lm", "pretraining") + NO_PAIR_TASKS[1:],
    "electra": ("masked-lm", "pretraining") + NO_PAIR_TASKS[1:],
    "modernbert": NO_PAIR_TASKS,
}
# (output field, per token?) compared for each task; "pretraining" differs per family.
FIELDS = {
    "masked-lm": [("logits", True)],
    "next-sentence": [("logits", False)],
    "sequence-classification": [("logits", False)],
    "token-classification": [("logits", True)],
    "question-answering": [("start_logits", True), ("end_logits", True)],
    "multiple-choice": [("logits", False)],
    ("bert", "pretraining"): [("prediction_logits", True), ("seq_relationship_logits", False)],
    ("albert", "pretraining"): [("prediction_logits", True), ("sop_logits", False)],
    ("electra", "pretraining"): [("logits", True)],
}


def save_hf_model(family: str, task: str, directory, **config_overrides):
    """`tests.helpers.tiny_model` (seeded, every parameter perturbed) of ``task``'s class, saved (safetensors)."""
    model = tiny_model(family, HF_SUFFIX.get(task, task), **config_overrides)
    model.save_pretrained(directory)
    return model


def padded_batch(family: str, lengths, seed: int = 1):
    """input_ids / attention_mask (/ token_type_ids) of shape [*lengths.shape, SEQ], padded on the right."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(SEQ) < lengths[..., None]).long()
    pad = tiny_config(family).pad_token_id
    ids = torch.randint(3, VOCAB, mask.shape, generator=gen).masked_fill(mask == 0, pad)
    batch = {"input_ids": ids, "attention_mask": mask}
    if family in ("bert", "albert", "electra"):
        batch["token_type_ids"] = torch.randint(0, 2, mask.shape, generator=gen) * mask
    return batch


def task_labels(family: str, task: str, batch, num_labels: int, variant: str = "single") -> dict:
    gen = torch.Generator().manual_seed(2)
    mask = batch["attention_mask"].bool()
    b = mask.shape[0]

    def per_token(high):  # random where real (half of them for MLM-like), -100 at padding
        labels = torch.randint(0, high, mask.shape, generator=gen)
        return labels.masked_fill(~mask, -100)

    mlm = per_token(VOCAB).masked_fill(torch.rand(mask.shape, generator=gen) < 0.5, -100)
    mlm[..., 0] = torch.randint(0, VOCAB, mask.shape[:-1], generator=gen)  # every row scores a token
    pair = torch.randint(0, 2, (b,), generator=gen)
    if task == "masked-lm":
        return {"labels": mlm}
    if task == "next-sentence":
        return {"labels": pair}
    if task == "pretraining":
        if family == "bert":
            return {"labels": mlm, "next_sentence_label": pair}
        if family == "albert":
            return {"labels": mlm, "sentence_order_label": pair}
        return {"labels": torch.randint(0, 2, mask.shape, generator=gen)}  # ELECTRA: 1 = replaced
    if task == "token-classification":
        return {"labels": per_token(num_labels)}
    if task == "question-answering":  # the last row's end lies past the sequence: clamped and ignored
        start = torch.randint(0, SEQ, (b,), generator=gen)
        end = torch.randint(0, SEQ, (b,), generator=gen)
        end[-1] = SEQ + 4
        return {"start_positions": start, "end_positions": end}
    if task == "multiple-choice":
        return {"labels": torch.randint(0, mask.shape[1], (b,), generator=gen)}
    if variant == "single":
        return {"labels": torch.randint(0, num_labels, (b,), generator=gen)}
    if variant == "multi-label":
        return {"labels": torch.randint(0, 2, (b, num_labels), generator=gen).float()}
    if variant == "regression":
        return {"labels": torch.randn(b, generator=gen)}
    return {"labels": torch.randn(b, num_labels, generator=gen)}  # problem_type="regression", several outputs


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6):
    assert ours.shape == theirs.shape, f"{what}: shape {tuple(ours.shape)} vs transformers {tuple(theirs.shape)}"
    err = (ours.double() - theirs.double()).abs().max().item()
    scale = theirs.double().abs().max().item()
    assert err <= rtol * scale + atol, f"{what}: max abs error {err:.3g} vs max |transformers| {scale:.3g}"


def load(directory, task):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete task checkpoint loads without any warning
        model = fastbert.from_pretrained(directory, task=task)
    assert model.loading_info == {"unexpected_keys": [], "missing_head_keys": []}
    return model


def compare(family, task, hf_model, model, batch, labels, fields, check_loss=True):
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = hf_model(**batch, **labels)
        ours = model(**batch, **labels)
    for field, per_token in fields:
        a, b = getattr(ours, field), getattr(theirs, field)
        if per_token:
            a, b = a[mask], b[mask]
        assert_close(a, b, f"{family} {task} {field}")
    if check_loss:
        assert_close(ours.loss, theirs.loss, f"{family} {task} loss")


CASES = [(family, task) for family, tasks in FAMILY_TASKS.items() for task in tasks]


@pytest.mark.parametrize("family,task", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_task_matches_transformers(family, task, tmp_path):
    num_labels = {"sequence-classification": 3, "token-classification": 5}.get(task, 2)
    hf_model = save_hf_model(family, task, tmp_path, num_labels=num_labels)
    model = load(tmp_path, task)
    fields = FIELDS.get((family, task), FIELDS.get(task))
    if task == "multiple-choice":
        batch = padded_batch(family, MC_LENGTHS)
    else:
        batch = padded_batch(family, LENGTHS)
    labels = task_labels(family, task, batch, num_labels)
    # QA's softmax runs over every position, padding included: that call runs the padded form, and its loss too
    # equals transformers', but where a sliding window holds padding alone (ModernBERT's tiny windows here), which
    # it says, and whose loss is compared on an unpadded batch.
    windowed = family == "modernbert" and task == "question-answering"
    if windowed:
        with pytest.warns(UserWarning, match="may differ slightly from transformers'"):
            compare(family, task, hf_model, model, batch, labels, fields, check_loss=False)
        full = padded_batch(family, (SEQ,) * len(LENGTHS))
        compare(family, task, hf_model, model, full, task_labels(family, task, full, num_labels), fields)
    else:
        compare(family, task, hf_model, model, batch, labels, fields)


def test_a_call_whose_loss_reads_padding_leaves_other_threads_calls_padding_free(tmp_path):
    """The padded form is per call: a plain call made while a labelled one is inside the encoder (forced by a hook)
    still gets zeros at padding, and so do later calls."""
    import threading

    save_hf_model("bert", "token-classification", tmp_path, num_labels=5)
    model = load(tmp_path, "token-classification")
    batch = padded_batch("bert", LENGTHS)
    padding = batch["attention_mask"] == 0
    labels = torch.randint(0, 5, padding.shape, generator=torch.Generator().manual_seed(3))  # real labels at padding

    def plain():
        with torch.no_grad():
            return model(**batch, output_hidden_states=True).hidden_states[-1][padding]

    inside, done, seen = threading.Event(), threading.Event(), {}
    model.encoder.register_forward_pre_hook(
        lambda module, args: (inside.set(), done.wait(10)) and None if threading.current_thread().name == "A" else None)

    def labelled():
        with torch.no_grad():
            model(**batch, labels=labels)

    def other():
        inside.wait(10)
        seen["during"] = plain()
        done.set()

    threads = [threading.Thread(target=labelled, name="A"), threading.Thread(target=other, name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not seen["during"].any() and not plain().any()


def test_a_compiled_question_answering_loss_on_a_padded_batch_equals_transformers(tmp_path):
    hf_model = save_hf_model("bert", "question-answering", tmp_path)
    model = load(tmp_path, "question-answering")
    batch = padded_batch("bert", LENGTHS)
    labels = task_labels("bert", "question-answering", batch, 2)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        assert_close(compiled(**batch, **labels).loss, hf_model(**batch, **labels).loss, "compiled QA loss")


@pytest.mark.parametrize("task", ["token-classification", "masked-lm"])
@pytest.mark.parametrize("family", ["bert", "roberta", "modernbert"])
def test_labels_at_padded_positions_are_scored_as_transformers_scores_them(family, task, tmp_path):
    """A collator that leaves real labels at padding (not -100): transformers scores the states it computed there,
    and so does fastbert, on the padded form for that call; a call without such labels stays padding-free."""
    num_labels = 5 if task == "token-classification" else 2
    wide = {"local_attention": 2 * SEQ} if family == "modernbert" else {}  # (narrower windows: see above)
    hf_model = save_hf_model(family, task, tmp_path, num_labels=num_labels, **wide)
    model = load(tmp_path, task)
    batch = padded_batch(family, LENGTHS)
    labels = torch.randint(0, num_labels if task == "token-classification" else VOCAB, batch["input_ids"].shape,
                           generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_close(model(**batch, labels=labels).loss, hf_model(**batch, labels=labels).loss, f"{family} {task}")
    assert model.encoder.padding_free and model.encoder.zero_padded_rows  # (restored after the call)


SEQ_CLS_VARIANTS = {  # variant: (num_labels, problem_type)
    "regression": (1, None),
    "multi-label": (3, None),
    "problem-type-regression": (3, "regression"),
}
SEQ_CLS_CASES = [(family, variant) for family in FAMILY_TASKS if family != "camembert" for variant in SEQ_CLS_VARIANTS]


@pytest.mark.parametrize("family,variant", SEQ_CLS_CASES,
                         ids=[f"{f}-sequence-classification-{v}" for f, v in SEQ_CLS_CASES])
def test_sequence_classification_losses(family, variant, tmp_path):
    num_labels, problem_type = SEQ_CLS_VARIANTS[variant]
    task = "sequence-classification"
    hf_model = save_hf_model(family, task, tmp_path, num_labels=num_labels, problem_type=problem_type)
    model = load(tmp_path, task)
    batch = padded_batch(family, LENGTHS)
    labels = task_labels(family, task, batch, num_labels, variant)
    compare(family, task, hf_model, model, batch, labels, FIELDS[task])


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert", "electra", "modernbert"])
def test_untied_decoder(family, tmp_path):
    """tie_word_embeddings=False: the MLM decoder has its own weight (and, for BERT/RoBERTa/ALBERT, bias; their
    head's separate `bias`, unused by transformers then, is skipped without a warning)."""
    hf_model = save_hf_model(family, "masked-lm", tmp_path, tie_word_embeddings=False)
    model = load(tmp_path, "masked-lm")
    assert model.mlm.decoder_weight is not None
    batch = padded_batch(family, LENGTHS)
    labels = task_labels(family, "masked-lm", batch, 2)
    compare(family, "masked-lm", hf_model, model, batch, labels, FIELDS["masked-lm"])


BIN_CASES = [("bert", "pretraining"), ("roberta", "masked-lm"), ("distilbert", "masked-lm"), ("electra", "masked-lm"),
             ("bert", "sequence-classification")]


@pytest.mark.parametrize("family,task", BIN_CASES, ids=[f"{f}-{t}" for f, t in BIN_CASES])
def test_pytorch_model_bin(family, task, tmp_path):
    """A checkpoint saved as pytorch_model.bin (a torch.save'd state dict, tied copies of the word embeddings
    included) loads the same, without warnings."""
    hf_model = save_hf_model(family, task, tmp_path / "hf")
    hf_model.config.save_pretrained(tmp_path)
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")
    assert any("decoder" in key or "lm_head.weight" in key or "projector.weight" in key
               for key in hf_model.state_dict()) == (task != "sequence-classification")
    model = load(tmp_path, task)
    batch = padded_batch(family, LENGTHS)
    labels = task_labels(family, task, batch, 2)
    fields = FIELDS.get((family, task), FIELDS.get(task))
    compare(family, task, hf_model, model, batch, labels, fields)


def test_hidden_states_and_backward(tmp_path):
    hf_model = save_hf_model("bert", "masked-lm", tmp_path)
    model = load(tmp_path, "masked-lm")
    batch = padded_batch("bert", LENGTHS)
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        theirs = hf_model(**batch, output_hidden_states=True)
    ours = model(**batch, **task_labels("bert", "masked-lm", batch, 2), output_hidden_states=True)
    assert len(ours.hidden_states) == len(theirs.hidden_states) == 3
    for depth, (a, b) in enumerate(zip(ours.hidden_states, theirs.hidden_states, strict=True)):
        assert_close(a[mask].detach(), b[mask], f"hidden_states[{depth}]")
    ours.loss.backward()  # the tied decoder trains the word embeddings
    assert model.encoder.embeddings.word_embeddings.grad.abs().sum() > 0
    assert model.mlm.decoder_bias.grad.abs().sum() > 0


def test_unknown_and_unsupported_tasks(tmp_path):
    save_hf_model("roberta", "masked-lm", tmp_path)
    with pytest.raises(ValueError, match="unknown task 'translation'"):
        fastbert.from_pretrained(tmp_path, task="translation")
    with pytest.raises(ValueError, match="no 'next-sentence' head.*masked-lm, sequence-classification"):
        fastbert.from_pretrained(tmp_path, task="next-sentence")


def test_headless_checkpoint_warns_and_initialises(tmp_path):
    save_hf_model("bert", "Model", tmp_path)  # the bare BertModel: no classifier weights
    with pytest.warns(UserWarning, match="no weights for the sequence-classification head"):
        model = fastbert.from_pretrained(tmp_path, task="sequence-classification")
    assert "classifier.weight" in model.loading_info["missing_head_keys"]
    assert float(model.classifier.out.bias.detach().abs().max()) == 0.0  # HF's initialisation: zero bias
    batch = padded_batch("bert", LENGTHS)
    logits = model(**batch).logits
    assert logits.shape == (len(LENGTHS), 2) and torch.isfinite(logits).all()


def test_a_required_head_that_is_missing_is_an_error(tmp_path, recwarn):
    save_hf_model("bert", "Model", tmp_path)
    with pytest.raises(CheckpointError, match=r"no trained sequence-classification head "
                       r"\(classifier.weight, classifier.bias missing\)"):
        fastbert.from_pretrained(tmp_path, task="sequence-classification", require_head=True)
    assert not [w for w in recwarn if "no weights for the" in str(w.message)]  # an error, not a warning as well
    save_hf_model("bert", "sequence-classification", tmp_path / "trained")
    model = fastbert.from_pretrained(tmp_path / "trained", task="sequence-classification", require_head=True)
    assert model.loading_info["missing_head_keys"] == []


def test_bad_inputs(tmp_path):
    save_hf_model("bert", "multiple-choice", tmp_path)
    model = fastbert.from_pretrained(tmp_path, task="multiple-choice")
    batch = padded_batch("bert", LENGTHS)
    with pytest.raises(ValueError, match=r"input_ids \[batch, choices, seq\]"):
        model(**batch)
    mc = padded_batch("bert", MC_LENGTHS)
    with pytest.raises(ValueError, match="labels must have shape"):
        model(**mc, labels=torch.zeros(2, 3, dtype=torch.long))
    config = fastbert.FastBertConfig.from_hf_dict({**tiny_config("bert", num_labels=3).to_dict()})
    with pytest.raises(ValueError, match="num_labels == 2"):
        fastbert.heads.build_task_model(config, "question-answering")


def test_int32_labels(tmp_path):
    """Integer labels of any width select single-label cross entropy (transformers' rule) and give its loss."""
    save_hf_model("bert", "sequence-classification", tmp_path, num_labels=3)
    model = fastbert.from_pretrained(tmp_path, task="sequence-classification")
    batch = padded_batch("bert", LENGTHS)
    labels = torch.tensor([2, 0, 1])
    with torch.no_grad():
        wide = model(**batch, labels=labels).loss
        narrow = model(**batch, labels=labels.int()).loss
        expected = torch.nn.functional.cross_entropy(model(**batch).logits, labels)
    assert_close(narrow, wide, "int32 labels")
    assert_close(wide, expected, "single-label loss")


@pytest.mark.parametrize("family,task", [("bert", "multiple-choice"), ("electra", "masked-lm")],
                         ids=["bert-multiple-choice", "electra-masked-lm"])
def test_inputs_embeds(family, task, tmp_path):
    """inputs_embeds instead of input_ids (width E: 16 for ELECTRA; [B, C, S, E] for multiple choice)."""
    hf_model = save_hf_model(family, task, tmp_path)
    model = load(tmp_path, task)
    batch = padded_batch(family, MC_LENGTHS if task == "multiple-choice" else LENGTHS)
    width = getattr(hf_model.config, "embedding_size", hf_model.config.hidden_size)
    batch["inputs_embeds"] = torch.randn(*batch.pop("input_ids").shape, width)
    compare(family, task, hf_model, model, batch, task_labels(family, task, batch, 2), FIELDS[task])


FIRST_POSITION_FAMILIES = ["bert", "roberta", "distilbert", "albert", "electra", "modernbert"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("family", FIRST_POSITION_FAMILIES)
def test_heads_reading_position_0_of_a_left_padded_row_match_transformers(family, compiled, tmp_path):
    """The pooler and the first-token classifiers read position 0, which left padding makes a padded position:
    transformers computes a state there, and so does fastbert for such a batch (its padded form)."""
    hf_model = save_hf_model(family, "sequence-classification", tmp_path)
    model = load(tmp_path, "sequence-classification").eval()
    lengths = (SEQ, 7, 8) if family == "modernbert" else LENGTHS  # (its windows reach 2 positions each side)
    batch = {name: value.flip(-1) for name, value in padded_batch(family, lengths).items()}
    labels = task_labels(family, "sequence-classification", batch, 2)
    if compiled:
        torch._dynamo.reset()  # (one forward code for every family: its recompiles would add up across cases)
        with torch.no_grad():
            model(**batch)  # the backends load outside the graph
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model  # (one graph)
    compare(family, "sequence-classification", hf_model, run, batch, labels, FIELDS["sequence-classification"])
    for side in (batch, padded_batch(family, lengths)):  # left and right padding: zeros at padded positions still
        with torch.no_grad():
            hidden = run(**side, output_hidden_states=True).hidden_states
        assert all(torch.all(state[side["attention_mask"] == 0] == 0) for state in hidden)


def test_a_left_padded_first_token_beyond_a_sliding_window_is_refused(tmp_path):
    """ModernBERT's "cls" head on a row whose first token lies past position 0's sliding window: transformers
    averages the padding there, fastbert's window holds no key; it says so instead of returning other logits."""
    hf_model = save_hf_model("modernbert", "sequence-classification", tmp_path)  # local_attention=4
    model = load(tmp_path, "sequence-classification").eval()
    batch = {name: value.flip(-1) for name, value in padded_batch("modernbert", (SEQ, 7)).items()}
    compare("modernbert", "sequence-classification", hf_model, model, batch, {}, FIELDS["sequence-classification"],
            check_loss=False)  # the first token 2 positions in: within the window's reach of 2
    batch = {name: value.flip(-1) for name, value in padded_batch("modernbert", (SEQ, 6)).items()}
    with pytest.raises(ValueError, match="more than 2 positions from position 0"):
        model(**batch)


def _no_dropout(family: str) -> dict:
    return {name: 0.0 for name, value in tiny_config(family).to_dict().items()
            if "dropout" in name and isinstance(value, float)}


@pytest.mark.parametrize("family,task", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_task_gradients_match_transformers(family, task, tmp_path):
    """Training mode, dropout off: the loss's gradient for every parameter of fastbert's task model equals
    transformers' for the parameters it was loaded from (the packed Q/K/V's against the concatenation of q, k, v)
    to 1e-5 of the model's largest gradient."""
    from fastbert.config import FastBertConfig
    from fastbert.heads import head_key_map
    from fastbert.loading import detect_prefix, encoder_key_map, read_state_dict

    num_labels = {"sequence-classification": 3, "token-classification": 5}.get(task, 2)
    hf_model = save_hf_model(family, task, tmp_path, num_labels=num_labels, **_no_dropout(family)).train()
    model = load(tmp_path, task).train()
    lengths = MC_LENGTHS if task == "multiple-choice" else LENGTHS
    if task == "question-answering":  # its softmax runs over padded positions too: unpadded (test above)
        lengths = (SEQ,) * len(LENGTHS)
    batch = padded_batch(family, lengths)
    labels = task_labels(family, task, batch, num_labels)
    hf_model(**batch, **labels).loss.backward()
    model(**batch, **labels).loss.backward()

    config = FastBertConfig.from_json_file(tmp_path / "config.json")
    prefix = detect_prefix(config, read_state_dict(tmp_path))
    pairs = [("encoder." + ours, theirs) for ours, theirs in encoder_key_map(model.encoder.config, prefix)]
    pairs += head_key_map(config, task)
    ours = dict(model.named_parameters())
    theirs = dict(hf_model.named_parameters())
    compared = {}
    for name, sources in pairs:
        if name not in ours or not all(s in theirs for s in sources):
            continue  # tied copies (a decoder sharing the word embeddings): compared as the table itself
        expected = [theirs[s].grad for s in sources]
        if ours[name].grad is None and all(g is None for g in expected):
            continue
        compared[name] = (ours[name].grad, torch.cat(expected))
    assert len(compared) >= len(ours) - 2, sorted(set(ours) - set(compared))
    scale = max(float(want.abs().max()) for _, want in compared.values())
    for name, (got, want) in compared.items():
        assert got is not None, f"{name}: no gradient"
        err = float((got.double() - want.double()).abs().max())
        assert err <= 1e-5 * scale, f"{family} {task} {name}: gradient error {err:.3g}, largest gradient {scale:.3g}"
