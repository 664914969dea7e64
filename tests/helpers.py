"""What the tests share, in one module (a test module imports helpers from here, never from another test module):

- tiny random transformers models of every supported family, padded batches, the error metric;
- the kernel tests' device, dtype ids and accuracy rule (`fastbert.numerics`', the same for these tests,
  `fastbert check` and benchmarks/gpu_check.py; on CPU the kernels run in the Triton interpreter, conftest sets
  TRITON_INTERPRET=1);
- the op tests' inputs, the backends' torch ops (`backend_op`, which loads the backend first), the backends each
  check is parametrised over, gradient checks (against the eager op's autograd and by gradcheck of the spec's
  backward), the triton LayerNorm ops' backward and dropout checks, and the attention checks that take a backend
  and a device (padding poison, sliding windows);
- the inputs of a head model's forward (`optimize_inputs`);
- the client tests' texts, seeded models and the check that fastbert's path really ran (`run_both`).
- the training tests' kill-and-resume run (`kill_and_resume`) and its comparison with an uninterrupted one.

transformers is imported inside the functions that use it: importing this module does not load it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fastbert import backends, ops
from fastbert.numerics import assert_accurate, max_error
from fastbert.ops.layernorm import layer_norm_fp32
from fastbert.ops.spec import SPECS
from tools.op_checks import DEVICE, rand

if TYPE_CHECKING:
    import transformers
    from transformers import PreTrainedModel

__all__ = ["DEVICE", "assert_accurate", "max_error", "rand"]  # re-exported: the op tests take them from here

DTYPE_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
ALL_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16, torch.float32)]
HALF_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)]


# ============================================================================================ tiny HF models
VOCAB = 97
MAX_POSITIONS = 40

# family -> (config class, extra config fields, head classes by task)
FAMILIES = {
    "bert": ("BertConfig", {}, "Bert"),
    "roberta": ("RobertaConfig", {"pad_token_id": 1}, "Roberta"),
    "xlm-roberta": ("XLMRobertaConfig", {"pad_token_id": 1}, "XLMRoberta"),
    "camembert": ("CamembertConfig", {"pad_token_id": 1}, "Camembert"),
    "distilbert": ("DistilBertConfig", {}, "DistilBert"),
    "albert": ("AlbertConfig", {"embedding_size": 16, "num_hidden_groups": 2, "inner_group_num": 1,
                                "num_hidden_layers": 4, "hidden_act": "gelu_new"}, "Albert"),
    "electra": ("ElectraConfig", {"embedding_size": 24}, "Electra"),
    # 3 layers: global, sliding, sliding (window 4: +-2 positions, shorter than the test batches); every bias
    # present (tests/families/test_modernbert.py covers ModernBERT-base's bias-free default)
    "modernbert": ("ModernBertConfig", {"num_hidden_layers": 3, "local_attention": 4, "norm_bias": True,
                                        "attention_bias": True, "mlp_bias": True, "classifier_bias": True,
                                        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "cls_token_id": 1,
                                        "sep_token_id": 2}, "ModernBert"),
}
HEADS = {
    "bert": ["Model", "ForMaskedLM", "ForNextSentencePrediction", "ForPreTraining", "ForSequenceClassification",
             "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice"],
    "roberta": ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                "ForQuestionAnswering", "ForMultipleChoice"],
    "distilbert": ["Model", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                   "ForQuestionAnswering", "ForMultipleChoice"],
    "albert": ["Model", "ForMaskedLM", "ForPreTraining", "ForSequenceClassification", "ForTokenClassification",
               "ForQuestionAnswering", "ForMultipleChoice"],
    "electra": ["Model", "ForPreTraining", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                "ForQuestionAnswering", "ForMultipleChoice"],
}
HEADS["xlm-roberta"] = HEADS["camembert"] = HEADS["roberta"]
HEADS["modernbert"] = HEADS["distilbert"]


# The fused ops each layer architecture runs (fastbert's config.norm_placement).
ARCHITECTURE_OPS = {
    "post": ("embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm"),
    "pre": ("embedding_layernorm", "qkv_rotary", "attention", "linear_residual_prenorm", "linear_glu"),
}


def fused_ops(model: torch.nn.Module) -> tuple[str, ...]:
    """The fused ops fastbert's encoder runs for a transformers ``model`` (by its config's layer architecture)."""
    from fastbert.config import FastBertConfig

    return ARCHITECTURE_OPS[FastBertConfig.from_hf_dict(model.config.to_dict()).norm_placement]


def tiny_config(family: str, **overrides) -> transformers.PretrainedConfig:
    import transformers

    config_name, extra, _ = FAMILIES[family]
    cls = getattr(transformers, config_name)
    if family == "distilbert":
        fields = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                      max_position_embeddings=MAX_POSITIONS)
    elif family == "modernbert":  # no token types
        fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=MAX_POSITIONS)
    else:
        fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=MAX_POSITIONS, type_vocab_size=2)
    fields.update(extra)
    fields.update(overrides)
    return cls(**fields)


def tiny_model(family: str, head: str = "Model", **overrides) -> torch.nn.Module:
    """A seeded tiny random transformers model, eval mode, eager attention. Every parameter gets seeded noise:
    transformers initialises biases to 0 and LayerNorms to 1/0, which would hide a dropped or misplaced one."""
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, FAMILIES[family][2] + head)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def padded_batch(batch: int = 4, seqlen: int = 9, pad_id: int = 0, generator_seed: int = 1):
    """Token ids and a right-padded mask with lengths spread from 1 to seqlen."""
    gen = torch.Generator().manual_seed(generator_seed)
    ids = torch.randint(3, VOCAB, (batch, seqlen), generator=gen)
    lengths = torch.linspace(1, seqlen, batch).round().long()
    mask = (torch.arange(seqlen)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask


def optimize_inputs(family: str, head: str, model) -> dict:
    """The keyword inputs of a forward of a tiny ``family`` model under ``head``, labels included: a padded batch of
    4 x 9 (full length for question answering), token types where the family has them, [2, 4, 9] for multiple
    choice."""
    pad = model.config.pad_token_id or 0
    batch, seqlen = 4, 9
    full_length = head == "ForQuestionAnswering"  # HF's span loss also softmaxes padded positions: see README
    ids, mask = padded_batch(batch, seqlen, pad_id=pad)
    if full_length:
        mask = torch.ones_like(mask)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family in ("bert", "albert", "electra"):
        inputs["token_type_ids"] = (torch.arange(seqlen) >= 4).long().expand(batch, seqlen).contiguous()
    gen = torch.Generator().manual_seed(2)
    token_labels = torch.randint(0, VOCAB, (batch, seqlen), generator=gen).masked_fill(mask == 0, -100)
    if head == "ForMaskedLM":
        inputs["labels"] = token_labels
    elif head == "ForNextSentencePrediction":
        inputs["labels"] = torch.tensor([0, 1, 1, 0])
    elif head == "ForPreTraining":
        if family == "electra":
            inputs["labels"] = torch.randint(0, 2, (batch, seqlen), generator=gen)
        else:
            inputs["labels"] = token_labels
            inputs["next_sentence_label" if family == "bert" else "sentence_order_label"] = torch.tensor([0, 1, 1, 0])
    elif head == "ForSequenceClassification":
        inputs["labels"] = torch.tensor([0, 1, 1, 0])
    elif head == "ForTokenClassification":
        inputs["labels"] = torch.randint(0, 2, (batch, seqlen), generator=gen).masked_fill(mask == 0, -100)
    elif head == "ForQuestionAnswering":
        inputs["start_positions"], inputs["end_positions"] = torch.tensor([0, 2, 5, 8]), torch.tensor([1, 3, 7, 8])
    elif head == "ForMultipleChoice":
        inputs = {k: v[None].expand(2, *v.shape).contiguous() for k, v in inputs.items()}  # [B=2, C=4, S]
        inputs["labels"] = torch.tensor([1, 3])
    return inputs


# ============================================================================================== comparisons
def _as_float64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().double()
    return torch.as_tensor(np.asarray(value, dtype=np.float64))


def rel_err(actual, expected, floor: float = 1e-6) -> float:
    """max |actual - expected| / max(max |expected|, floor): one number for two tensors, arrays or nested lists of
    numbers of one shape (0 when they are empty)."""
    actual, expected = _as_float64(actual), _as_float64(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if expected.numel() == 0:
        return 0.0
    actual = actual.to(expected.device)
    return float((actual - expected).abs().max() / max(float(expected.abs().max()), floor))


TOL = 1e-5  # max |actual - expected| / max |expected| over one output (hidden states, scores, logits)


def assert_close(actual, expected, what: str = "", tol: float = TOL) -> None:
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


# ================================================================================================ op inputs
OP_HEADS, HEAD_DIM, IN_FEATURES, OUT_FEATURES, POSITIONS = 2, 8, 24, 40, 150

TOKEN_OPS = [op for op in SPECS if op != "attention"]  # the ops over token rows (every op but attention)


def float_tensor(shape, dtype, gen, scale=1.0, grad=True) -> torch.Tensor:
    """Seeded N(0, scale^2) values drawn in float64 (the same numbers in every dtype), a leaf requiring grad."""
    t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(grad)


def op_args(op: str, rows: int, dtype: torch.dtype, variant: str = "full", seed: int = 0,
            small: bool = False) -> tuple:
    """The functional entry's positional arguments (the order `dispatch` passes) for ``rows`` tokens; float tensors
    require grad. Variants: "full" (every optional given), "none" (optional tensors None), an activation name.
    ``small``: narrower features (for gradcheck, which perturbs every element)."""
    gen = torch.Generator().manual_seed(seed)
    full = variant != "none"
    in_features, out_features = (4, 6) if small else (IN_FEATURES, OUT_FEATURES)
    head_dim, vocab, positions = (2, 7, 5) if small else (HEAD_DIM, 30, 20)

    def f(*shape, scale=1.0):
        return float_tensor(shape, dtype, gen, scale)

    if op == "embedding_layernorm":
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        position_ids = torch.randint(0, positions, (rows,), generator=gen) if full else None
        types = torch.randint(0, 2, (rows,), generator=gen) if full else None  # None: row 0 of the type table
        return (ids, position_ids, types, f(vocab, out_features), f(positions, out_features) if full else None,
                f(2, out_features), f(out_features), f(out_features) if full else None, 1e-12)
    width = 3 * OP_HEADS * head_dim
    if op == "qkv_projection":
        return (f(rows, in_features), f(width, in_features, scale=0.2), f(width) if full else None, OP_HEADS)
    if op == "qkv_rotary":
        cos, sin = ops.rotary_tables(10000.0, head_dim, POSITIONS)
        position_ids = torch.randint(0, POSITIONS, (rows,), generator=gen)
        return (f(rows, in_features), f(width, in_features, scale=0.2), f(width) if full else None, OP_HEADS,
                position_ids, cos.clone().requires_grad_(), sin.clone().requires_grad_())
    if op in ("linear_activation", "linear_glu"):
        activation = variant if variant in ops.ACTIVATIONS else "gelu"
        out = out_features * (2 if op == "linear_glu" else 1)
        return (f(rows, in_features), f(out, in_features, scale=0.2), f(out) if full else None, activation)
    if op in ("linear_residual_layernorm", "linear_residual_prenorm"):
        return (f(rows, in_features), f(out_features, in_features, scale=0.2), f(out_features) if full else None,
                f(rows, out_features), f(out_features), f(out_features) if full else None, 1e-5)
    raise KeyError(op)


def attention_args(form: str, lengths: list[int], dtype=torch.float32, seed: int = 0, scale=None, window=None,
                   head_dim: int = HEAD_DIM, requires_grad: bool = True):
    """(q, k, v, cu_seqlens, max_seqlen, key_padding_mask, scale, window): packed over ``lengths`` or padded to the
    longest with a key mask (None when nothing is padded)."""
    gen = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    if form == "packed":
        shape = (sum(lengths), OP_HEADS, head_dim)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        q, k, v = (float_tensor(shape, dtype, gen, grad=requires_grad) for _ in range(3))
        return q, k, v, cu, longest, None, scale, window
    shape = (len(lengths), longest, OP_HEADS, head_dim)
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    q, k, v = (float_tensor(shape, dtype, gen, grad=requires_grad) for _ in range(3))
    return q, k, v, None, None, None if bool(mask.all()) else mask, scale, window


def cu_seqlens_of(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def on_device(args: tuple, device=DEVICE) -> tuple:
    """``args`` with every tensor moved to ``device`` as a leaf (requiring grad as before)."""
    return tuple(a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


def for_backend(backend: str, args: tuple) -> tuple:
    """``args`` where ``backend`` runs: the triton kernels on the test device (a GPU, or the interpreter on CPU),
    cpp and eager on CPU; vendor (torch's GEMM + a Triton epilogue) where triton runs."""
    return on_device(args) if backend in ("triton", "vendor") else args


def frozen_tables(op: str, args: tuple) -> tuple:
    """qkv_rotary's fp32 tables without grad: with fp16/bf16 q, k their gradients are not fp32-accurate (they would
    be judged by the fp32 rule)."""
    return (*args[:5], args[5].detach(), args[6].detach()) if op == "qkv_rotary" else args


# The backends a token op's gradients are checked on (against the eager op's autograd): cpp on every odd row count,
# triton (under the interpreter on CPU) on fewer rows and marked `interpreter`.
FP32_GRAD_CASES = [pytest.param("cpp", rows, id=f"cpp-rows{rows}") for rows in (1, 7, 130)] + [
    pytest.param("triton", rows, id=f"triton-rows{rows}", marks=pytest.mark.interpreter) for rows in (1, 130)]
LOW_PRECISION_GRAD_CASES = [
    pytest.param("cpp", torch.bfloat16, 65, id="cpp-bf16"),
    pytest.param("triton", torch.float16, 33, id="triton-fp16", marks=pytest.mark.interpreter),
    pytest.param("triton", torch.bfloat16, 33, id="triton-bf16", marks=pytest.mark.interpreter),
]
OPCHECK_BACKENDS = ["cpp", pytest.param("triton", marks=pytest.mark.interpreter)]
# The GEMM-bearing ops' lists (every token op but embedding_layernorm): the same plus the vendor backend, whose
# epilogue kernel is cheap under the interpreter (its GEMM is torch's): one row count unmarked, the rest marked.
GEMM_FP32_GRAD_CASES = FP32_GRAD_CASES + [
    pytest.param("vendor", 7, id="vendor-rows7"),
    *(pytest.param("vendor", rows, id=f"vendor-rows{rows}", marks=pytest.mark.interpreter) for rows in (1, 130))]
GEMM_LOW_PRECISION_GRAD_CASES = LOW_PRECISION_GRAD_CASES + [
    pytest.param("vendor", torch.float16, 33, id="vendor-fp16", marks=pytest.mark.interpreter),
    pytest.param("vendor", torch.bfloat16, 33, id="vendor-bf16", marks=pytest.mark.interpreter),
]
GEMM_OPCHECK_BACKENDS = [*OPCHECK_BACKENDS, pytest.param("vendor", marks=pytest.mark.interpreter)]


def backend_op(backend: str, op: str) -> torch._ops.OpOverloadPacket:
    """The torch op ``torch.ops.fastbert.<backend>_<op>``, its backend loaded first: backends load lazily and
    declare their torch ops then, so a test that looked the op up directly would pass only after another test had
    happened to load the backend. A backend that cannot load fails the test with the reason."""
    reason = backends.load(backend)
    if reason is not None:
        pytest.fail(reason)
    return getattr(torch.ops.fastbert, f"{backend}_{op}")


def opcheck_with_grad(op: str, backend: str, variant: str) -> None:
    """torch.library.opcheck of ``backend``'s torch op with float inputs that require grad."""
    args = torch_op_args(op, op_args(op, 6, torch.float32, variant))
    torch.library.opcheck(backend_op(backend, op).default, for_backend(backend, args))


# ================================================================================= triton LayerNorm backward
LN_VOCAB, LN_POSITIONS = 50, 40


def ln_op_args(op: str, rows: int, width: int, dtype: torch.dtype, in_features: int = 24, full: bool = True,
               activation: str = "gelu", seed: int = 0) -> tuple:
    """The functional entry's positional arguments for ``rows`` tokens of ``width`` features (the LayerNorm's or
    the linear output's), on the test device; float tensors require grad. ``full``: every optional given."""
    gen = torch.Generator().manual_seed(seed)

    def f(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        return t.to(DEVICE).requires_grad_()

    def ids(high):
        return torch.randint(0, high, (rows,), generator=gen).to(DEVICE)

    if op == "embedding_layernorm":
        return (ids(LN_VOCAB), ids(LN_POSITIONS) if full else None, ids(2) if full else None, f(LN_VOCAB, width),
                f(LN_POSITIONS, width) if full else None, f(2, width), f(width), f(width) if full else None, 1e-12)
    scale = in_features ** -0.5
    if op == "linear_activation":
        return f(rows, in_features), f(width, in_features, scale=scale), f(width) if full else None, activation
    return (f(rows, in_features), f(width, in_features, scale=scale), f(width) if full else None, f(rows, width),
            f(width), f(width) if full else None, 1e-5)


def triton_call(op: str, args: tuple, dropout_p: float = 0.0, dropout_seed: int = 0):
    """The triton backend's op with dropout (p, seed)."""
    return getattr(ops, op)(*args, dropout_p=dropout_p, dropout_seed=dropout_seed, backend="triton")


class OpsSeen(TorchDispatchMode):
    """The names of the torch ops dispatched while it is active, and (op name, dtype, shape) of every floating-point
    tensor they return."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()
        self.float_results: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func._schema.name)
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.float_results.append((func._schema.name, tensor.dtype, tuple(tensor.shape)))
        return out


def masked_reference(op: str, args: tuple, keep: torch.Tensor, p: float):
    """The op in fp64 (eager pieces, autograd) with the dropout mask ``keep``: what the triton op with that mask
    computes."""
    scale = 1.0 / (1.0 - p)

    def drop(t):
        return torch.where(keep, t * scale, t.new_zeros(()))

    if op == "embedding_layernorm":
        def fn(*a):
            return drop(SPECS[op].eager(*a))  # p = 0: LayerNorm(gathered sum)
        return fn

    def fn(x, weight, bias, residual, ln_weight, ln_bias, eps):
        summed = drop(torch.nn.functional.linear(x, weight, bias)) + residual
        normed = layer_norm_fp32(summed, ln_weight, ln_bias, eps)
        return (summed, normed) if op == "linear_residual_prenorm" else normed
    return fn


def forward_mask(op: str, args: tuple, p: float, seed: int) -> torch.Tensor:
    """The keep mask the triton forward drew. embedding_layernorm: its nonzero outputs. The linear ops: prenorm's
    summed differs from the residual exactly where the linear output was kept; linear_residual_layernorm's GEMM
    draws the same mask (same epilogue, seed and [rows, N] offsets), so its mask is read off prenorm's."""
    with torch.no_grad():
        if op == "embedding_layernorm":
            return triton_call(op, args, p, seed) != 0
        summed, _ = triton_call("linear_residual_prenorm", args, p, seed)
        return summed != args[3]


def check_triton_dropout_grads(op: str, rows: int, width: int) -> None:
    """Gradients with p = 0.3 against an fp64 reference built with the forward's mask: 1e-5 (fp32). A backward
    regenerating another mask (another seed, offset or RNG) sends gradients through other elements and fails."""
    p, seed = 0.3, 2024
    args = ln_op_args(op, rows, width, torch.float32)
    keep = forward_mask(op, args, p, seed)
    assert 0.5 < keep.float().mean().item() < 0.9
    fast = run_grads(lambda *a: triton_call(op, a, p, seed), args)
    reference = run_grads(masked_reference(op, args, keep, p), upcast(args))
    for index, (f, r) in enumerate(zip(fast, reference, strict=True)):
        assert_accurate(f, f, r, what=f"{op} dropout grad {index}")
    # the same check with the mask of another seed fails: the test can tell masks apart
    other = forward_mask(op, args, p, seed + 1)
    wrong = run_grads(masked_reference(op, args, other, p), upcast(args))
    with pytest.raises(AssertionError):
        for index, (f, r) in enumerate(zip(fast, wrong, strict=True)):
            assert_accurate(f, f, r, what=f"{op} grad {index} vs another seed's mask")


def check_triton_keep_rate(op: str, p: float) -> None:
    """Over 2**17 elements the kept fraction is 1 - p (5 sigma) and each kept element is the undropped value
    times 1/(1-p) (fp32, within one rounding)."""
    rows, width = 256, 512
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                 for a in ln_op_args(op, rows, width, torch.float32, in_features=16))
    with torch.no_grad():
        if op == "embedding_layernorm":
            dropped, plain = triton_call(op, args, p, 11), triton_call(op, args)
        else:  # residual 0: summed is the dropped linear output
            zero_residual = (*args[:3], torch.zeros_like(args[3]), *args[4:])
            dropped, plain = triton_call(op, zero_residual, p, 11)[0], triton_call(op, zero_residual)[0]
    kept = dropped != 0
    assert abs(kept.float().mean().item() - (1 - p)) < rate_tolerance(p, kept.numel())
    torch.testing.assert_close(dropped[kept], plain[kept] / (1 - p), rtol=3e-7, atol=0)


def check_triton_backward_kernel(op: str, kernel_op: str) -> None:
    """The torch op's backward is the triton module's (its kernels' torch ops run), not the spec's PyTorch one."""
    args = ln_op_args(op, 5, 48, torch.float32)
    out = triton_call(op, args) if op != "linear_activation" else ops.linear_activation(*args, backend="triton")
    loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
    with OpsSeen() as seen:
        loss.backward()
    assert kernel_op in seen.names, sorted(seen.names)
    assert "aten::native_layer_norm_backward" not in seen.names


def rate_tolerance(p: float, count: int) -> float:
    """5 standard deviations of a binomial proportion (the kept fraction of ``count`` draws)."""
    return 5 * (p * (1 - p) / count) ** 0.5


def strided_rows(rows: int, width: int, dtype, gen) -> torch.Tensor:
    """[rows, width] view with a row stride larger than width (a slice of a wider buffer)."""
    return torch.randn(rows, width + 5, generator=gen).to(dtype)[:, 2: 2 + width]


def assert_accurate_fp64(fast, plain, reference, what):
    """assert_accurate with the reference taken to fp64 (fp32 then at the ~1e-5 rule): fast and plain in the tested
    dtype."""
    assert_accurate(fast, plain, reference.double(), what)


def cpp_linear_inputs(width: int, dtype) -> dict:
    """The cpp linear ops' inputs at K = N = ``width``: a strided x [2, 5, K], weight, bias, residual and LayerNorm
    parameters, seeded by the width."""
    gen = torch.Generator().manual_seed(width)
    x = strided_rows(2 * 5, width, dtype, gen).view(2, 5, width)
    w = (torch.randn(width, width, generator=gen) / math.sqrt(width)).to(dtype)
    b = torch.randn(width, generator=gen).to(dtype)
    residual = torch.randn(2, 5, width, generator=gen).to(dtype)
    ln_w, ln_b = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype), torch.randn(width, generator=gen).to(dtype)
    return {"x": x, "w": w, "b": b, "residual": residual, "ln_w": ln_w, "ln_b": ln_b}


