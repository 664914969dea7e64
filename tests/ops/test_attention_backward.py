"""The Triton attention backward (kernels/attention.py: LSE recomputed, dq kernel, dk/dv kernel) and the dropout fused
into the forward and backward kernels.

Gradients against the eager op's autograd (fp32 within 1e-5 of an fp64 reference, fp16/bf16 by fastbert.numerics'
rule): packed and padded, lengths 1, 7, 13 and 130, windows, a sequence without keys, NaN stored at masked keys,
packed and padded agreeing. Dropout: the kernel's mask (another RNG than eager's `keep_mask`) is read off its
output (q = k = 0 gives every key the weight 1 / S, V = one-hot of the key's position puts keep / (S (1 - p)) at
output[i, j]), then checked for its keep rate and independence on a large sample and for the 1/(1-p) scale; the
eager op run with that very mask must give the kernel's output and gradients (fails if the backward regenerated
another mask); the same seed repeats, another seed differs, packed and padded draw the same mask; the backward in
uneven GPU-like tiles; a BERT encoder training on triton with attention dropout.
On CPU the kernels run in the Triton interpreter: small shapes with the real block logic, a cheap subset unmarked,
the rest `interpreter`."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from fastbert import backends
from fastbert.numerics import assert_accurate
from tests.helpers import DEVICE, DTYPE_IDS, OP_HEADS, attention_args, check_grads, padded_batch, run_grads, tiny_model

HALF_DTYPES = [pytest.param(d, id=DTYPE_IDS[d]) for d in (torch.float16, torch.bfloat16)]
attention_spec = importlib.import_module("fastbert.ops.attention")  # (fastbert.ops.attention: the function)


@pytest.fixture(autouse=True)
def _triton_loaded():
    """The triton backend registered (it loads lazily), or the reason it did not load as the failure."""
    reason = backends.available()["triton"]
    if reason is not None:
        pytest.fail(reason)


def on_device(args: tuple) -> tuple:
    """The arguments on the test device; float leaves stay leaves (requiring grad as before)."""
    return tuple(a.detach().to(DEVICE).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args)


def call(backend: str):
    """The backend's attention with the torch op's positional arguments (eager: the spec's function, which takes
    float64 for the reference)."""
    return lambda *a: backends._REGISTRY["attention"][backend].fn(*a)


def triton_keep_mask(batch: int, heads: int, seqlen: int, p: float, seed: int) -> torch.Tensor:
    """Bool [batch, heads, seqlen, seqlen]: the triton kernel's dropout mask, read off its output (module docstring),
    after checking that every output element is 0 or exactly the kept value 1 / (S (1 - p)) (the scale). The mask is
    a function of (seed, sequence, head, query, key) only, so it is the one any call with these sizes draws."""
    head_dim = max(8, -(-seqlen // 8) * 8)
    v = torch.eye(seqlen, head_dim, device=DEVICE).expand(batch, heads, seqlen, head_dim).transpose(1, 2).contiguous()
    zeros = torch.zeros_like(v)
    out = call("triton")(zeros, zeros, v, None, None, None, None, None, p, seed)[..., :seqlen]
    scaled = out.double() * seqlen * (1 - p)  # 1 where kept
    assert torch.all((scaled == 0) | ((scaled - 1).abs() <= 1e-6)), "kept values are not 1 / (S (1 - p))"
    return (scaled > 0.5).permute(0, 2, 1, 3).cpu()


def check_grads_with_kernel_mask(monkeypatch, args: tuple, p: float, seed: int) -> None:
    """Output and gradients of the triton op with dropout (p, seed) against the eager op run with the kernel's own
    mask (patched into `fastbert.ops.attention.keep_mask`, which the eager forward and the spec's backward read)."""
    q, cu_seqlens, max_seqlen = args[0], args[3], args[4]
    batch = cu_seqlens.numel() - 1 if cu_seqlens is not None else q.shape[0]
    seqlen = max_seqlen if cu_seqlens is not None else q.shape[1]
    mask = triton_keep_mask(batch, OP_HEADS, seqlen, p, seed)
    assert 0 < mask.double().mean() < 1

    def kernel_mask(shape, p_, seed_, device):
        assert tuple(shape) == tuple(mask.shape) and (p_, seed_) == (p, seed)
        return mask.to(device)

    monkeypatch.setattr(attention_spec, "keep_mask", kernel_mask)
    args = (*on_device(args), p, seed)
    with torch.no_grad():
        fast = call("triton")(*args)
        plain = call("eager")(*args)
        reference = call("eager")(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                    for a in args))
    assert_accurate(fast, plain, reference, what="dropout forward with the kernel's mask")
    check_grads("attention", args, "triton", call=call)


