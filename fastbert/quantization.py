"""int8 dynamic quantization of fastbert's encoder for CPU inference, and the CPU's precision features.

`quantize_int8(model)` replaces, in every layer of every `FastBertModel` inside ``model`` (post-LN and ModernBERT's
pre-LN), the four GEMMs (packed Q/K/V, attention output, FFN in (GLU's [input | gate] in ModernBERT), FFN out) by
int8 ones: the weights int8 per output channel (symmetric, scale = max |row| / 127), the activations quantized at
run time per token. The GEMM is FBGEMM's int8 linear (uint8 activations x int8 weights -> int32, VNNI on AVX-512
VNNI CPUs; ``torch.ops.quantized``' fp32-in, fp32-out entry with the input scale given), chosen by
``benchmarks/int8_gemm_cpu.py`` (results in ``benchmarks/results/cpu-2core-int8/``). That kernel takes one input
scale per call; fastbert gives each token its own 8-bit grid by mapping each row onto [0, 1] by its own minimum and
range before the call and mapping the result back per row after it (range x G + minimum x the weight's row sums,
then the bias), which is exact algebra (the GEMM is linear per row) and keeps one scale for the whole input -- what
made ONNX Runtime's int8 inaccurate -- out. In post-LN layers the mapping back is fused with what follows each GEMM
(``csrc/int8.cpp``): bias + residual + LayerNorm, or bias + GELU + the next GEMM's row mapping; ModernBERT's layers
fuse it with GEGLU + the next GEMM's row mapping, or with + residual + LayerNorm keeping the sum, and rotate q and k
in place after the QKV GEMM (``csrc/rotary.cpp``). Attention stays in fp32 on the model's own backend; LayerNorm
(fp32 statistics), the activation, embeddings, pooler and task heads stay fp32.

Inference only: a quantized layer raises in training mode or when its input requires grad. CPU only: FBGEMM has no
CUDA kernels, so a model on CUDA is refused. Without AVX-512 VNNI / AVX-VNNI / AMX-INT8, FBGEMM multiplies with
``vpmaddubsw``, whose int16 pair sums saturate for 8-bit activations: there the activations are quantized to 7
bits (FBGEMM's ``reduce_range``), which costs accuracy (checked in ``tests/test_quantization.py``).

`auto_cpu_dtype` chooses the precision of ``dtype="auto"`` on CPU: bfloat16 where the CPU has AMX tiles; where it
has AVX-512 BF16 without AMX, bfloat16 only if its GEMMs measure clearly faster than float32's on this machine
(`bf16_gemm_speedup`: on the one such VM measured, 2026-12-02, they took 1.62x float32's time); float32 elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from fastbert.backends import tuning
from fastbert.cpu import AMX_BF16, INT8_DOT, cpu_flags, native_bf16
from fastbert.model import EVAL, DropoutSeeds, FastBertModel, PostNormLayer, PreNormLayer, attend
from fastbert.ops.linear_activation import apply_activation
from fastbert.ops.padding import VarlenBatch
from fastbert.ops.qkv_rotary import rotate_heads

# The GEMM `bf16_gemm_speedup` times in both dtypes (tokens, in, out): a BERT-base FFN input GEMM at a batch of two
# 128-token sequences, where the GEMMs are most of an encoder's time.
BF16_PROBE = (256, 768, 3072)
# bfloat16 costs accuracy (cosines 0.9999 instead of 1.0): "auto" takes it only where it is this much faster.
BF16_MIN_SPEEDUP = 1.1


def auto_cpu_dtype(flags: tuple[str, ...] | None = None) -> tuple[torch.dtype, str]:
    """(dtype, reason) for ``dtype="auto"`` on CPU: bfloat16 where the CPU has AMX tiles for it; where it has
    AVX-512 BF16 without AMX, bfloat16 only if `bf16_gemm_speedup` measures its GEMMs at least `BF16_MIN_SPEEDUP`
    times as fast as float32's here; else float32. torch's own ``mkldnn._is_mkldnn_bf16_supported()`` is not
    used: it is true on any AVX-512 CPU, where bfloat16 is emulated and slower than float32."""
    flags = cpu_flags() if flags is None else flags
    if AMX_BF16 in flags:
        return torch.bfloat16, f"bfloat16: the CPU has AMX tiles for it ({AMX_BF16})"
    if not native_bf16(flags):
        return torch.float32, "float32: the CPU has no native bfloat16 (neither AMX nor AVX-512 BF16)"
    speedup = bf16_gemm_speedup()
    if speedup is None:
        return torch.float32, ("float32: the CPU has AVX-512 BF16 without AMX, where bfloat16 is often slower, and "
                               "measuring is off (FASTBERT_TUNE=0) so it was not timed")
    tokens, width, out = BF16_PROBE
    measured = f"a {tokens} x {width} -> {out} GEMM took {1 / speedup:.2f}x float32's time in bfloat16"
    if bf16_pays(speedup):
        return torch.bfloat16, f"bfloat16: AVX-512 BF16 without AMX, measured faster here ({measured})"
    return torch.float32, f"float32: AVX-512 BF16 without AMX, bfloat16 not faster here ({measured})"


def bf16_pays(speedup: float) -> bool:
    """Whether bfloat16 GEMMs ``speedup`` times as fast as float32's are worth bfloat16's accuracy."""
    return speedup >= BF16_MIN_SPEEDUP


def bf16_gemm_speedup() -> float | None:
    """float32's time over bfloat16's for the `BF16_PROBE` GEMM (``F.linear``, torch's threads now), measured once
    per machine and thread count and kept in the tuning cache (`fastbert.backends.tuning`: ``fastbert tune --clear``
    forgets it); None when it is not cached and measuring is off (``FASTBERT_TUNE=0``)."""
    cpu = torch.device("cpu")
    tokens, width, out = BF16_PROBE
    shape_class = f"dtype auto: linear {tokens}x{width}->{out} float32 vs bfloat16, {torch.get_num_threads()} threads"
    entry = tuning.entries(cpu).get(shape_class)
    if entry is None or not _timed_both(entry.times_ms):
        if not tuning.enabled() or not tuning.can_measure([]):  # (not while torch.compile or jit traces)
            return None
        generator = torch.Generator().manual_seed(0)
        operands = [torch.randn(*shape, generator=generator) for shape in ((tokens, width), (out, width), (out,))]
        candidates = {str(dtype).removeprefix("torch."): functools.partial(F.linear, *(t.to(dtype) for t in operands))
                      for dtype in (torch.float32, torch.bfloat16)}
        with torch.inference_mode(), torch.autocast("cpu", enabled=False):  # each GEMM in its own dtype
            times, rounds, clock = tuning.measure(candidates, (), {})
        choice = "bfloat16" if bf16_pays(times["float32"] / times["bfloat16"]) else "float32"
        entry = tuning.Entry(choice, {name: round(ms, 4) for name, ms in times.items()}, rounds, clock)
        tuning.record(cpu, shape_class, entry)
    return entry.times_ms["float32"] / entry.times_ms["bfloat16"]


def _timed_both(times_ms: dict) -> bool:
    """Whether a cached entry holds a positive time for each dtype (a file edited by hand may not)."""
    return all(isinstance(times_ms.get(name), (int, float)) and times_ms[name] > 0 for name in ("float32", "bfloat16"))


_ANNOUNCED: set[str] = set()


def announce_once(message: str) -> None:
    """A one-time warning per distinct message (the dtype chosen for "auto" and why)."""
    if message not in _ANNOUNCED:
        _ANNOUNCED.add(message)
        warnings.warn(f"fastbert: {message}", stacklevel=3)


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scale [N]): ``weight`` [N, K] quantized symmetrically per output channel (row),
    ``weight ~= q * scale[:, None]``; an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


def reduce_range(flags: tuple[str, ...] | None = None) -> bool:
    """Whether FBGEMM needs 7-bit activations here: a CPU without int8 dot products into int32 (VNNI, AMX)."""
    flags = cpu_flags() if flags is None else flags
    return not any(flag in flags for flag in INT8_DOT)


def unit_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unit, low, spread): each row of x [T, K] mapped onto [0, 1] by its own minimum ``low`` [T, 1] and range
    ``spread`` [T, 1] (> 0); one C++ pass where the extension has it."""
    if _fused_steps():
        return torch.ops.fastbert.cpp_int8_unit_rows(x)
    low, high = torch.aminmax(x, dim=-1, keepdim=True)
    spread = (high - low).clamp_min_(1e-30)
    return (x - low).mul_(spread.reciprocal()), low, spread  # (as the C++ step: the same int8 levels)


# The C++ steps (``torch.ops.fastbert.<name>``): those every int8 layer uses (row mapping, rescale, the post-LN
# epilogues) and those only ModernBERT's layers add; a build older than a group runs that group as torch ops.
POST_LN_STEPS = ("cpp_int8_unit_rows", "cpp_int8_rescale", "cpp_int8_rescale_layernorm", "cpp_int8_gelu_unit_rows")
PRE_LN_STEPS = ("cpp_int8_rescale_prenorm", "cpp_int8_geglu_unit_rows", "cpp_rotary_qk_")


_STEPS_PRESENT: dict[tuple[str, ...], bool] = {}  # steps -> whether the extension has them (`_fused_steps`)


# torch.compile takes the answer as a constant: traced, the import inside would break the graph at every int8 GEMM.
@torch.compiler.assume_constant_result
def _fused_steps(steps: tuple[str, ...] = POST_LN_STEPS) -> bool:
    """Whether the C++ extension has ``steps`` (``csrc/int8.cpp``, ``csrc/rotary.cpp``); torch ops otherwise.
    Checked once per group."""
    if steps not in _STEPS_PRESENT:
        try:
            importlib.import_module("fastbert.backends.cpp")  # loads fastbert._C after declaring the specs' ops
            _STEPS_PRESENT[steps] = all(hasattr(torch.ops.fastbert, name) for name in steps)
        except Exception:  # noqa: BLE001 - no extension: the same steps in torch ops
            _STEPS_PRESENT[steps] = False
    return _STEPS_PRESENT[steps]


class Int8Linear(nn.Module):
    """y = x @ W^T + b with W int8 per output channel and x int8 per token at run time (FBGEMM's kernel; see the
    module's doc). x: fp32 [T, K] -> fp32 [T, N]. ``reduce_range``: 7-bit activations (CPUs without VNNI)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reduce_range: bool = False):
        super().__init__()
        q, scale = int8_weight(weight)
        with warnings.catch_warnings():  # (torch deprecates quantized tensors; FBGEMM's prepack still takes one)
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(q, scale.double(),
                                                               torch.zeros_like(scale, dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)  # (FBGEMM's packed layout; bias added after)
        self.register_buffer("weight_sum", (q.float() * scale[:, None]).sum(dim=1))  # the quantized W's row sums
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.reduce_range = reduce_range

    def scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(G, low, spread): G = ((x - low) / spread) @ W^T on rows mapped onto [0, 1] by their own minimum
        ``low`` and range ``spread`` (FBGEMM quantizes them with scale 1/255: 8 bits per token), so that
        x @ W^T = spread * G + low * (the quantized W's row sums)."""
        unit, low, spread = unit_rows(x)
        return self.gemm(unit), low, spread

    def gemm(self, unit: torch.Tensor) -> torch.Tensor:
        """``unit`` [T, K] (rows in [0, 1]) @ W^T. The input scale is known (1/255, or 1/127 for 7 bits), which
        spares FBGEMM's dynamic op its min/max pass over the input."""
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            unit, 1.0 / (127.0 if self.reduce_range else 255.0), 0, self.packed)

    def rescaled(self, g: torch.Tensor, low: torch.Tensor, spread: torch.Tensor, with_bias: bool = True):
        """G back to x @ W^T (+ b), in place: spread * G + low * row sums (+ b)."""
        bias = self.bias if with_bias else None
        if _fused_steps():
            return torch.ops.fastbert.cpp_int8_rescale(g, low, spread, self.weight_sum, bias)
        out = g.mul_(spread).add_(low * self.weight_sum)
        return out if bias is None else out.add_(bias)

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """x [T, K] -> x @ W^T (+ b) [T, N]."""
        return self.rescaled(*self.scaled(x), with_bias=with_bias)

    def residual_layernorm(self, g: torch.Tensor, low: torch.Tensor, spread: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor, ln_bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        """LayerNorm(x @ W^T + b + residual) from `scaled`'s (G, low, spread); fp32 statistics; one C++ pass."""
        if _fused_steps() and ln_bias is not None:
            return torch.ops.fastbert.cpp_int8_rescale_layernorm(g, low, spread, self.weight_sum, self.bias,
                                                                 residual, weight, ln_bias, eps)
        summed = self.rescaled(g, low, spread).add_(residual)
        return F.layer_norm(summed, summed.shape[-1:], weight, ln_bias, eps)

    def activation_unit_rows(self, g: torch.Tensor, low: torch.Tensor, spread: torch.Tensor,
                             activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """act(x @ W^T + b) from `scaled`'s (G, low, spread), mapped onto [0, 1] per row for the next int8 GEMM:
        (unit rows, low, spread); GELU in one C++ pass."""
        if _fused_steps() and activation == "gelu":
            return torch.ops.fastbert.cpp_int8_gelu_unit_rows(g, low, spread, self.weight_sum, self.bias)
        return unit_rows(apply_activation(self.rescaled(g, low, spread), activation))

    def residual_prenorm(self, g: torch.Tensor, low: torch.Tensor, spread: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor, ln_bias: torch.Tensor | None,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ W^T + b + residual, LayerNorm of it) from `scaled`'s (G, low, spread): a pre-LN block's end;
        fp32 statistics; one C++ pass."""
        if _fused_steps(PRE_LN_STEPS):
            return torch.ops.fastbert.cpp_int8_rescale_prenorm(g, low, spread, self.weight_sum, self.bias, residual,
                                                               weight, ln_bias, eps)
        summed = self.rescaled(g, low, spread).add_(residual)
        return summed, F.layer_norm(summed, summed.shape[-1:], weight, ln_bias, eps)

    def glu_unit_rows(self, g: torch.Tensor, low: torch.Tensor, spread: torch.Tensor,
                      activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """act(input) * gate of [input | gate] = x @ W^T + b from `scaled`'s (G, low, spread), mapped onto [0, 1]
        per row for the next int8 GEMM: (unit rows, low, spread); GEGLU (erf) in one C++ pass."""
        if _fused_steps(PRE_LN_STEPS) and activation == "gelu":
            return torch.ops.fastbert.cpp_int8_geglu_unit_rows(g, low, spread, self.weight_sum, self.bias)
        projected, gate = self.rescaled(g, low, spread).chunk(2, dim=-1)
        return unit_rows(apply_activation(projected, activation).mul_(gate))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel weights, " \
               f"per-token int8 activations{' (7-bit: no VNNI)' if self.reduce_range else ''}"


def rotate_packed_qk(packed: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_heads: int) -> torch.Tensor:
    """q's and k's heads of packed [T, 3 * heads * D] rotated by RoPE at ``positions`` (cos, sin [P, D/2]), in
    place where the C++ step exists; returns the packed rows."""
    if _fused_steps(PRE_LN_STEPS):
        return torch.ops.fastbert.cpp_rotary_qk_(packed, positions, cos, sin, num_heads)
    heads = packed.view(packed.shape[0], 3, num_heads, -1)
    index = positions.long()
    heads[:, :2] = rotate_heads(heads[:, :2], cos[index][:, None], sin[index][:, None])
    return packed


def check_inference(layer: nn.Module, x: torch.Tensor) -> None:
    """Raise unless an int8 layer's call is inference on float32 activations (its GEMMs have no gradient)."""
    if layer.training or (torch.is_grad_enabled() and x.requires_grad):
        raise RuntimeError("fastbert: an int8-quantized model is for inference only (no training, no gradients): "
                           "call model.eval() and run it under torch.no_grad() or torch.inference_mode(), or train "
                           "the float model")
    if x.dtype != torch.float32:
        raise TypeError(f"fastbert: an int8-quantized layer takes float32 activations, got {x.dtype}")


class Int8PostNormLayer(nn.Module):
    """`PostNormLayer` with its four GEMMs in int8 (`Int8Linear`), for inference; attention through the model's op
    table, LayerNorm (fp32 statistics) and the activation in fp32."""

    DROPOUT_SITES = PostNormLayer.DROPOUT_SITES

    def __init__(self, layer: PostNormLayer, reduce_range: bool = False):
        super().__init__()
        self.num_heads, self.scale, self.activation, self.eps = layer.num_heads, layer.scale, layer.activation, \
            layer.eps
        self.dropout = layer.dropout  # read by `fastbert.optimize`'s dropout sites; unused: inference only
        qkv_weight, qkv_bias = layer.packed_qkv(torch.float32)
        self.qkv = Int8Linear(qkv_weight, qkv_bias, reduce_range)
        self.attn_out = Int8Linear(layer.attn_out_weight, layer.attn_out_bias, reduce_range)
        self.ffn_in = Int8Linear(layer.ffn_in_weight, layer.ffn_in_bias, reduce_range)
        self.ffn_out = Int8Linear(layer.ffn_out_weight, layer.ffn_out_bias, reduce_range)
        for name in ("attn_norm_weight", "attn_norm_bias", "ffn_norm_weight", "ffn_norm_bias"):
            self.register_buffer(name, getattr(layer, name).detach().float().clone())

    def forward(self, x: torch.Tensor, varlen: VarlenBatch, key_padding_mask: torch.Tensor | None, table,
                seeds: DropoutSeeds = EVAL) -> torch.Tensor:
        """As `PostNormLayer.forward` (same arguments), without dropout and without gradients."""
        check_inference(self, x)
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, -1).unbind(1)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, None, (0.0, 0))
        x = self.attn_out.residual_layernorm(*self.attn_out.scaled(context), x, self.attn_norm_weight,
                                             self.attn_norm_bias, self.eps)
        unit, low, spread = self.ffn_in.activation_unit_rows(*self.ffn_in.scaled(x), self.activation)
        return self.ffn_out.residual_layernorm(self.ffn_out.gemm(unit), low, spread, x, self.ffn_norm_weight,
                                               self.ffn_norm_bias, self.eps)