def as_fp64(*tensors) -> list:
    return [None if t is None else t.double() for t in tensors]


CPP_WIDTHS = (1, 7, 130, 383)
CPP_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


# ==================================================================================================== grads
def upcast(args: tuple) -> tuple:
    """Float tensors as float64 leaves (requiring grad as the originals do); the rest as they are."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().double().requires_grad_(a.requires_grad)
        out.append(a)
    return tuple(out)


def run_grads(fn, args: tuple, seed: int = 7) -> tuple[torch.Tensor, ...]:
    """Gradients of sum(output * fixed random weights) with respect to every float input that requires grad."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn(*args)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in out)
    return torch.autograd.grad(loss, leaves)


def check_grads(op: str, args: tuple, backend: str, call=None) -> None:
    """``backend``'s gradients against the eager op's autograd in float64 (the reference) and in the tested
    dtype (plain PyTorch, for the bf16 rule)."""
    def on(name):  # eager: the spec's function itself (the reference's float64 tables pass no dtype check)
        if call is not None:
            return call(name)
        return SPECS[op].eager if name == "eager" else (lambda *a: getattr(ops, op)(*a, backend=name))

    fast = run_grads(on(backend), args)
    plain = run_grads(on("eager"), args)
    reference = run_grads(on("eager"), upcast(args))
    names = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    assert len(fast) == len(names) > 0
    for index, f, p, r in zip(names, fast, plain, reference, strict=True):
        assert_accurate(f, p, r, what=f"{op} {backend} grad of argument {index}")