def poisoned(tensor: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """A leaf copy of [B, S, h, D] ``tensor`` with ``value`` at the masked keys."""
    return tensor.detach().masked_fill(~mask[:, :, None, None], value).requires_grad_()


def check_masked_keys_and_empty_rows(window: int | None) -> None:
    """Padded [9, 0, 5]: NaN stored in k and v at masked keys gives the gradients of zeros stored there (finite, zero
    at the masked keys); the sequence without keys gets zero gradients."""
    q, k, v, _, _, mask, _, _ = on_device(attention_args("padded", [9, 0, 5]))
    real_rows = mask[:, :, None, None]

    def grads(k_, v_):  # upstream gradients at real query rows only (padded rows' outputs are unspecified)
        return run_grads(lambda *a: call("triton")(*a, None, None, mask, None, window) * real_rows, (q, k_, v_))

    dirty = grads(poisoned(k, mask, float("nan")), poisoned(v, mask, float("nan")))
    clean = grads(poisoned(k, mask, 0.0), poisoned(v, mask, 0.0))
    for name, d, c in zip("qkv", dirty, clean, strict=True):
        assert torch.isfinite(d).all(), name
        assert torch.equal(d, c), name
        assert torch.all(d[1] == 0), f"d{name} of the sequence without keys"
    assert torch.all(dirty[1][~mask] == 0) and torch.all(dirty[2][~mask] == 0)


# ---------------------------------------------------------------------------------- cheap subset (CI, unmarked)
def loaded_copies() -> list:
    """Every loaded copy of the kernel module. transformers probes for the hub's `kernels` package by importing
    `kernels`: run from the repository root, that imports this repository's kernels/ a second time, and the torch op
    stays bound to whichever copy came first, so a spy must sit in each."""
    importlib.import_module("fastbert.kernels.attention")
    return [sys.modules[n] for n in ("fastbert.kernels.attention", "kernels.attention") if n in sys.modules]


def test_triton_op_carries_the_triton_backward(monkeypatch):
    """The triton op's gradient runs the two Triton backward kernels (not the spec's PyTorch formula), and `supports`
    takes dropout."""
    kernels = importlib.import_module("fastbert.kernels.attention")
    launched = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for module in loaded_copies():
        for name in ("_attention_backward_dq_kernel", "_attention_backward_dkdv_kernel"):
            monkeypatch.setattr(module, name, Spy(name, getattr(module, name)))
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [3, 2]))
    call("triton")(q, k, v, cu, longest, None, None, None).sum().backward()
    assert launched == ["_attention_backward_dq_kernel", "_attention_backward_dkdv_kernel"]
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))
    assert kernels.supports(q, k, v, cu, longest, dropout_p=0.1, dropout_seed=3) is None


def test_packed_grads_fp32_lengths_1_7_13():
    check_grads("attention", on_device(attention_args("packed", [1, 7, 13])), "triton", call=call)


def test_padded_nan_at_masked_keys_and_a_sequence_without_keys_window_3():
    check_masked_keys_and_empty_rows(window=3)


def test_dropout_grads_use_the_forward_mask(monkeypatch):
    check_grads_with_kernel_mask(monkeypatch, attention_args("padded", [7, 3]), p=0.3, seed=11)


def test_dropout_same_seed_repeats_other_seed_differs():
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [7, 5]))
    run = call("triton")
    with torch.no_grad():
        first, again = (run(q, k, v, cu, longest, None, None, None, 0.4, 5) for _ in range(2))
        other = run(q, k, v, cu, longest, None, None, None, 0.4, 6)
        high_word = run(q, k, v, cu, longest, None, None, None, 0.4, 5 + (1 << 32))  # the seed's upper 32 bits count
        without = run(q, k, v, cu, longest, None, None, None)
        nothing_kept = run(q, k, v, cu, longest, None, None, None, 1.0, 5)
    assert torch.equal(first, again)
    for name, different in (("seed 6", other), ("seed 5 + 2**32", high_word), ("no dropout", without)):
        assert (first - different).abs().max() > 0.1, name
    assert torch.equal(nothing_kept, torch.zeros_like(nothing_kept))


