"""Whole models on the triton backend (interpreter on CPU) against transformers: every family, padded vs packed
variable-length execution, fp16/bf16 against transformers in the same dtype, from_pretrained on a saved dir."""

from __future__ import annotations

import copy

import pytest
import torch

import fastbert
from tests.helpers import DEVICE, FAMILIES, max_error, padded_batch, rel_err, tiny_model

# hidden 64 with 2 heads: head_dim 32, one of the BERT-family sizes (the default tiny models have head_dim 8)
WIDE = {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 96}
WIDE_DISTILBERT = {"dim": 64, "n_heads": 2, "hidden_dim": 96}


def triton_pair(family: str, dtype=torch.float32):
    """(transformers model, the same model optimized onto the triton backend), both in `dtype` on DEVICE."""
    reference = tiny_model(family, **(WIDE_DISTILBERT if family == "distilbert" else WIDE))
    reference = reference.to(device=DEVICE, dtype=dtype)
    return reference, fastbert.optimize(copy.deepcopy(reference), backend="triton")


def batch_inputs(family: str, batch: int = 3, seqlen: int = 11):
    pad_id = 1 if family in ("roberta", "xlm-roberta", "camembert") else 0
    ids, mask = padded_batch(batch, seqlen, pad_id=pad_id)
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}


def real_positions(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[mask.bool()]


def check_family_fp32(family: str):
    reference, optimized = triton_pair(family)
    inputs = batch_inputs(family)
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        actual = optimized(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    error = rel_err(real_positions(actual, mask), real_positions(expected, mask))
    assert error < 1e-5, f"{family}: relative error {error:.3g} vs transformers"


def test_bert_fp32_matches_transformers():
    check_family_fp32("bert")


@pytest.mark.interpreter
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "bert"])
def test_family_fp32_matches_transformers(family):
    check_family_fp32(family)


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.interpreter)],
                         ids=["fp16", "bf16"])
def test_half_precision_error_within_twice_transformers(dtype):
    """fastbert-triton in fp16/bf16 vs transformers fp32, next to transformers itself in fp16/bf16."""
    reference, _ = triton_pair("bert")
    inputs = batch_inputs("bert")
    half_reference, optimized = triton_pair("bert", dtype)
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        plain = half_reference(**inputs).last_hidden_state
        actual = optimized(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    expected, plain, actual = (real_positions(t, mask) for t in (expected, plain, actual))
    scale = float(expected.abs().max())
    fast_err, plain_err = max_error(actual, expected), max_error(plain, expected)
    assert fast_err <= 2 * plain_err + torch.finfo(dtype).eps * scale, (
        f"fastbert {dtype}: error {fast_err:.3g}, transformers {dtype}: {plain_err:.3g}")


@pytest.mark.parametrize("family", ["bert", pytest.param("roberta", marks=pytest.mark.interpreter),
                                    pytest.param("albert", marks=pytest.mark.interpreter)])
def test_padded_and_packed_execution_agree(family):
    _, optimized = triton_pair(family)
    inputs = batch_inputs(family)
    fast_model = optimized.base_model._fastbert.build.fast
    with torch.inference_mode():
        fast_model.padding_free = True
        packed = optimized(**inputs).last_hidden_state
        fast_model.padding_free = False
        fast_model.zero_padded_rows = True  # optimize keeps padded rows as transformers computes them
        padded = optimized(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    error = rel_err(real_positions(packed, mask), real_positions(padded, mask))
    assert error < 1e-5, f"padded vs packed: relative error {error:.3g}"
    assert packed[~mask.bool()].abs().max() == 0 and padded[~mask.bool()].abs().max() == 0


@pytest.mark.interpreter
def test_from_pretrained_triton(tmp_path):
    reference, _ = triton_pair("electra")
    reference.save_pretrained(tmp_path)
    model = fastbert.from_pretrained(tmp_path, backend="triton", device=DEVICE)
    inputs = batch_inputs("electra")
    with torch.inference_mode():
        expected = reference(**inputs).last_hidden_state
        actual = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"]
    assert rel_err(real_positions(actual, mask), real_positions(expected, mask)) < 1e-5


@pytest.mark.interpreter
def test_torch_compile_fullgraph_inductor_over_triton_model():
    """The whole encoder, unpadded batch, compiled in one graph by inductor around the triton custom ops (~15 s in
    the interpreter). Padded batches are not traced in one graph: the model reads max_seqlen as a Python int."""
    _, optimized = triton_pair("bert")
    fast_model = optimized.base_model._fastbert.build.fast
    fast_model.validate_inputs = False  # input range checks read tensor values (a graph break)
    input_ids = batch_inputs("bert")["input_ids"].clamp(min=3)
    with torch.inference_mode():
        expected = fast_model(input_ids).last_hidden_state
        compiled = torch.compile(fast_model, fullgraph=True)(input_ids).last_hidden_state
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)