class Int8PreNormLayer(nn.Module):
    """`PreNormLayer` (ModernBERT) with its four GEMMs in int8 (`Int8Linear`), for inference; the rotary
    embedding, attention through the model's op table, the GLU, the residual adds and LayerNorm (fp32 statistics)
    in fp32. Same arguments and results as `PreNormLayer.forward`: the layer ends with the next layer's norm."""

    DROPOUT_SITES = PreNormLayer.DROPOUT_SITES

    def __init__(self, layer: PreNormLayer, reduce_range: bool = False):
        super().__init__()
        for name in ("num_heads", "scale", "activation", "eps", "window", "theta", "dropout"):
            setattr(self, name, getattr(layer, name))  # (dropout: read by `fastbert.optimize`; unused here)
        p = layer._parameters
        self.qkv = Int8Linear(p["qkv_weight"], p["qkv_bias"], reduce_range)
        self.attn_out = Int8Linear(p["attn_out_weight"], p["attn_out_bias"], reduce_range)
        self.ffn_in = Int8Linear(p["ffn_in_weight"], p["ffn_in_bias"], reduce_range)  # rows: [input | gate]
        self.ffn_out = Int8Linear(p["ffn_out_weight"], p["ffn_out_bias"], reduce_range)
        # The norms stay parameters (frozen fp32 copies): the layer before reads this one's attn_norm from
        # ``_parameters`` to end its block with it. The first layer has no attn_norm (`PreNormLayer`).
        for name in ("attn_norm_weight", "attn_norm_bias", "ffn_norm_weight", "ffn_norm_bias"):
            if name in p:
                value = p[name]
                self.register_parameter(name, None if value is None else
                                        nn.Parameter(value.detach().float().clone(), requires_grad=False))

    def forward(self, x: torch.Tensor, normed: torch.Tensor, varlen: VarlenBatch,
                key_padding_mask: torch.Tensor | None, table, positions: torch.Tensor, rotary: dict,
                next_norm_weight: torch.Tensor, next_norm_bias: torch.Tensor | None,
                seeds: DropoutSeeds = EVAL) -> tuple[torch.Tensor, torch.Tensor]:
        """As `PreNormLayer.forward` (same arguments), without dropout and without gradients."""
        check_inference(self, x)
        p = self._parameters
        packed = rotate_packed_qk(self.qkv(normed), positions, *rotary[self.theta], self.num_heads)
        q, k, v = packed.view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        context = attend(table, q, k, v, varlen, key_padding_mask, self.scale, self.window, (0.0, 0))
        x, normed = self.attn_out.residual_prenorm(*self.attn_out.scaled(context), x, p["ffn_norm_weight"],
                                                   p["ffn_norm_bias"], self.eps)
        unit, low, spread = self.ffn_in.glu_unit_rows(*self.ffn_in.scaled(normed), self.activation)
        return self.ffn_out.residual_prenorm(self.ffn_out.gemm(unit), low, spread, x, next_norm_weight,
                                             next_norm_bias, self.eps)