# ------------------------------------------------------------------------------------ full grid (interpreter)
@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 3, 16], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("lengths", [[1], [7], [13, 1, 7], [130, 7, 0]], ids=lambda n: "-".join(map(str, n)))
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_grads_fp32(form, lengths, window):
    check_grads("attention", on_device(attention_args(form, lengths, window=window)), "triton", call=call)


@pytest.mark.interpreter
def test_grads_fp32_explicit_scale_and_head_dim_80():
    check_grads("attention", on_device(attention_args("padded", [13, 7], scale=0.3, head_dim=80)), "triton",
                call=call)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 16], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_grads_half_head_dim_64(form, dtype, window):
    check_grads("attention", on_device(attention_args(form, [70, 13, 1], dtype, window=window, head_dim=64)),
                "triton", call=call)


@pytest.mark.interpreter
def test_nan_at_masked_keys_global():
    check_masked_keys_and_empty_rows(window=None)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 2], ids=lambda w: f"w{w}")
def test_packed_sequence_without_tokens_gets_no_gradient_and_no_nan(window):
    args = on_device(attention_args("packed", [6, 0, 2], window=window))
    for g in run_grads(call("triton"), args):
        assert torch.isfinite(g).all()
    check_grads("attention", args, "triton", call=call)


@pytest.mark.interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=lambda p: f"p{p}")
@pytest.mark.parametrize("window", [None, 4], ids=lambda w: f"w{w}")
def test_packed_and_padded_agree(window, dropout_p):
    """The same sequences packed and padded (upstream gradients zero at padded query rows): one output and one set of
    gradients at the real tokens; with dropout too, since both forms index the mask by (sequence, head, query, key)."""
    lengths = [11, 3, 7]
    packed = on_device(attention_args("packed", lengths, window=window))
    padded = on_device(attention_args("padded", lengths, window=window, seed=5))
    mask = padded[5]
    with torch.no_grad():
        for t_packed, t_padded in zip(packed[:3], padded[:3], strict=True):
            t_padded[mask] = t_packed
    upstream = torch.randn(packed[0].shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    spread = torch.zeros(padded[0].shape, device=DEVICE)
    spread[mask] = upstream
    out_packed = call("triton")(*packed, dropout_p, 9)
    out_padded = call("triton")(*padded, dropout_p, 9)
    real = out_padded.detach()[mask]
    assert_accurate(real, real, out_packed.detach(), what="padded vs packed output")
    packed_grads = torch.autograd.grad((out_packed * upstream).sum(), packed[:3])
    padded_grads = torch.autograd.grad((out_padded * spread).sum(), padded[:3])
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert_accurate(b[mask], b[mask], a, what="padded vs packed gradients")


@pytest.mark.interpreter
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_scale_and_independence(p):
    """65,536 draws (4 sequences x 4 heads x 64 x 64): the keep rate within 5 standard deviations of 1 - p, kept
    values scaled by exactly 1/(1-p) (triton_keep_mask checks it), neighbouring keys and queries independent (no
    shared Philox counters), and each (sequence, head) its own mask."""
    keep = triton_keep_mask(4, 4, 64, p, seed=2024).double()
    n = keep.numel()
    sigma = ((1 - p) * p / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma, keep.mean()
    pair_sigma = ((1 - p) ** 2 * (1 - (1 - p) ** 2) / n) ** 0.5
    for name, both in (("keys", keep[..., 1:] * keep[..., :-1]), ("queries", keep[..., 1:, :] * keep[..., :-1, :])):
        assert abs(both.mean().item() - (1 - p) ** 2) < 6 * pair_sigma, name
    slabs = keep.reshape(16, -1)
    differ = (slabs[:, None, :] != slabs[None, :, :]).double().mean(-1)  # fraction of pairs that differ
    off_diagonal = differ[~torch.eye(16, dtype=torch.bool)]
    assert off_diagonal.min() > 2 * p * (1 - p) - 0.05, off_diagonal.min()


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 5], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("form", ["packed", "padded"])
def test_dropout_grads_with_the_kernel_mask(monkeypatch, form, window):
    check_grads_with_kernel_mask(monkeypatch, attention_args(form, [13, 1, 7], window=window), p=0.2, seed=77)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", HALF_DTYPES)
def test_dropout_grads_half_with_the_kernel_mask(monkeypatch, dtype):
    check_grads_with_kernel_mask(monkeypatch, attention_args("packed", [33, 7], dtype, head_dim=64), p=0.1,
                                 seed=3)


@pytest.mark.interpreter
@pytest.mark.parametrize("dropout_p", [0.0, 0.3], ids=lambda p: f"p{p}")
def test_backward_in_gpu_like_uneven_tiles(monkeypatch, dropout_p):
    """The backward kernels with the uneven blocks a GPU takes (dq: 32 queries x 16 keys, dk/dv: 16 queries x 32 keys)
    while the forward walks 64 x 64 tiles: the same gradients as the eager op (with the kernel's mask under dropout),
    a window cutting through tiles, lengths that end mid-tile."""
    def uneven(head_dim, max_seqlen, dtype, heavy=False):
        block_d = max(16, 1 << (head_dim - 1).bit_length())
        return ({"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_D": block_d}, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_D": block_d})

    for module in loaded_copies():
        monkeypatch.setattr(module, "_backward_meta", uneven)
    args = attention_args("packed", [70, 9, 33], window=21)
    if dropout_p == 0:
        check_grads("attention", on_device(args), "triton", call=call)
    else:
        check_grads_with_kernel_mask(monkeypatch, args, p=dropout_p, seed=123)


@pytest.mark.interpreter
def test_dropout_one_keeps_nothing_and_sends_no_gradient():
    args = on_device(attention_args("padded", [7, 3]))
    out = call("triton")(*args, 1.0, 4)
    assert torch.equal(out, torch.zeros_like(out))
    for g in torch.autograd.grad((out * torch.randn_like(out)).sum(), args[:3]):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.interpreter
def test_opcheck_with_dropout_and_grads():
    torch.library.opcheck(torch.ops.fastbert.triton_attention.default,
                          (*on_device(attention_args("packed", [5, 2], window=2)), 0.3, 8))
    torch.library.opcheck(torch.ops.fastbert.triton_attention.default,
                          (*on_device(attention_args("padded", [5, 2])), 0.3, 8))


@pytest.mark.interpreter
def test_opcheck_backward_op():
    q, k, v, cu, longest, _, _, _ = on_device(attention_args("packed", [5, 2]))
    with torch.no_grad():
        out = call("triton")(q, k, v, cu, longest, None, None, None, 0.3, 8)
    grad = torch.randn_like(out)
    args = (grad, *(t.detach() for t in (q, k, v)), out, cu, longest, None, None, 2, 0.3, 8)
    torch.library.opcheck(torch.ops.fastbert.triton_attention_backward.default, args)


@pytest.mark.interpreter
def test_encoder_trains_on_triton_with_attention_dropout(monkeypatch, tmp_path):
    """A BERT encoder in training mode (the config's dropout 0.1) on the triton backend: every op on triton, the
    attention kernel launched with dropout, finite gradients, the same torch seed repeating output and gradients,
    another seed changing them."""
    import fastbert
    from fastbert.bench.recording import record_backends

    thresholds = []
    for module in loaded_copies():
        monkeypatch.setattr(module, "_threshold", lambda p, original=module._threshold: thresholds.append(p) or
                            original(p))
    tiny_model("bert").save_pretrained(tmp_path)
    ids, mask = (t.to(DEVICE) for t in padded_batch(3, 9))
    model = fastbert.from_pretrained(tmp_path, backend="triton", device=DEVICE).train()
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        with record_backends() as seen:
            hidden = model(ids, mask).last_hidden_state
        (hidden * mask[:, :, None]).sum().backward()
        runs.append((hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        model.zero_grad()
        assert {b for counts in seen.values() for b in counts} == {"triton"}, seen
    assert model.config.attention_dropout > 0 and thresholds
    assert all(p == pytest.approx(model.config.attention_dropout) for p in thresholds)
    (first, first_grads), (again, again_grads), (other, _) = runs
    assert torch.equal(first, again) and (first - other).abs().max() > 0.1
    assert len(first_grads) > 10
    for a, b in zip(first_grads, again_grads, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
