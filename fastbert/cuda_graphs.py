"""CUDA graphs for inference: the packed encoder replayed per bucket of (tokens, sequences, longest sequence).

Without graphs fastbert is host-bound at small batches on a GPU (each op is a launch from Python). `PackedCudaGraphs`
captures the padding-free encoder once per bucket and replays it; `fastbert.optimize`, ``fastbert.from_pretrained(...,
device="cuda")``, `fastbert embed` and the server attach one to every encoder on CUDA unless ``cuda_graphs=False``.

The bucketed packed forward (what is captured): a batch [B, S] loses its padding as in the normal path (flat
tokens, ``cu_seqlens``), then is laid out in its bucket's static shapes:
- tokens: T real tokens, then pad slots up to the token bucket (`token_buckets`: steps of about 1.25 from 16 to
  ``max_tokens``, multiples of 16). Pad slots hold ``pad_token_id``, position 0 and type 0 (in every table's range);
- sequences: the B real ones, then ``ceil(tokens / chunk)`` filler sequences holding the pad slots in chunks of at
  most ``chunk = min(longest, 64)`` tokens, then empty sequences (the last offset repeated) up to the sequence
  bucket (a power of two). Filler sequences rather than pad slots outside every sequence: the cpp and eager
  attention require ``cu_seqlens[-1] == T``, and a pad slot that belongs to a sequence of its own is computed like
  any token, so it attends only to pad slots;
- ``max_seqlen`` is the bucket's longest allowed sequence (a power of two >= the longest, at most the model's
  limit), so attention's grid is static; its programs past a sequence's end exit at once (kernels/attention.py).
Nothing from a pad slot reaches a real token: embeddings, GEMMs and LayerNorms work row by row and attention within
each sequence (tests/test_cuda_graphs.py puts NaN in the pad slots). Everything inside is free of host syncs; the
bucket is chosen on the host from the mask beforehand (the same reads the normal path makes).

Kept graphs: a least-recently-used dict of at most ``max_graphs``, all captured into one memory pool, so memory stays
flat however many shapes arrive (each graph's scratch is reused by the next capture: replays never overlap, and the
outputs are copied out before the next replay; a new graph is captured before the least recent one is dropped, as
PyTorch requires of a shared pool). Each bucket is captured at its first call, after two warm-up runs
on a side stream (Triton compiles and autotunes outside the capture). A graph reads the parameters where they were
at capture: when a parameter is replaced or moved, the graphs are dropped and the calls run normally until the
same parameters are seen on two calls in a row (so ``torch.func.functional_call``'s temporary tensors never get
captured).

The normal path runs instead (the runner returns None): under autograd (grad mode on) or in training mode, for
``inputs_embeds``, ``position_ids``, ``output_hidden_states``, under torch.compile or jit tracing, on a device other
than CUDA (unless ``capture=False``), past the largest bucket (more tokens, sequences or a longer sequence),
for a batch padded past the model's position limit (left padding would put real tokens past the rotary tables),
and when a row's first position is padding for a model with a pooler or a caller that reads position 0 (the padded
form computes what they read).
``capture=False`` runs the same bucketed forward without capturing, on any device: the CPU tests check it against
the unbucketed model for every family and backend. Capture, replay and the flat memory are checked by the
`gpu`-marked tests of tests/test_cuda_graphs.py only: not yet run on a GPU, and not timed there.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from fastbert.backends import fastbert_encoders, tuning
from fastbert.model import EncoderOutput, FastBertModel, normalize_attention_mask
from fastbert.ops.padding import (
    FILLER_CHUNK,
    VarlenBatch,
    pad_tokens,
    token_buckets,
    unpad_tokens,
    varlen_from_mask,
)

DEFAULT_MAX_TOKENS = 16384
DEFAULT_MAX_SEQUENCES = 4096
DEFAULT_MAX_GRAPHS = 16
SHORTEST_LONGEST = 16  # the smallest attention max_seqlen bucket
_CAPTURE_LOCK = threading.Lock()


def _power_of_two_at_least(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


@dataclass(frozen=True)
class Bucket:
    """A static shape of the packed forward: ``tokens`` slots, ``sequences`` real-sequence slots, attention's
    ``longest`` (its max_seqlen). The pad slots fill sequences of at most ``chunk`` tokens."""

    tokens: int
    sequences: int
    longest: int

    @property
    def chunk(self) -> int:
        return min(self.longest, FILLER_CHUNK)

    @property
    def slots(self) -> int:
        """Sequences attention sees: the real slots and the filler ones (cu_seqlens has one entry more)."""
        return self.sequences + -(-self.tokens // self.chunk)


class Buckets:
    """Which bucket a batch of ``tokens`` real tokens in ``sequences`` sequences, the longest ``longest``, takes.

    tokens: the smallest of ``token_sizes`` that holds them; sequences: the next power of two, at most
    ``max_sequences``; longest: the next power of two (at least 16), capped at the model's ``limit`` and at the
    token bucket. None past any of these."""

    def __init__(self, limit: int, token_sizes: tuple[int, ...] = token_buckets(),
                 max_sequences: int = DEFAULT_MAX_SEQUENCES):
        if limit < 1 or max_sequences < 1 or not token_sizes or list(token_sizes) != sorted(set(token_sizes)):
            raise ValueError("Buckets needs limit >= 1, max_sequences >= 1 and increasing token sizes")
        self.limit, self.token_sizes, self.max_sequences = limit, tuple(token_sizes), max_sequences

    def choose(self, tokens: int, sequences: int, longest: int) -> Bucket | None:
        if tokens < 1 or sequences < 1 or longest > self.limit or sequences > self.max_sequences:
            return None
        index = bisect.bisect_left(self.token_sizes, tokens)
        if index == len(self.token_sizes):
            return None
        size = self.token_sizes[index]
        seqs = min(_power_of_two_at_least(sequences), self.max_sequences)
        return Bucket(size, seqs, min(max(SHORTEST_LONGEST, _power_of_two_at_least(longest)), self.limit, size))


@dataclass
class PackedInputs:
    """One batch in a bucket's static shapes: tokens, positions, types [bucket.tokens] (types None for a model
    without token types), ``cu_seqlens`` int32 [bucket.slots + 1]; the buffers a graph reads."""

    bucket: Bucket
    tokens: torch.Tensor
    positions: torch.Tensor
    types: torch.Tensor | None
    cu_seqlens: torch.Tensor
    filler_steps: torch.Tensor  # chunk, 2 chunk, ... (one per filler sequence), int32 on the device

    @classmethod
    def empty(cls, model: FastBertModel, bucket: Bucket, device: torch.device) -> PackedInputs:
        def ids() -> torch.Tensor:
            return torch.zeros(bucket.tokens, dtype=torch.long, device=device)

        cu = torch.zeros(bucket.slots + 1, dtype=torch.int32, device=device)
        fillers = bucket.slots - bucket.sequences
        steps = torch.arange(1, fillers + 1, dtype=torch.int32, device=device) * bucket.chunk
        return cls(bucket, ids(), ids(), ids() if model.config.type_vocab_size else None, cu, steps)

    def fill(self, model: FastBertModel, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
             varlen: VarlenBatch, pad_token: int | None = None) -> None:
        """Write the batch [B, S] (its padding described by ``varlen``) into the buffers; pad slots get
        ``pad_token`` (default the model's pad id), position 0 and type 0."""
        total, batch, seqlen = varlen.total_tokens, varlen.batch, varlen.seqlen
        positions = model.default_position_ids(input_ids, batch, seqlen, input_ids.device)
        self.tokens[:total].copy_(unpad_tokens(input_ids, varlen))
        self.tokens[total:].fill_(model.config.pad_token_id if pad_token is None else pad_token)
        self.positions[:total].copy_(unpad_tokens(positions, varlen))
        self.positions[total:].zero_()
        if self.types is not None:
            if token_type_ids is None:
                self.types.zero_()
            else:
                self.types[:total].copy_(unpad_tokens(token_type_ids, varlen))
                self.types[total:].zero_()
        self.cu_seqlens[: batch + 1].copy_(varlen.cu_seqlens)
        # After the real batch's B + 1 entries: the filler sequences' ends (chunks of at most ``bucket.chunk`` pad
        # slots, up to ``bucket.tokens``), then the empty sequences' (``bucket.tokens`` repeated); computed on the
        # device, so no host list is copied in per call (a blocking copy from pageable memory)
        fillers = self.filler_steps.numel()
        ends = self.cu_seqlens[batch + 1: batch + 1 + fillers]
        torch.add(self.filler_steps, total, out=ends).clamp_(max=self.bucket.tokens)
        self.cu_seqlens[batch + 1 + fillers:].fill_(self.bucket.tokens)


def encode_packed(model: FastBertModel, inputs: PackedInputs) -> torch.Tensor:
    """The encoder on a bucket's packed inputs, reading no tensor values (what a graph captures): the last hidden
    state [bucket.tokens, H], pad slots included."""
    bucket = inputs.bucket
    varlen = VarlenBatch(None, inputs.cu_seqlens, bucket.longest, bucket.slots, bucket.longest)
    return model.encode_tokens(inputs.tokens, inputs.positions, inputs.types, varlen, None,
                               position_count=bucket.longest)[-1]


def unpack_outputs(model: FastBertModel, hidden: torch.Tensor, varlen: VarlenBatch) -> EncoderOutput:
    """The model's outputs from the packed last hidden state (real tokens first): [B, S, H] with zeros at padded
    positions, and the pooler's output; new tensors (a graph's output buffer is overwritten by its next replay)."""
    real = hidden[: varlen.total_tokens]
    restored = pad_tokens(real, varlen)
    if varlen.indices is None:
        restored = restored.clone()
    return EncoderOutput(restored, model.pool(restored), first_position=restored[:, 0])


def pack_inputs(model: FastBertModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                token_type_ids: torch.Tensor | None, buckets: Buckets,
                pad_token: int | None = None) -> tuple[PackedInputs, VarlenBatch] | None:
    """(packed inputs in new buffers, the real batch's varlen), or None past the largest bucket."""
    batch, seqlen = input_ids.shape
    mask = normalize_attention_mask(attention_mask, batch, seqlen)
    varlen = varlen_from_mask(mask, batch, seqlen, input_ids.device)
    bucket = buckets.choose(varlen.total_tokens, batch, varlen.max_seqlen)
    if bucket is None:
        return None
    inputs = PackedInputs.empty(model, bucket, input_ids.device)
    inputs.fill(model, input_ids, token_type_ids, varlen, pad_token)
    return inputs, varlen


@dataclass
class _Graph:
    """A bucket's static inputs and output, and its graph (None until captured; always None without capture)."""

    inputs: PackedInputs
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None
    keep: object = None  # tensors the graph reads that the model may replace in its caches (rotary tables)


class _ParameterWatch:
    """Whether a model's parameters are those a set of graphs read: same tensors, same storage. The adopted set is
    held (a live object's id is unique); a candidate only by weak reference."""

    def __init__(self, model: FastBertModel):
        self.slots = [(m._parameters, name) for m in model.modules() for name, p in m._parameters.items()
                      if p is not None]
        self.dicts, self.names = [d for d, _ in self.slots], [name for _, name in self.slots]  # for C-level maps
        self.held: list[torch.Tensor] = self.current()
        self.state = self._state(self.held)
        self.candidate: tuple[list[weakref.ref], tuple] | None = None

    def current(self) -> list[torch.Tensor]:
        return list(map(dict.get, self.dicts, self.names))

    @staticmethod
    def _state(params: list[torch.Tensor]) -> tuple:
        return tuple(map(id, params)), tuple(map(torch.Tensor.data_ptr, params))

    def check(self) -> tuple[bool, bool]:
        """(unchanged, adopted now): a changed set is adopted when the same one is seen on two calls in a row."""
        params = self.current()
        state = self._state(params)
        if state == self.state:
            return True, False
        seen = self.candidate
        if seen is not None and seen[1] == state and all(ref() is not None for ref in seen[0]):
            self.held, self.state, self.candidate = params, state, None
            return False, True
        self.candidate = ([weakref.ref(p) for p in params], state)
        return False, False


class PackedCudaGraphs:
    """Replays the packed encoder of ``model`` from CUDA graphs, one per `Bucket`, for inference calls.

    ``run(...)`` takes the model's forward arguments and returns its `EncoderOutput`, or None when the call must
    run the normal path (see the module docstring); a model with one attached (``model.cuda_graphs``, `enable`)
    asks it first. Calling the runner itself runs the normal path in that case. max_tokens, max_sequences: the
    largest bucket; max_graphs: graphs kept (least recently used dropped); capture=False: the bucketed forward
    without graphs, on any device (tests). ``captures`` and ``replays`` count what it did."""

    def __init__(self, model: FastBertModel, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_sequences: int = DEFAULT_MAX_SEQUENCES, max_graphs: int = DEFAULT_MAX_GRAPHS,
                 capture: bool = True):
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        cfg = model.config
        self.model = model
        self.settings = {"max_tokens": max_tokens, "max_sequences": max_sequences, "max_graphs": max_graphs,
                         "capture": capture, "limit": cfg.token_positions}
        self._reset()

    def _reset(self) -> None:
        """Empty state from ``self.settings`` (the model may be half-built here: a copy in progress)."""
        settings = self.settings
        self.buckets = Buckets(settings["limit"], token_buckets(settings["max_tokens"]), settings["max_sequences"])
        self.max_graphs, self.capture = settings["max_graphs"], settings["capture"]
        self.graphs: OrderedDict[Bucket, _Graph] = OrderedDict()
        self.pool = self.side = None
        self.lock = threading.Lock()
        self.watch: _ParameterWatch | None = None  # made at the first call
        self.failed: str | None = None  # why a capture failed: the runner is off
        self.captures = self.replays = 0

    def __getstate__(self) -> dict:  # copies and pickles carry the settings, never graphs
        return {"model": self.model, "settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.model, self.settings = state["model"], state["settings"]
        self._reset()

    def decline_reason(self, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                       output_hidden_states: bool = False) -> str | None:
        """Why a call runs the normal path whatever its shape; None when a bucket may take it."""
        if self.failed:
            return self.failed
        if input_ids is None or inputs_embeds is not None:
            return "inputs_embeds"
        if output_hidden_states or position_ids is not None:
            return "output_hidden_states" if output_hidden_states else "position_ids"
        if self.model.training or torch.is_grad_enabled():
            return "training mode" if self.model.training else "autograd (grad mode on)"
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return "torch.compile or jit tracing"
        if self.capture and input_ids.device.type != "cuda":
            return f"inputs on {input_ids.device.type}, not CUDA"
        if input_ids.dim() != 2 or input_ids.numel() == 0 or input_ids.dtype not in (torch.int64, torch.int32):
            return "input_ids that are not a non-empty integer [batch, seq] tensor"
        if token_type_ids is not None and (token_type_ids.shape != input_ids.shape
                                           or not self.model.config.type_vocab_size):
            return "token_type_ids not shaped like input_ids"
        return None

    def run(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
            token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            inputs_embeds: torch.Tensor | None = None, output_hidden_states: bool = False,
            reads_first_position: bool = False) -> EncoderOutput | None:
        """The model's output for this call from its bucket's graph, or None: run the normal path."""
        if self.decline_reason(input_ids, token_type_ids, position_ids, inputs_embeds, output_hidden_states):
            return None
        model = self.model
        batch, seqlen = input_ids.shape
        if seqlen > self.buckets.limit:  # left padding can put real tokens' positions past every bucket's tables
            return None
        mask = normalize_attention_mask(attention_mask, batch, seqlen)
        varlen = varlen_from_mask(mask, batch, seqlen, input_ids.device)
        if varlen.first_padded and (model.pooler is not None or reads_first_position):
            return None  # position 0, padding in some row, is read: the padded form computes it
        bucket = self.buckets.choose(varlen.total_tokens, batch, varlen.max_seqlen)
        if bucket is None:
            return None
        if model.validate_inputs:
            positions = model.default_position_ids(input_ids, batch, seqlen, input_ids.device)
            model.validate_ids(input_ids, positions, token_type_ids)
        # the model's device made current: streams, the capture and Triton's launches follow the current device
        cuda = input_ids.device.type == "cuda"
        on_device = torch.cuda.device(input_ids.device) if cuda else contextlib.nullcontext()
        # inference_mode off: the buffers are usable in and out of inference mode
        with self.lock, on_device, torch.inference_mode(False), torch.no_grad():
            if self.watch is None:
                self.watch = _ParameterWatch(model)
            unchanged, adopted = self.watch.check()
            if adopted:  # the graphs read the parameters' old storage
                self._drop_all()
            elif not unchanged:
                return None
            entry = self._entry(bucket, input_ids.device)
            entry.inputs.fill(model, input_ids, token_type_ids, varlen)
            if not self._replay(entry):
                return None
            while len(self.graphs) > self.max_graphs:  # after the capture: see `_drop_all`
                self.graphs.popitem(last=False)  # its graph and buffers are freed; its pool memory is reused
            return unpack_outputs(model, entry.hidden, varlen)

    def _entry(self, bucket: Bucket, device: torch.device) -> _Graph:
        """The bucket's graph entry, made the most recently used (created if new)."""
        entry = self.graphs.pop(bucket, None)
        if entry is None:
            entry = _Graph(PackedInputs.empty(self.model, bucket, device))
        self.graphs[bucket] = entry
        return entry

    def _drop_all(self) -> None:
        """Free every graph, and take a new pool for the next capture: PyTorch does not let a capture share a pool
        whose graphs are all gone (the reason a new graph is captured before the least recent one is dropped). The
        old pool's memory goes back to the device only through the allocator's cache: emptied here (a rare event)."""
        self.graphs.clear()
        self.side = None  # the model may have moved to another GPU: a new stream on the device it is on now
        if self.pool is not None:
            self.pool = None
            torch.cuda.empty_cache()

    def _replay(self, entry: _Graph) -> bool:
        """Run the entry's forward (capturing it first); False when the capture failed (the runner then stays off:
        an op of the model's backends that cannot be captured, a warning says which)."""
        if not self.capture:
            entry.hidden = encode_packed(self.model, entry.inputs)
            self.replays += 1
            return True
        if entry.graph is None:
            try:
                self._capture(entry)
            except RuntimeError as err:
                self.failed = f"a CUDA graph capture failed ({str(err).splitlines()[0][:200]})"
                self._drop_all()
                warnings.warn(f"fastbert: {self.failed}; running without CUDA graphs", stacklevel=4)
                return False
        entry.graph.replay()
        self.replays += 1
        return True

    def _capture(self, entry: _Graph) -> None:
        """Capture the entry's forward (its inputs already hold a batch): two warm-up runs on a side stream first
        (compiling and autotuning happen there), then the capture into the shared pool. One runner at a time in the
        process, warm-ups included: measuring synchronizes the device, which is not allowed while another thread
        captures on it."""
        if self.side is None:  # one stream: the allocator reuses the warm-ups' blocks on it
            self.side = torch.cuda.Stream()
        side = self.side
        # for_replay: `auto` chooses these calls' backends by GPU time alone (a replay pays no host time), in shape
        # classes of their own, resolved in the warm-ups and looked up again by the capture
        with _CAPTURE_LOCK, tuning.for_replay():
            side.wait_stream(torch.cuda.current_stream())
            try:
                with torch.cuda.stream(side):
                    for _ in range(2):
                        encode_packed(self.model, entry.inputs)
            finally:  # the inputs are freed on a failure: nothing may still read them on the side stream
                torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (a data loader copying the next batch) do not break the
            # capture
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                entry.hidden = encode_packed(self.model, entry.inputs)
        entry.graph = graph
        entry.keep = dict(self.model.__dict__.get("_rotary", {}))  # the tables it reads outlive a replacement
        self.captures += 1

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None) -> EncoderOutput:
        """Like ``model(input_ids, attention_mask, token_type_ids)`` in inference mode."""
        out = self.run(input_ids, attention_mask, token_type_ids)
        if out is None:
            out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return out


def enable(model: torch.nn.Module, **options) -> torch.nn.Module:
    """Attach a `PackedCudaGraphs` (with ``options``) to every fastbert encoder in ``model``; returns ``model``."""
    for module in model.modules():
        if isinstance(module, FastBertModel):
            module.cuda_graphs = PackedCudaGraphs(module, **options)
    return model


def disable(model: torch.nn.Module) -> torch.nn.Module:
    """Detach the graphs of every fastbert encoder in ``model`` (freeing them); returns ``model``."""
    for module in model.modules():
        if isinstance(module, FastBertModel):
            module.__dict__.pop("cuda_graphs", None)
    return model


def stats(model: torch.nn.Module) -> list[dict]:
    """What the graph runner of each fastbert encoder in ``model`` did: captures, replays, the kept buckets
    (tokens, sequences, longest) and why capturing failed (None: it did not); empty without runners."""
    found = []
    for name, encoder in fastbert_encoders(model):
        runner = encoder.__dict__.get("cuda_graphs")
        if runner is not None:
            with runner.lock:
                found.append({"encoder": name, "captures": runner.captures, "replays": runner.replays,
                              "failed": runner.failed, "capture": runner.capture,
                              "buckets": [[b.tokens, b.sequences, b.longest] for b in runner.graphs]})
    return found


def enable_on_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """`enable` when ``model``'s parameters are on CUDA; nothing otherwise (CPU inference has no graphs)."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        enable(model)
    return model