def int8_unavailable(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> str | None:
    """Why int8 inference cannot run here (device, torch build) or from a model in ``dtype`` (it starts from
    float32), or None."""
    if dtype != torch.float32:
        return f"int8 quantization starts from a float32 model, got {dtype}"
    device = torch.device(device)
    if device.type != "cpu":
        return (f"int8 quantization runs on CPU only (FBGEMM's int8 kernels); the model is on {device.type}: use "
                "float16/bfloat16 on a GPU")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return (f"this torch build ({torch.__version__}) has no FBGEMM quantized engine (engines: "
                f"{torch.backends.quantized.supported_engines})")
    return None


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds an int8-quantized layer."""
    return any(isinstance(m, (Int8PostNormLayer, Int8PreNormLayer)) for m in model.modules())


def quantize_int8(model: nn.Module, flags: tuple[str, ...] | None = None, freeze: bool = True) -> nn.Module:
    """Quantize, in place, the GEMMs of every `FastBertModel` inside ``model`` (a fastbert model, task model, or
    the encoder `fastbert.optimize` built) to int8 for CPU inference; returns ``model`` in eval mode with its
    remaining float parameters frozen (``freeze``; `fastbert.optimize` leaves the transformers model's own
    parameters as they are). ``flags``: the CPU's features (default: `cpu_flags`). Raises ValueError for
    a model that is not float32 on CPU."""
    encoders = [m for m in model.modules() if isinstance(m, FastBertModel)]
    if not encoders:
        raise ValueError(f"fastbert: int8 quantization needs a fastbert model; {type(model).__name__} holds none")
    weight = encoders[0].embeddings.word_embeddings
    reason = int8_unavailable(weight.device, weight.dtype)
    if reason is not None:
        raise ValueError(f"fastbert: {reason}")
    narrow = reduce_range(flags)
    for encoder in encoders:
        for index, layer in enumerate(encoder.layers):
            if isinstance(layer, PostNormLayer):
                encoder.layers[index] = Int8PostNormLayer(layer, narrow)
            elif isinstance(layer, PreNormLayer):
                encoder.layers[index] = Int8PreNormLayer(layer, narrow)
    if freeze:
        model.requires_grad_(False)
    return model.eval()


PRECISIONS = ("auto", "float32", "float16", "bfloat16", "int8")


def precision_for(name: str | torch.dtype | None, device: torch.device | str,
                  announce: bool = True) -> tuple[str, str | None]:
    """A requested precision resolved for ``device``: (one of float32, float16, bfloat16, int8; the reason when
    it was chosen for "auto", else None). "auto": on CPU bfloat16 where it is faster than float32, else float32
    (`auto_cpu_dtype`), announced once as a warning (unless ``announce`` is False: the caller says it); on CUDA
    float16. None keeps float32. ValueError for a name outside `PRECISIONS`, or int8 where it cannot run
    (`int8_unavailable`)."""
    if isinstance(name, torch.dtype):
        name = str(name).removeprefix("torch.")
    name = name or "float32"
    if name not in PRECISIONS:
        raise ValueError(f"dtype {name!r} is not supported; use one of {', '.join(PRECISIONS)}")
    if name == "int8":
        reason = int8_unavailable(device)
        if reason is not None:
            raise ValueError(f"dtype int8: {reason}")
    if name != "auto":
        return name, None
    if torch.device(device).type == "cuda":
        return "float16", "float16 on CUDA"
    dtype, reason = auto_cpu_dtype()
    if announce:
        announce_once(f"dtype auto on CPU: {reason}; --dtype / dtype= overrides")
    return str(dtype).removeprefix("torch."), reason