def attention_call(backend: str):
    """The attention op's function on ``backend`` with the registry's positional arguments (no dtype or device
    check between: float64 reaches eager)."""
    if backend == "eager":
        return SPECS["attention"].eager
    return lambda *a: backends._REGISTRY["attention"][backend].fn(*a)


def torch_op_forward(op: str):
    """The eager computation of the torch op ``fastbert::<op>`` (its schema's arguments and result)."""
    spec = SPECS[op]
    if op == "qkv_projection":
        return lambda x, weight, bias: F.linear(x, weight, bias)
    if op == "qkv_rotary":
        def rotary(x, weight, bias, positions, cos, sin, num_heads):
            q, k, v = spec.eager(x, weight, bias, num_heads, positions, cos, sin)
            return torch.stack((q, k, v), dim=-3).flatten(-3)
        return rotary
    return spec.eager


def torch_op_args(op: str, args: tuple) -> tuple:
    """The functional entry's arguments reordered for the torch op's schema, trailing defaults filled in (as
    torch.library does before it calls an op's setup_context)."""
    if op == "qkv_projection":
        return args[:3]
    if op == "qkv_rotary":
        x, weight, bias, heads, positions, cos, sin = args
        return x, weight, bias, positions, cos, sin, heads
    schema = torch._C.parse_schema(f"fastbert::{op}{SPECS[op].schema}")  # the spec's: whichever backends loaded
    return (*args, *(argument.default_value for argument in schema.arguments[len(args):]))


def spec_function(op: str) -> type[torch.autograd.Function]:
    """An autograd.Function whose forward is the eager op (float64 allowed) and whose backward is the spec's."""
    spec, forward = SPECS[op], torch_op_forward(op)

    class ViaSpec(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return forward(*args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            spec.setup_context(ctx, inputs, output)

        @staticmethod
        def backward(ctx, *grads):
            return spec.backward(ctx, *grads)

    return ViaSpec


def gradcheck_spec(op: str, args: tuple) -> None:
    """gradcheck (float64) of the spec's backward formula against the eager forward, on the torch op's arguments
    made from the functional entry's ``args``."""
    function = spec_function(op)
    args = torch_op_args(op, upcast(args))
    assert torch.autograd.gradcheck(lambda *a: function.apply(*a), args, eps=1e-6, atol=1e-6, rtol=1e-5)


# ==================================================================================== attention, any backend
POISONS = (float("nan"), float("inf"), float("-inf"))


def check_padding_poison(backend: str, dtype: torch.dtype, head_dim: int, seqlen: int = 7, heads: int = 2,
                         device: str | torch.device = "cpu") -> None:
    """NaN, +Inf and -Inf in q, k, v at masked positions (padded form) must not reach a real query's output: real
    rows bit-identical to the run with zeros there and finite; the all-masked row zeros. Batch rows: holes plus
    right padding, right padding only, all masked, a single real key mid-sequence. q, k, v are strided views of
    one [B, S, 3, heads, D] buffer, as qkv_projection returns them."""
    gen = torch.Generator().manual_seed(100 * seqlen + head_dim)
    qkv = torch.randn(4, seqlen, 3, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = torch.ones(4, seqlen, dtype=torch.bool)
    mask[0, [1, seqlen - 4]] = False
    mask[0, -2:] = False
    mask[1, 3:] = False
    mask[2] = False
    mask[3] = False
    mask[3, seqlen // 2] = True
    mask = mask.to(device)
    masked = ~mask[:, :, None, None, None]
    # every element cycles through NaN, +Inf, -Inf, so each masked row mixes all three in q, k and v
    cycle = torch.arange(qkv.numel(), device=device).view(qkv.shape) % len(POISONS)
    poison = torch.tensor(POISONS, dtype=dtype, device=device)[cycle]
    outputs = {}
    for name, fill in (("zeros", torch.zeros_like(qkv)), ("poison", poison)):
        q, k, v = torch.where(masked, fill, qkv).unbind(2)
        outputs[name] = ops.attention(q, k, v, key_padding_mask=mask, backend=backend)
    clean, dirty = outputs["zeros"], outputs["poison"]
    assert torch.isfinite(dirty[mask]).all(), f"{backend}: NaN/Inf at padded positions reached real rows"
    assert torch.equal(dirty[mask], clean[mask]), f"{backend}: padded positions' values changed real rows"
    assert torch.equal(dirty[2], torch.zeros_like(dirty[2])), f"{backend}: an all-masked row must give zeros"


WINDOWS = (0, 1, 2, 7, 16, 128)


def transformers_allowed(window: int, attention_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, S, S]: which key each query may attend in a ModernBERT local layer with local_attention = window,
    from transformers' own mask function (what its sdpa and eager attention apply)."""
    from transformers import ModernBertConfig
    from transformers.masking_utils import create_bidirectional_sliding_window_mask

    config = ModernBertConfig(local_attention=window, hidden_size=8, num_attention_heads=1)
    config._attn_implementation = "sdpa"
    batch, seqlen = attention_mask.shape
    mask = create_bidirectional_sliding_window_mask(config=config, inputs_embeds=torch.zeros(batch, seqlen, 8),
                                                    attention_mask=attention_mask.long(),
                                                    allow_is_bidirectional_skip=False)
    return mask[:, 0]


def probed_allowed(backend: str, window: int | None, seqlen: int, key_padding_mask: torch.Tensor | None = None,
                   lengths: list[int] | None = None, device="cpu") -> torch.Tensor:
    """bool [B, S, S]: the keys each query attends on ``backend``, read off its output: with q = k = 0 every attended
    key gets the same weight, and V = one-hot of the key's position makes output[i, j] = 1 / n_i where i attends j.
    Padded form with ``key_padding_mask``, or packed sequences of ``lengths`` (then [B, max, max], rows and columns
    past a sequence's length False)."""
    head_dim = max(8, -(-seqlen // 8) * 8)  # the triton kernel takes head dims that are multiples of 8
    eye = torch.eye(seqlen, head_dim, device=device)
    if lengths is None:
        batch = key_padding_mask.shape[0] if key_padding_mask is not None else 1
        v = eye.expand(batch, 1, seqlen, head_dim).transpose(1, 2).contiguous()
        out = ops.attention(torch.zeros_like(v), torch.zeros_like(v), v, key_padding_mask=key_padding_mask,
                            window=window, backend=backend)
        return (out[:, :, 0, :seqlen] > 0).cpu()
    v = torch.cat([eye[:n] for n in lengths])[:, None, :]
    out = ops.attention(torch.zeros_like(v), torch.zeros_like(v), v, cu_seqlens=cu_seqlens_of(lengths, device),
                        max_seqlen=seqlen, window=window, backend=backend)
    allowed = torch.zeros(len(lengths), seqlen, seqlen, dtype=torch.bool)
    start = 0
    for b, n in enumerate(lengths):
        allowed[b, :n, :n] = out[start:start + n, 0, :n].cpu() > 0
        start += n
    return allowed


def check_rule_matches_transformers(backend: str, window: int, device="cpu") -> None:
    """Padded (right padding, holes, an all-padding row) and packed (lengths 1, 7, 13) against transformers."""
    seqlen = 13
    mask = torch.ones(4, seqlen, dtype=torch.bool)
    mask[1, 9:] = False
    mask[2, [0, 3, 4, 5, 11]] = False
    mask[3] = False
    ours = probed_allowed(backend, window, seqlen, mask.to(device), device=device)
    assert torch.equal(ours, transformers_allowed(window, mask)), f"{backend} padded window={window}"
    lengths = [1, 7, 13]
    ours = probed_allowed(backend, window, seqlen, lengths=lengths, device=device)
    for b, n in enumerate(lengths):
        expected = transformers_allowed(window, torch.ones(1, n, dtype=torch.bool))[0]
        assert torch.equal(ours[b, :n, :n], expected), f"{backend} packed length {n} window={window}"


def check_against_reference(backend: str, dtype: torch.dtype, window: int | None, lengths: list[int],
                            head_dim: int = 32, heads: int = 2, form: str = "packed", device="cpu",
                            scale: float | None = None) -> torch.Tensor:
    """``backend`` vs plain eager in ``dtype`` vs the fp64 eager reference (fastbert.numerics' rule). q, k, v are the
    strided views of one QKV buffer. packed: sequences of ``lengths``; padded: rows of max(lengths) with the keys
    past each length masked (a 0 length is an all-padding row, whose output must be zeros). Returns the output."""
    gen = torch.Generator().manual_seed(1000 * len(lengths) + 7 * head_dim + (window or 0))
    seqlen = max(lengths)
    if form == "packed":
        qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=gen)
        kwargs = {"cu_seqlens": cu_seqlens_of(lengths, device), "max_seqlen": seqlen}
    else:
        qkv = torch.randn(len(lengths), seqlen, 3, heads, head_dim, generator=gen)
        mask = torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]
        kwargs = {"key_padding_mask": mask.to(device)}
    q, k, v = qkv.to(device=device, dtype=dtype).unbind(-3)
    kwargs.update(scale=scale, window=window)
    fast = ops.attention(q, k, v, backend=backend, **kwargs)
    plain = ops.attention(q, k, v, backend="eager", **kwargs)
    reference = ops.attention(q.double(), k.double(), v.double(), backend="eager", **kwargs)
    assert fast.is_contiguous() and fast.dtype == dtype
    assert_accurate(fast, plain, reference, f"{backend} {form} {lengths} window={window} d{head_dim}")
    if form == "padded":
        for row, length in enumerate(lengths):
            if length == 0:
                assert torch.equal(fast[row], torch.zeros_like(fast[row])), "an all-padding row must give zeros"
    return fast


def check_packed_matches_padded(backend: str, dtype: torch.dtype, window: int, lengths: list[int],
                                head_dim: int = 16, device="cpu") -> None:
    """The same sequences packed and right-padded give the same real rows (to fp32 rounding)."""
    gen = torch.Generator().manual_seed(sum(lengths) + window)
    seqlen = max(lengths)
    padded = torch.randn(len(lengths), seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = (torch.arange(seqlen)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    packed = padded[mask]
    out_padded = ops.attention(*padded.unbind(2), key_padding_mask=mask, window=window, backend=backend)
    out_packed = ops.attention(*packed.unbind(1), cu_seqlens=cu_seqlens_of(lengths, device), max_seqlen=seqlen,
                               window=window, backend=backend)
    torch.testing.assert_close(out_packed, out_padded[mask], rtol=1e-5, atol=1e-6)


def check_wide_window_is_global(backend: str, dtype: torch.dtype, seqlen: int, head_dim: int = 16,
                                device="cpu") -> None:
    """A window reaching every key (window // 2 >= S - 1) gives exactly the global result; one narrower does not."""
    gen = torch.Generator().manual_seed(seqlen)
    q, k, v = torch.randn(2, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype).unbind(2)
    global_out = ops.attention(q, k, v, backend=backend)
    for window in (2 * seqlen - 2, 2 * seqlen - 1, 10 * seqlen, 2 ** 40):
        assert torch.equal(ops.attention(q, k, v, window=window, backend=backend), global_out), f"window={window}"
    if seqlen > 2:
        narrower = ops.attention(q, k, v, window=2 * seqlen - 4, backend=backend)
        assert not torch.equal(narrower, global_out), "a window short of one key must change the first row"


def check_no_key_in_window_gives_zeros(backend: str, dtype: torch.dtype, device="cpu") -> None:
    """Padded form, real keys only at 0..3 and 36..39 of 40: with window 4 (|i - j| <= 2) queries 6..33 see no real
    key and must get zeros; their neighbours near the real keys must not."""
    seqlen, head_dim = 40, 16
    gen = torch.Generator().manual_seed(40)
    q, k, v = torch.randn(1, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype).unbind(2)
    mask = torch.zeros(1, seqlen, dtype=torch.bool)
    mask[0, :4] = True
    mask[0, 36:] = True
    out = ops.attention(q, k, v, key_padding_mask=mask.to(device), window=4, backend=backend)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 6:34], torch.zeros_like(out[0, 6:34]))
    assert out[0, :6].abs().amax(dim=(1, 2)).gt(0).all() and out[0, 34:].abs().amax(dim=(1, 2)).gt(0).all()


def check_window_poison(backend: str, dtype: torch.dtype, window: int, head_dim: int = 16, device="cpu") -> None:
    """NaN, +Inf and -Inf in q, k, v at masked positions (holes and right padding) inside the windows of real queries
    never reach them: real rows finite and bit-identical to the run with zeros there."""
    seqlen = 23
    gen = torch.Generator().manual_seed(window)
    qkv = torch.randn(3, seqlen, 3, 2, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = torch.ones(3, seqlen, dtype=torch.bool)
    mask[0, [2, 5, 6, 11]] = False
    mask[1, 15:] = False
    mask[2, ::2] = False
    mask = mask.to(device)
    masked = ~mask[:, :, None, None, None]
    cycle = torch.arange(qkv.numel(), device=device).view(qkv.shape) % len(POISONS)
    poison = torch.tensor(POISONS, dtype=dtype, device=device)[cycle]
    outputs = [ops.attention(*torch.where(masked, fill, qkv).unbind(2), key_padding_mask=mask, window=window,
                             backend=backend) for fill in (torch.zeros_like(qkv), poison)]
    clean, dirty = outputs
    assert torch.isfinite(dirty[mask]).all(), f"{backend}: NaN/Inf at masked keys reached real rows"
    assert torch.equal(dirty[mask], clean[mask]), f"{backend}: masked keys' values changed real rows"


# ================================================================================================== clients
# Every client test runs one client twice, on an untouched transformers model and on an optimized copy of it, and
# compares what the client returns. `run_both` also counts the encoder forwards the untouched model made and
# asserts that fastbert's encoder ran on every one of them in the optimized run, so a silent fallback to
# transformers' own code (transformers compared with itself) fails the test.

# Short English texts of varied lengths, one of them a single word: padded batches of mixed lengths.
TEXTS = [
    "Hello",
    "The cat sat quietly on the warm windowsill.",
    "How do I reset my password if I no longer have access to my email?",
    "Mount Everest is 8,849 metres high.",
    "Heavy rain is expected across the north of the country this weekend.",
    "Why do leaves change colour in autumn?",
]
PAIRS = [
    {"text": "A man is playing a guitar.", "text_pair": "Someone is making music."},
    {"text": "The weather is lovely today.", "text_pair": "It is raining heavily."},
    {"text": "Hi", "text_pair": "Hello there, how are you doing this fine morning?"},
    {"text": "The bank raised interest rates on Wednesday.", "text_pair": "Rates went up."},
    {"text": "She plays the piano.", "text_pair": "She"},
]
NLI_LABELS = {0: "contradiction", 1: "neutral", 2: "entailment"}
NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}

# How a pipeline is fed: one text per forward, or a list in batches of 4 (padded, mixed lengths).
BATCHING = {"batch1": 1, "batch4": 4}

OTHER_FAMILIES = ("roberta", "distilbert", "albert", "electra", "modernbert")
# The inputs each family's own tokenizer returns (RoBERTa's and DistilBERT's give no token_type_ids).
FAMILY_INPUT_NAMES = {
    "roberta": ["input_ids", "attention_mask"],
    "distilbert": ["input_ids", "attention_mask"],
    "albert": ["input_ids", "token_type_ids", "attention_mask"],
    "electra": ["input_ids", "token_type_ids", "attention_mask"],
    "modernbert": ["input_ids", "attention_mask"],
}


def optimized_copy(reference: torch.nn.Module) -> torch.nn.Module:
    """An optimized deep copy of an untouched model (the reference stays transformers' own code)."""
    import fastbert

    return fastbert.optimize(copy.deepcopy(reference))


def seed_parameters(module: torch.nn.Module, seed: int, gain: float = 1.0, skip: Sequence[torch.Tensor] = ()) -> None:
    """Overwrite a freshly initialised head with seeded values large enough to give well separated scores:
    matrices N(0, gain^2 / fan_in), LayerNorm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    skip_ids = {id(t) for t in skip}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if id(param) in skip_ids:
                continue
            noise = torch.randn(param.shape, generator=gen, dtype=param.dtype)
            if param.dim() >= 2:
                param.copy_(noise * gain / math.sqrt(param.shape[-1]))
            elif "LayerNorm" in name or "layer_norm" in name:
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def quiet_from_pretrained(cls: type, path: str, **kwargs) -> PreTrainedModel:
    """cls.from_pretrained without transformers' load report (the heads are missing from the checkpoint on
    purpose: `seed_parameters` fills them)."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, **kwargs).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)


def minilm_head_model(path: str, cls: type, seed: int, gain: float = 3.0, **config) -> PreTrainedModel:
    """The real MiniLM encoder under a transformers head class whose head weights are seeded."""
    model = quiet_from_pretrained(cls, path, **config)
    encoder = model.base_model
    heads = [m for name, m in model.named_children() if m is not encoder]
    tied = [model.get_input_embeddings().weight]  # an MLM decoder is tied to the word embeddings: keep them
    for index, head in enumerate(heads):
        seed_parameters(head, seed + index, gain=gain, skip=tied)
    return model


def tiny_family_model(family: str, head: str, vocab_size: int) -> PreTrainedModel:
    """A seeded tiny model of `family` that MiniLM's tokenizer can feed (same vocabulary size, pad id 0)."""
    return tiny_model(family, head, vocab_size=vocab_size, pad_token_id=0, max_position_embeddings=64)


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers base (encoder) model inside `model` (a head model or a SentenceTransformer)."""
    from transformers import PreTrainedModel

    bases = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.base_model is m]
    assert len(bases) == 1, f"expected one transformers encoder in {type(model).__name__}, found {len(bases)}"
    return bases[0]


@contextlib.contextmanager
def counting_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the forwards of the encoder of an *untouched* model, however they are called (sentence-transformers
    calls ``auto_model.forward`` directly, which forward hooks do not see): a counting instance attribute over the
    class's forward, removed afterwards."""
    base = base_model(model)
    assert "forward" not in vars(base), "counting_forwards is for untouched models"
    calls: list[int] = []
    original = base.forward

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    base.forward = counted
    try:
        yield calls
    finally:
        del base.forward


def assert_fast_path(seen: dict, forwards: int, ops: Sequence[str] = ARCHITECTURE_OPS["post"]) -> None:
    """fastbert's encoder ran once per encoder forward (its embedding op runs exactly once per forward), with
    every fused op of its layer architecture (``ops``: BERT's by default)."""
    from fastbert.bench.recording import backends_used

    assert forwards > 0, "the client made no encoder forward at all"
    ran = sum(seen.get("embedding_layernorm", {}).values())
    assert ran == forwards, (f"fastbert's encoder ran on {ran} of the {forwards} encoder forwards; the others ran "
                             f"transformers' own code (ops seen: {backends_used(seen)})")
    assert set(seen) == set(ops), f"ops that ran: {backends_used(seen)}"


def run_both(call: Callable[[torch.nn.Module], object], reference: torch.nn.Module, optimized: torch.nn.Module,
             forwards: int | None = None) -> tuple[object, object]:
    """`call(model)` on the untouched model, then on the optimized one; asserts that fastbert took every encoder
    forward of the optimized run (and, given `forwards`, that the client made that many). Returns (expected,
    actual)."""
    from fastbert.bench.recording import record_backends

    with counting_forwards(reference) as calls:
        expected = call(reference)
    if forwards is not None:
        assert len(calls) == forwards, f"the client made {len(calls)} encoder forwards, not {forwards}"
    with record_backends() as seen:
        actual = call(optimized)
    assert_fast_path(seen, len(calls), fused_ops(base_model(reference)))
    return expected, actual


def split_records(records: list[dict], numeric: Sequence[str]) -> tuple[list[dict], list[float]]:
    """Pipeline records (dicts) as (their non-numeric fields, their numeric fields in order), to compare the
    first exactly and the second within tolerance."""
    exact = [{k: v for k, v in r.items() if k not in numeric} for r in records]
    values = [float(r[k]) for r in records for k in numeric]
    return exact, values


def kill_and_resume(command: list[str], output_dir: Path, steps: int, wait_s: float) -> Path:
    """Run ``command`` (a ``python -m fastbert.cli`` training run writing to ``output_dir``) from the repository root,
    SIGKILL it as soon as it has written a checkpoint (waiting at most ``wait_s`` seconds), check that it died
    before step ``steps``, then run it again with ``--resume`` and check that it resumed from that checkpoint, which
    is returned."""
    from fastbert.training.loop import latest_checkpoint

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + wait_s
    while latest_checkpoint(output_dir) is None and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, process.stderr.read().decode()[-2000:]
    process.stderr.close()
    interrupted_at = latest_checkpoint(output_dir)
    assert interrupted_at is not None and interrupted_at.name < f"checkpoint-{steps:07d}"

    resumed = subprocess.run([*command, "--resume"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from {interrupted_at}" in resumed.stderr
    return interrupted_at


def assert_same_final_weights(whole: Path, resumed: Path) -> None:
    """The latest checkpoints of two training runs (``output_dir``) hold exactly the same tensors."""
    from safetensors.torch import load_file

    from fastbert.training.loop import latest_checkpoint

    final_whole = load_file(latest_checkpoint(whole) / "model.safetensors")
    final_resumed = load_file(latest_checkpoint(resumed) / "model.safetensors")
    assert final_whole.keys() == final_resumed.keys()
    for key, tensor in final_whole.items():
        assert torch.equal(tensor, final_resumed[key]), key


def logged_losses(output_dir: Path) -> list[float | None]:
    """The ``loss`` of each record of a training run's metrics.jsonl (None for a record without one)."""
    return [json.loads(line).get("loss") for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# Tokenizer files a tiny checkpoint copies from all-MiniLM-L6-v2 (training tests).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def save_tiny_bert(directory: Path, tokenizer_dir: str, layers: int = 2, hidden: int = 32, seed: int = 0) -> str:
    """A tiny random BERT (2 heads, FFN 2 * hidden, 128 positions) with the tokenizer of ``tokenizer_dir``, saved as
    an HF checkpoint in ``directory``; returns its path."""
    import shutil

    import transformers

    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / name, Path(directory) / name)
    return str(directory)


def save_sharded(model: torch.nn.Module, directory: Path, safe: bool, shards: int = 3) -> None:
    """The checkpoint in ``shards`` files and their index, as save_pretrained(max_shard_size=...) writes them."""
    model.config.save_pretrained(directory)
    state = model.state_dict()
    names = list(state)
    suffix, stem = ("safetensors", "model") if safe else ("bin", "pytorch_model")
    weight_map = {}
    for i in range(shards):
        file = f"{stem}-{i + 1:05d}-of-{shards:05d}.{suffix}"
        part = {name: state[name].clone() for name in names[i::shards]}
        if safe:
            from safetensors.torch import save_file

            save_file(part, directory / file)
        else:
            torch.save(part, directory / file)
        weight_map.update(dict.fromkeys(part, file))
    (directory / f"{stem}.{suffix}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
