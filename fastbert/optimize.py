"""`fastbert.optimize`: swap the encoder computation of a live transformers model for fastbert's, in place.

The model keeps its class, heads, forward signature (``inspect.signature`` reads the original), output types and
state_dict keys. fastbert's encoder shares the transformers parameters (no copy), except Q, K and V: each layer's
are packed into a [3H, H] weight (and [3H] bias) of fastbert's own (`_Pack`; 3·H²+3·H extra elements per layer),
so that no two of the model's parameters share storage (savers that keep one name per storage would drop some).
The copy is refreshed in place before a no-grad call when a source changed in place (its version counter moved,
or an optimizer step ran: fused optimizers move no counter); under autograd the layers read the sources.

A head call whose loss reads padded positions (token labels there that are not -100, question answering's span
positions on a padded batch) runs the padded form, which computes them as transformers does (`_padded_loss_hook`).

fastbert's state belongs to the model it optimizes: it travels with ``copy.deepcopy``, pickle / ``torch.save`` /
multiprocessing, and is rebuilt on the next call whenever a mapped tensor changed identity, storage, dtype or
device (``.to()``, ``.half()``, ``load_state_dict(assign=True)``, a replaced parameter or module,
``resize_token_embeddings``). The check costs a few dictionary look-ups per mapped tensor, never a comparison of
values. Where fastbert cannot run the model as it now is (e.g. quantized Linear modules), or cannot run a given
call, transformers' own code runs that call, with a one-time warning that says why; never stale numbers.

A call takes fastbert's path when every argument is one fastbert handles (ids, masks, position ids,
``inputs_embeds``, ``output_hidden_states`` (a flag, or transformers 5's layer indices), ``return_dict``) or holds
a value that asks for nothing extra
(``None``, ``output_attentions=False``, ``use_cache=False``, loss-only keywords such as ``num_items_in_batch``).
``fastbert.explain(model, **call_kwargs)`` says which path a call takes and why.

Training: fastbert's path also runs in training mode and under autograd (fine-tuning with the HF Trainer or a plain
PyTorch loop), with dropout where transformers' modules apply it and at the p each of them holds at call time (an
nn.Dropout's ``p`` and mode, as TRL's ``disable_dropout_in_model`` sets them: not the config, which the modules
read once when they were built; `fastbert.families.Family.dropout_sites`), and gradients reaching the
model's own parameters (the packed Q/K/V is concatenated from them under autograd). What it cannot train falls
back with the reason in a warning: gradient checkpointing.

PEFT LoRA: a Linear wrapped by PEFT's LoRA layer is read through its ``base_layer``, and its active adapter runs
inside fastbert's ops (`fastbert.ops.low_rank`): the layer's parameter holds the merged weight (a `_Pack` of
fastbert's own, refreshed like Q/K/V) for inference, and under autograd the layer runs the frozen weight plus the
update. What PEFT's forward reads beside the modules (active adapter, disabled, merged, scaling) is watched: a
change rebuilds. Several active adapters, DoRA and other variants fall back with the reason.

Under ``torch.autocast`` (mixed-precision training: the Trainer's fp16/bf16) the encoder runs in the autocast
dtype: the parameters are cast for the call (differentiably, so the fp32 master weights get the gradients) and the
hidden states come back in the parameters' dtype, as transformers' LayerNorm outputs do under autocast (the pooler's
output in the autocast dtype, as transformers' Linear gives it).

Under ``torch.compile`` the model is checked when a graph is traced (call the model once outside the compiled
wrapper, or compile again, after replacing parameters); under ``torch.jit.trace`` the padded form runs, so the
graph is right for any padding of the traced shape.
"""

from __future__ import annotations

import functools
import inspect
import operator
import threading
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch import nn

from fastbert import backends, families
from fastbert.config import FastBertConfig
from fastbert.cuda_graphs import enable_on_cuda
from fastbert.loading import encoder_key_map
from fastbert.model import FastBertModel
from fastbert.ops.low_rank import AdaptedLinear, AdapterGroup, LowRankAdapter
from fastbert.ops.padding import first_position_padded, first_token_beyond
from fastbert.quantization import int8_unavailable, quantize_int8

ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
OUTPUT_OPTIONS = ("output_hidden_states", "return_dict")
# Keywords that the head's loss consumes and the encoder ignores (transformers' TransformersKwargs).
LOSS_ONLY = frozenset({"num_items_in_batch"})
# Flags whose False asks for nothing extra; True asks for something fastbert does not compute.
OFF_FLAGS = frozenset({"output_attentions", "use_cache", "output_router_logits", "is_causal"})
# The transformers module type each kind of mapped tensor must live in: a subclass (bitsandbytes) or a replacement
# (quantized Linear) may compute something else, so it is not taken (PEFT's plain LoRA Linear is read through it).
_OWNER_TYPES = {"embedding": nn.Embedding, "norm": nn.LayerNorm, "linear": nn.Linear}
# PEFT adapters wrap the Linear they adapt: fastbert runs plain LoRA (`peft.tuners.lora.layer.Linear`) inside its
# ops; other adapter types merged into the weight (merge_and_unload()) run at fastbert's speed too.
PEFT_HINT = (" (a PEFT adapter fastbert does not run: fastbert runs plain LoRA on nn.Linear layers; merge this one "
             "with merge_and_unload() for fastbert's speed)")
_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")
# fastbert's parameters whose linear may carry LoRA adapters, by the role `PostNormLayer.low_rank` names.
_ADAPTED_ROLES = {"qkv_weight": "qkv", "attn_out_weight": "attn_out", "ffn_in_weight": "ffn_in",
                  "ffn_out_weight": "ffn_out"}
_OUTPUT_CLASSES: dict[type, type] = {}
_SIGNATURES: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_TRANSFORMERS_CAPTURE = "transformers.utils.output_capturing"
_LIBRARIES = ("transformers.", "torch.", "peft.")  # whose modules' code fastbert's encoder reproduces


def _owner_kind(ours: str) -> str:
    """What module holds the transformers tensor mapped onto fastbert's parameter ``ours``."""
    if ours.startswith("embeddings.") and ours.endswith("_embeddings"):
        return "embedding"
    return "norm" if "norm_" in ours else "linear"


def _output_class(base: nn.Module) -> type:
    """The ModelOutput class the original forward returns (annotations are not reliable: run it on one token)."""
    cls = _OUTPUT_CLASSES.get(type(base))
    if cls is None:
        param = next(base.parameters())
        token = torch.full((1, 1), int(getattr(base.config, "pad_token_id", 0) or 0), device=param.device)
        with torch.inference_mode():
            cls = _OUTPUT_CLASSES[type(base)] = type(type(base).forward(base, input_ids=token, return_dict=True))
    return cls


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a tensor"
    text = repr(value)
    return text if len(text) <= 40 else type(value).__name__


@dataclass
class _Build:
    """fastbert's encoder over a model's tensors as they were when it was built, and how to tell it is stale."""

    fast: FastBertModel | None
    unsupported: str | None  # why fastbert cannot run the model as it is (transformers' code runs), else None
    # (dict, key, object) per link from the base model down to every mapped tensor: a replaced module or
    # parameter anywhere on the way changes one of them.
    links: list[tuple[dict, str, object]] = field(default_factory=list)
    # Mapped tensors and their storage at build time: .to()/.half()/`param.data = ...` change the pointer.
    tensors: list[torch.Tensor] = field(default_factory=list)
    pointers: tuple[int, ...] = ()
    submodules: list[nn.Module] = field(default_factory=list)
    output_class: type | None = None
    # Encoder inputs the forward names: one it does not (DistilBERT's token_type_ids) lands in its **kwargs and
    # is ignored by transformers, so fastbert ignores it too.
    inputs: tuple[str, ...] = ENCODER_INPUTS
    # (object, attribute, value) that transformers' modules read at run time and fastbert copied at build time
    # (LayerNorm eps, heads, attention scaling, RoBERTa's padding index, ALBERT's layer count): an edit rebuilds.
    watched: list[tuple[object, str, object]] = field(default_factory=list)
    # Each dropout site's p, read from transformers' modules on every call (not watched: a change needs no rebuild).
    dropout: _DropoutSites | None = None
    # fastbert's tensors that concatenate several of the model's (Q, K, V), in storage of their own.
    packs: list[_Pack] = field(default_factory=list)
    # dtype="int8": `_coarse_stamps` of the mapped tensors when their int8 copies were made (`_quantize`); an
    # in-place change since (load_state_dict, an edit under no_grad) rebuilds. None: not int8, or inference tensors.
    quantized_stamps: tuple[int, ...] | None = None
    quantized_sources: tuple[int, ...] | None = None  # `_stamps` then: what a step of another model's optimizer keeps

    def __post_init__(self) -> None:
        # Flat columns for C-level loops: this check runs on every call (about 20 us for 12 layers; reading the
        # version counters of an int8 build adds about as much again).
        self.containers = [container for container, _, _ in self.links]
        self.keys = [key for _, key, _ in self.links]
        self.objects = [obj for _, _, obj in self.links]
        # what torch.export leaves in place: modules, and the absent ones (a layer appended, a pooler set later)
        self.module_links = [link for link in self.links if not isinstance(link[2], torch.Tensor)]
        self.types = tuple(map(type, self.submodules))  # a class swapped in (`module.__class__ = ...`) rebuilds
        self.hook_dicts = [d for m in self.submodules
                           for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)]
        self.module_dicts = [m.__dict__ for m in self.submodules]
        self.watched_objects = [obj for obj, _, _ in self.watched]
        self.watched_names = [name for _, name, _ in self.watched]
        self.watched_values = tuple(value for _, _, value in self.watched)
        self.pack_sources = [source for pack in self.packs for source in pack.sources]
        # Inference tensors have no version counter: their packs are compared with them on every call that reads
        # them (and copied where they differ).
        self.untracked = any(source.is_inference() for source in self.pack_sources)
        self.pack_stamps = None if self.untracked else _coarse_stamps(self.pack_sources)

    def reshaped(self, tensors: bool = True) -> bool:
        """Whether a module (with ``tensors``: a parameter or buffer) was replaced, a class swapped or a watched
        attribute (eps, dropout p, heads) changed: what `stale` checks without reading tensors. torch.export swaps
        fake tensors into the parameter dicts while it traces: it checks modules only (``tensors`` False)."""
        if tensors and not all(map(operator.is_, map(dict.get, self.containers, self.keys), self.objects)):
            return True
        if not tensors and any(dict.get(*link[:2]) is not link[2] for link in self.module_links):
            return True
        if tuple(map(type, self.submodules)) != self.types:
            return True
        return tuple(map(getattr, self.watched_objects, self.watched_names)) != self.watched_values

    def sync_packs(self) -> None:
        """Copy the model's Q/K/V into the packed tensors again where one changed in place since: an optimizer
        step ran (`fastbert.backends.optimizer_steps`: fused optimizers move no version counter) or a source's
        version counter moved (``load_state_dict``, ``torch.no_grad(): p.mul_(...)``). A replaced
        tensor or storage (``param.data = ...``, ``.to()``) rebuilds instead (`stale`). One C-level pass over the
        sources' counters when nothing changed: a step of any optimizer has each pack compare its own sources'
        steps (a teacher's packs stay when only its student's optimizer stepped)."""
        if self.untracked:
            for pack in self.packs:
                pack.refresh_if_different()
            return
        stamps = _coarse_stamps(self.pack_sources)
        if stamps != self.pack_stamps:
            for pack in self.packs:
                pack.refresh_if_changed()
            self.pack_stamps = stamps

    def stale(self) -> bool:
        if self.reshaped():
            return True
        if self.quantized_stamps is not None and _coarse_stamps(self.tensors) != self.quantized_stamps:
            if _stamps(self.tensors) != self.quantized_sources:
                return True
            self.quantized_stamps = _coarse_stamps(self.tensors)  # another model's optimizer stepped: not stale
        return tuple(map(torch.Tensor.data_ptr, self.tensors)) != self.pointers


_TRAINING = operator.attrgetter("training")
_VERSION = operator.attrgetter("_version")


def _coarse_stamps(tensors: list[nn.Parameter]) -> tuple[int, ...]:
    """The steps of every optimizer, then the tensors' version counters: what moves when one of many tensors may
    have changed in place (a step of any optimizer counts as one; cheaper than `_stamps` per tensor)."""
    return backends.all_optimizer_steps(), *map(_VERSION, tensors)


def _stamps(sources: list[nn.Parameter] | tuple[nn.Parameter, ...]) -> tuple[int, ...]:
    """The optimizer steps that updated each source (fused optimizers move no version counter), then their version
    counters: what moves when a source may have changed in place."""
    return *backends.optimizer_steps(sources), *map(_VERSION, sources)


class _Pack:
    """One tensor of fastbert's encoder that concatenates several of the model's along dim 0 (a layer's Q, K and V
    weights, or biases), in storage of its own: were the model's parameters views of it, savers that keep one name
    per storage (accelerate, safetensors, transformers' tied-weight checks) would drop or refuse them. It costs
    one extra copy of the packed tensors (3 H^2 + 3 H per layer) and is kept in step with the sources in place
    (`refresh`), so that what reads it (the onednn backend's repacked weights, CUDA graphs) sees the change."""

    def __init__(self, rows: tuple[nn.Parameter, ...], adapters: AdapterGroup | None = None):
        self.rows = rows
        self.adapters = adapters  # LoRA adapters of the rows: the pack holds the merged weight (`AdapterGroup`)
        extra = () if adapters is None else tuple(t for a in adapters.present for t in (a.down, a.up))
        self.sources = rows + extra  # everything the pack is computed from
        self.tensor = nn.Parameter(self.compute(), requires_grad=False)
        self.versions = self.source_versions()

    def compute(self) -> torch.Tensor:
        packed = torch.cat([row.detach() for row in self.rows])
        return packed if self.adapters is None else self.adapters.merged(packed)

    def source_versions(self) -> tuple[int, ...] | None:
        """`_stamps` of the sources (None: inference tensors have no version counter)."""
        if any(source.is_inference() for source in self.sources):
            return None
        return _stamps(self.sources)

    def refresh_if_changed(self) -> None:
        if self.source_versions() != self.versions:
            self.refresh()

    def refresh_if_different(self) -> None:
        """For sources without version counters (inference tensors): compare, and copy only where they differ (a
        copy moves the packed tensor's counter, and the onednn backend would pack it again)."""
        if self.adapters is not None:
            if not torch.equal(self.tensor, self.compute()):
                self.refresh()
            return
        offset = 0
        for source in self.rows:
            rows = source.shape[0]
            if not torch.equal(self.tensor[offset:offset + rows], source):
                self.refresh()
                return
            offset += rows

    def refresh(self) -> None:
        """Compute the pack from its sources again, in place (this moves the packed tensor's own version
        counter)."""
        with torch.inference_mode(False), torch.no_grad():
            if self.adapters is None:
                torch.cat([source.detach() for source in self.rows], out=self.tensor)
            else:
                self.tensor.copy_(self.compute())
        self.versions = self.source_versions()

_P = operator.attrgetter("p")


class _DropoutSites:
    """The dropout probabilities of fastbert's encoder as transformers' modules hold them at call time: per site,
    the module whose training mode switches it on and the getter of its p (`Family.dropout_sites`). `apply`
    writes them into the encoder (``Embeddings.dropout`` and the layers' ``dropout`` tuples) and sets the encoder's
    mode: training while any site drops."""

    def __init__(self, fast: FastBertModel, sites: list[tuple[nn.Module, nn.Module | None, Callable | None]]):
        # sites: (fastbert module, owner, getter) in the order of the embeddings' then each layer's sites; a site
        # without an owner never drops
        self.owners = [owner for _, owner, _ in sites if owner is not None]
        self.getters = [get for _, owner, get in sites if owner is not None]
        self.positions = [i for i, (_, owner, _) in enumerate(sites) if owner is not None]
        self.count = len(sites)
        self.embeddings = fast.embeddings
        self.layers = [(layer, 1 + i * len(layer.dropout), 1 + (i + 1) * len(layer.dropout))
                       for i, layer in enumerate(fast.layers)]
        self.applied: tuple[float, ...] | None = None

    def values(self) -> tuple[float, ...]:
        """Every site's p now (0 where its module is in eval mode or absent)."""
        if not any(map(_TRAINING, self.owners)):  # eval: one C-level pass, nothing else read
            return (0.0,) * self.count
        values = [0.0] * self.count
        for position, owner, get in zip(self.positions, self.owners, self.getters, strict=True):
            if owner.training:
                values[position] = float(get(owner))
        return tuple(values)

    def apply(self, fast: FastBertModel) -> None:
        """Write the current probabilities into ``fast`` and put it in training mode while any site drops."""
        values = self.values()
        if values != self.applied:
            self.embeddings.dropout = values[0]
            for layer, first, end in self.layers:
                layer.dropout = values[first:end]
            self.applied = values
        dropping = any(values)
        if fast.training != dropping:
            fast.train(dropping)


def _walk(base: nn.Module, path: str, links: dict) -> nn.Module | None:
    """The module at ``path`` under ``base`` (None if absent), recording each link on the way."""
    module = base
    for part in path.split("."):
        module = _link(links, module._modules, part)
        if module is None:
            return None
    return module


def _resolve(base: nn.Module, name: str, kind: str, links: dict,
             wrappers: dict[str, nn.Module]) -> tuple[nn.Parameter | None, str | None]:
    """Walk ``name`` ("encoder.layer.0.output.dense.weight") from ``base``, recording each link. A Linear that a
    PEFT LoRA layer wraps is taken from its ``base_layer``, the LoRA layer recorded in ``wrappers`` by ``name``."""
    *path, attr = name.split(".")
    module = base
    for part in path:
        child = module._modules.get(part)
        links[(id(module._modules), part)] = (module._modules, part, child)
        if child is None:
            return None, f"{type(base).__name__} has no module {name.rpartition('.')[0]}"
        module = child
    owner = name.rpartition(".")[0]
    expected = _OWNER_TYPES[kind]
    if kind == "linear" and (type(module).__module__, type(module).__qualname__) == _LORA_LINEAR:
        wrappers[name] = module
        module = _link(links, module._modules, "base_layer")
        owner += ".base_layer"
    if type(module) is not expected:
        kind_of = type(module).__module__
        hint = PEFT_HINT if kind_of.split(".")[0] == "peft" else ""
        return None, (f"{owner} is a {kind_of}.{type(module).__qualname__}, not torch's "
                      f"nn.{expected.__name__}: fastbert cannot run it{hint}")
    param = module._parameters.get(attr)
    links[(id(module._parameters), attr)] = (module._parameters, attr, param)
    if param is None:
        return None, f"{owner} has no {attr}"
    if not isinstance(param, nn.Parameter):
        return None, f"{owner}.{attr} is a plain tensor, not a parameter (torch.func.functional_call)"
    if kind == "embedding" and module.max_norm is not None:
        return None, f"{owner} renormalises its rows (max_norm={module.max_norm})"
    return param, None


def _link(links: dict, container: dict, key: str) -> object:
    """Record that ``container[key]`` must stay what it is now (None included: a module added later counts)."""
    value = container.get(key)
    links[(id(container), key)] = (container, key, value)
    return value


class _AdapterState:
    """What a PEFT LoRA layer's forward reads besides its modules, as one comparable value (a `_Build.watched`
    entry): PEFT edits its lists and dicts in place (``merge`` appends to ``merged_adapters``, ``set_scale``
    rewrites ``scaling``), which a watched reference would not see."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    @property
    def value(self) -> tuple:
        layer = self.layer
        return (layer.disable_adapters, tuple(layer.active_adapters), tuple(layer.merged_adapters),
                tuple(sorted(layer.scaling.items())), tuple(sorted(layer.use_dora.items())),
                tuple(sorted(layer.lora_bias.items())), tuple(sorted(getattr(layer, "lora_variant", {}))))


def _module(base: nn.Module, path: str) -> nn.Module | None:
    module = base
    for part in path.split("."):
        module = module._modules.get(part) if module is not None else None
    return module


def _build(base: nn.Module, backend: str) -> _Build:
    """fastbert's encoder over ``base``'s current tensors, or the reason it cannot run them."""
    # A first call often comes under inference_mode: the packed Q/K/V must still be ordinary tensors, with version
    # counters that the onednn backend watches and that later refreshes (outside inference mode) may write to.
    with torch.inference_mode(False), torch.no_grad():
        return _Builder(base).build(backend)


class _Refused(Exception):
    """Raised by a build stage when fastbert cannot run the model as it is; the message says why."""


# transformers' activation modules (by class name: their module paths move between versions) -> fastbert's name.
_ACTIVATION_MODULES = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "GELUTanh": "gelu_tanh",
                       "PytorchGELUTanh": "gelu_tanh", "FastGELUActivation": "gelu_tanh", "ReLU": "relu"}
_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


class _Builder:
    """One build of fastbert's encoder over a transformers base model, in stages: read the configuration as the
    modules hold it, find the mapped tensors, read what the modules hold beside them (eps, activation, heads),
    create the encoder on the meta device, check its shapes, then give it the model's tensors. Each stage records
    what it read (``links``, ``watched``), so that the build knows when it is stale, refused builds included: a
    change to what made fastbert refuse may mend it."""

    def __init__(self, base: nn.Module):
        self.base = base
        self.submodules = [m for m in base.modules() if m is not base]
        self.links: dict = {}  # (id(container), key) -> (container, key, object), see `_Build.links`
        self.watched: list[tuple[object, str, object]] = []
        self.tensors: list[nn.Parameter] = []
        self.packs: list[_Pack] = []
        self.wrappers: dict[str, nn.Module] = {}  # transformers weight name -> the PEFT LoRA layer around it
        self.adapters: dict[str, LowRankAdapter] = {}  # transformers weight name -> its active LoRA adapter

    def build(self, backend: str) -> _Build:
        """The build, or a refused one (``fast`` None, ``unsupported`` the reason)."""
        try:
            self.check_code()
            config = self.read_config()
            pairs = encoder_key_map(config)
            found = self.find_tensors(pairs)
            self.read_norms(config, pairs)
            attention = self.read_layers(config)
            self.size_tables(config, pairs, found)
            with torch.device("meta"):
                fast = FastBertModel(config, backend=backend)
            self.check_shapes(fast, pairs, found)
            self.read_adapters(fast, pairs, found)
            output_class = self.output_class()
            dropout = self.read_dropout(config, fast)
        except _Refused as refusal:
            return self.result(None, str(refusal))
        self.share_tensors(fast, pairs, found)
        self.copy_module_settings(fast, config, attention)
        build = self.result(fast, None, output_class, _signature(type(self.base))[1])
        build.dropout = dropout
        dropout.apply(fast)
        return build

    def result(self, fast: FastBertModel | None, unsupported: str | None, output_class: type | None = None,
               inputs: tuple[str, ...] = ENCODER_INPUTS) -> _Build:
        tensors = self.tensors
        return _Build(fast, unsupported, list(self.links.values()), tensors, tuple(t.data_ptr() for t in tensors),
                      self.submodules, output_class, inputs, self.watched, packs=self.packs)

    def read_dropout(self, config: FastBertConfig, fast: FastBertModel) -> _DropoutSites:
        """Where transformers' modules apply dropout, site by site of ``fast`` (linked: a replaced dropout module
        rebuilds; its p and mode are read on every call)."""
        family = families.get(config.model_type)
        sites = [(fast.embeddings, *self.dropout_source("", family.dropout_sites.get("embedding")))]
        for index, layer in enumerate(fast.layers):
            prefix = family.layer(config, index) + "."
            sites += [(layer, *self.dropout_source(prefix, family.dropout_sites.get(site)))
                      for site in layer.DROPOUT_SITES]
        return _DropoutSites(fast, sites)

    def dropout_source(self, prefix: str, spec: str | None) -> tuple[nn.Module | None, Callable | None]:
        """(module whose mode switches the site on, getter of its p on that module) for a `Family.dropout_sites`
        entry under ``prefix``; (None, None) where nothing is dropped."""
        if spec is None:
            return None, None
        path, _, attribute = spec.partition(":")
        owner = _walk(self.base, prefix + path, self.links)
        if attribute:
            modules, _, name = attribute.rpartition(".")
            holder = _walk(owner, modules, self.links) if owner is not None and modules else owner
            p = getattr(holder, name, None)
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise _Refused(f"{prefix}{path} holds no dropout probability {attribute} (got {p!r})")
            return owner, operator.attrgetter(attribute)
        if owner is None or isinstance(owner, nn.Identity):
            return None, None
        if not isinstance(owner, nn.Dropout):
            raise _Refused(f"{prefix}{path} is a {type(owner).__module__}.{type(owner).__qualname__}, not torch's "
                           "nn.Dropout: fastbert cannot apply it")
        return owner, _P

    def check_code(self) -> None:
        """fastbert computes what transformers' (and torch's, PEFT's) code computes: a submodule of another class
        (a user's subclass, remote code) or a class whose ``forward`` was replaced would compute something else.
        Each class's forward is watched (a replacement after the build rebuilds). PEFT's layers are checked where
        they are read (`_resolve`, `read_adapters`)."""
        seen = set()
        for module in (self.base, *self.submodules):
            cls = type(module)
            if cls in seen:
                continue
            seen.add(cls)
            if module is not self.base and not cls.__module__.startswith(_LIBRARIES):
                name = next(n for n, m in self.base.named_modules() if m is module)
                raise _Refused(f"submodule {name} is a {cls.__module__}.{cls.__qualname__}, not a class of "
                               "transformers, torch or PEFT: fastbert would not run its code")
            forward = cls.forward
            if not cls.__module__.startswith("peft.") and not _library_code(forward):
                where = getattr(getattr(forward, "__code__", None), "co_filename", getattr(forward, "__module__", "?"))
                raise _Refused(f"{cls.__qualname__}.forward runs code from {where}, not transformers' own: fastbert "
                               "would not run its code")
            self.watched.append((cls, "forward", forward))
        self.watched.append((self.base, "__class__", type(self.base)))

    def read_config(self) -> FastBertConfig:
        """fastbert's config from the model's, corrected by what transformers' modules hold: they read the config
        once when they were built (the number of layers in the module list, a pooler present or not, RoBERTa's
        padding index)."""
        base = self.base
        raw = base.config.to_dict()
        if raw.get("pruned_heads"):
            raise _Refused("attention heads were pruned (config.pruned_heads)")
        try:
            config = FastBertConfig.from_hf_dict(raw)
        except ValueError as err:  # a config edited after optimize() (optimize itself raises for these)
            raise _Refused(str(err)) from None
        config.has_pooler = _link(self.links, base._modules, "pooler") is not None  # RoBERTa's MLM class has none
        family = families.get(config.model_type)
        # Config attributes the encoder reads on every call (ALBERT's depth and grouping)
        self.watched += [(base.config, name, getattr(base.config, name)) for name in family.live_config]
        if family.layer_list is not None:
            stack = _module(base, family.layer_list)
            if isinstance(stack, nn.ModuleList):
                config.num_hidden_layers = len(stack)
                _link(self.links, stack._modules, str(len(stack)))  # a layer appended later
        embeddings = base._modules.get("embeddings")
        if family.offset_positions and embeddings is not None and hasattr(embeddings, "padding_idx"):
            config.pad_token_id = embeddings.padding_idx
            self.watched.append((embeddings, "padding_idx", embeddings.padding_idx))
        return config

    def find_tensors(self, pairs: list[tuple[str, list[str]]]) -> dict[str, nn.Parameter]:
        """The model's parameter behind each transformers name of ``pairs``, all on one dtype and device."""
        found: dict[str, nn.Parameter] = {}
        for ours, theirs in pairs:
            for name in theirs:
                param, reason = _resolve(self.base, name, _owner_kind(ours), self.links, self.wrappers)
                if reason is not None:
                    raise _Refused(reason)
                found[name] = param
        self.tensors.extend(found.values())
        dtypes, devices = {t.dtype for t in self.tensors}, {t.device for t in self.tensors}
        if len(dtypes) > 1 or len(devices) > 1:
            raise _Refused(f"the encoder's tensors are on several dtypes/devices ({sorted(map(str, dtypes))}, "
                           f"{sorted(map(str, devices))})")
        return found

    def read_norms(self, config: FastBertConfig, pairs: list[tuple[str, list[str]]]) -> None:
        """Copy the LayerNorms' eps into ``config`` (one for all), watching it and the embedding tables'
        ``max_norm`` (nn.Embedding renormalises its rows in place when it is set)."""
        eps = set()
        for ours, theirs in pairs:
            owner = _module(self.base, theirs[0].rpartition(".")[0])
            if _owner_kind(ours) == "embedding":
                self.watched.append((owner, "max_norm", owner.max_norm))
            if _owner_kind(ours) == "norm" and ours.endswith("_weight"):
                eps.add(owner.eps)
                self.watched.append((owner, "eps", owner.eps))
        if len(eps) != 1:
            raise _Refused(f"LayerNorms with different eps {sorted(eps)}")
        config.layer_norm_eps = eps.pop()

    def read_layers(self, config: FastBertConfig) -> list[tuple[int, float]]:
        """(heads, scaling) of each unique layer as its attention module holds them, and the activation (one for
        all layers) into ``config``."""
        family = families.get(config.model_type)
        attention, activations = [], set()
        for index in range(config.num_unique_layers):
            layer = family.layer(config, index)
            attention.append(self.read_attention(_module(self.base, f"{layer}.{family.attention}"), config))
            activations.add(self.read_activation(f"{layer}.{family.ffn_activation}"))
        if len(activations) != 1:
            raise _Refused(f"layers with different activations {sorted(activations)}")
        config.hidden_act = _HF_ACTIVATION[activations.pop()]
        return attention

    def read_attention(self, attn: nn.Module, config: FastBertConfig) -> tuple[int, float]:
        """(heads, scaling) of one attention module, watching the attributes they come from."""
        heads = getattr(attn, "num_attention_heads", getattr(attn, "n_heads", None))
        head_dim = getattr(attn, "head_dim", None)
        if heads is None and isinstance(head_dim, int) and head_dim > 0:  # ModernBERT's holds the head size only
            heads = config.hidden_size // head_dim
        if not isinstance(heads, int) or heads <= 0 or config.hidden_size % heads:
            raise _Refused(f"attention module {type(attn).__name__} with {heads!r} heads")
        scale = float(getattr(attn, "scaling", (config.hidden_size // heads) ** -0.5))
        self.watched += [(attn, name, getattr(attn, name))
                         for name in ("num_attention_heads", "n_heads", "head_dim", "scaling") if hasattr(attn, name)]
        return heads, scale

    def read_activation(self, path: str) -> str:
        """fastbert's name of the activation module at ``path``, linked (a replaced activation rebuilds)."""
        parent_path, _, act_name = path.rpartition(".")
        act = _link(self.links, _module(self.base, parent_path)._modules, act_name)
        name = _ACTIVATION_MODULES.get(type(act).__name__)
        if name is None:
            raise _Refused(f"activation {type(act).__name__} of {parent_path} (fastbert runs "
                           f"{sorted(_HF_ACTIVATION)})")
        return name

    @staticmethod
    def size_tables(config: FastBertConfig, pairs: list[tuple[str, list[str]]],
                    found: dict[str, nn.Parameter]) -> None:
        """The embedding tables' sizes into ``config``, from the tensors: resize_token_embeddings and friends
        change both, but a config edited by hand would otherwise let an id past the table through the range
        check."""
        rows = {ours: found[theirs[0]].shape[0] for ours, theirs in pairs if len(theirs) == 1}
        config.vocab_size = rows["embeddings.word_embeddings"]
        if "embeddings.position_embeddings" in rows:  # rotary models have no table: the config's length stands
            config.max_position_embeddings = rows["embeddings.position_embeddings"]
        if config.type_vocab_size:
            config.type_vocab_size = rows["embeddings.token_type_embeddings"]

    @staticmethod
    def check_shapes(fast: FastBertModel, pairs: list[tuple[str, list[str]]],
                     found: dict[str, nn.Parameter]) -> None:
        """Each mapped tensor (Q, K and V concatenated) has the shape of the parameter it becomes."""
        expected = dict(fast.named_parameters())
        bad = []
        for ours, theirs in pairs:
            shape = (sum(found[k].shape[0] for k in theirs), *found[theirs[0]].shape[1:])
            if torch.Size(shape) != expected[ours].shape:
                bad.append(f"{' + '.join(theirs)}: {shape}, expected {tuple(expected[ours].shape)}")
        if bad:
            raise _Refused("tensors of unexpected shape: " + "; ".join(bad[:3]))

    def read_adapters(self, fast: FastBertModel, pairs: list[tuple[str, list[str]]],
                      found: dict[str, nn.Parameter]) -> None:
        """The active LoRA adapter of each wrapped Linear (`_resolve`) into ``adapters``, watching what PEFT's
        forward reads; refused where fastbert would not compute what PEFT does."""
        roles = {name: ours for ours, theirs in pairs for name in theirs}
        modules = dict(fast.named_modules())
        for name, wrapper in self.wrappers.items():
            owner, _, attr = name.rpartition(".")
            if attr != "weight":  # (the bias of a wrapped Linear: the same wrapper)
                continue
            adapter = self.read_adapter(wrapper, owner, found[name])
            if adapter is None:
                continue
            ours_owner, _, ours_attr = roles[name].rpartition(".")
            if ours_attr not in _ADAPTED_ROLES and type(modules.get(ours_owner)) is not nn.Linear:
                raise _Refused(f"a LoRA adapter on {owner}: fastbert runs adapters on linear layers only")
            self.adapters[name] = adapter
            self.tensors += [adapter.down, adapter.up]

    def read_adapter(self, wrapper: nn.Module, owner: str, weight: nn.Parameter) -> LowRankAdapter | None:
        """The adapter a PEFT LoRA Linear adds in its forward now (None: it adds none), or _Refused."""
        state = _AdapterState(wrapper)
        self.watched.append((state, "value", state.value))
        if wrapper.disable_adapters:
            if wrapper.merged:
                raise _Refused(f"{owner}: adapters disabled while merged (PEFT unmerges them on its next call)")
            return None
        active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
        if wrapper.merged or not active:  # a merged adapter is in the base weight already
            return None
        if len(active) > 1:
            raise _Refused(f"{owner} has {len(active)} active LoRA adapters ({', '.join(active)}): fastbert runs one")
        name = active[0]
        if wrapper.use_dora.get(name) or name in getattr(wrapper, "lora_variant", {}):
            raise _Refused(f"{owner}: adapter {name!r} is a LoRA variant (DoRA, ...): fastbert runs plain LoRA")
        if wrapper.lora_bias.get(name):
            raise _Refused(f"{owner}: adapter {name!r} has a bias (lora_bias=True): fastbert runs plain LoRA")
        down = self.adapter_weight(wrapper, "lora_A", name, owner, weight)
        up = self.adapter_weight(wrapper, "lora_B", name, owner, weight)
        dropout = _link(self.links, wrapper.lora_dropout._modules, name)
        if not isinstance(dropout, (nn.Dropout, nn.Identity)):
            raise _Refused(f"{owner}: adapter {name!r} has dropout {type(dropout).__name__}, not nn.Dropout")
        scaling = wrapper.scaling[name]
        if isinstance(scaling, torch.Tensor):
            raise _Refused(f"{owner}: adapter {name!r} has a tensor scaling")
        return LowRankAdapter(down, up, float(scaling), dropout if isinstance(dropout, nn.Dropout) else None)

    def adapter_weight(self, wrapper: nn.Module, table: str, name: str, owner: str,
                       weight: nn.Parameter) -> nn.Parameter:
        """lora_A / lora_B [name]'s weight, linked, checked to be a bias-free nn.Linear on the base's device."""
        linear = _link(self.links, getattr(wrapper, table)._modules, name)
        if type(linear) is not nn.Linear or linear.bias is not None:
            raise _Refused(f"{owner}: {table}[{name!r}] is not a bias-free torch nn.Linear")
        param = _link(self.links, linear._parameters, "weight")
        if not isinstance(param, nn.Parameter) or param.device != weight.device or not param.is_floating_point():
            raise _Refused(f"{owner}: {table}[{name!r}].weight is not a floating-point parameter on "
                           f"{weight.device}")
        return param

    def output_class(self) -> type:
        try:
            return _output_class(self.base)
        except Exception as err:  # noqa: BLE001 - a model transformers cannot run once is not one to take over
            raise _Refused(f"transformers' forward failed on one token: {type(err).__name__}: {err}") from None

    def share_tensors(self, fast: FastBertModel, pairs: list[tuple[str, list[str]]],
                      found: dict[str, nn.Parameter]) -> None:
        """Give ``fast`` the model's parameters. Q, K and V are packed into a tensor of fastbert's own (`_Pack`),
        refreshed when they change; under autograd the layer concatenates the originals instead
        (``qkv_sources``), so that gradients reach the parameters the model's optimizer holds."""
        owners = dict(fast.named_modules())
        packed_sources: dict[str, dict[str, tuple[nn.Parameter, ...]]] = {}
        adapted_linears: dict[str, AdapterGroup] = {}  # fastbert's nn.Linear modules (pooler, ...) with adapters
        for ours, theirs in pairs:
            owner_name, _, attr = ours.rpartition(".")
            params = tuple(found[k] for k in theirs)
            adapters = [self.adapters.get(k) for k in theirs]
            group = None
            if any(adapters):
                group = AdapterGroup(adapters, [p.shape[0] for p in params], params[0] if len(params) == 1 else None)
                owner = owners[owner_name]
                if attr in _ADAPTED_ROLES:
                    owner.low_rank = {**(owner.low_rank or {}), _ADAPTED_ROLES[attr]: group}
                else:
                    adapted_linears[owner_name] = group
            elif len(theirs) == 1:
                setattr(owners[owner_name], attr, found[theirs[0]])
                continue
            if len(theirs) > 1:
                packed_sources.setdefault(owner_name, {})[attr] = params
            pack = _Pack(params, group)
            self.packs.append(pack)
            setattr(owners[owner_name], attr, pack.tensor)
        for owner_name, sources in packed_sources.items():
            owners[owner_name].qkv_sources = (sources["qkv_weight"], sources.get("qkv_bias", ()))
        for owner_name, group in adapted_linears.items():
            parent, _, child = owner_name.rpartition(".")
            linear = owners[owner_name]
            setattr(owners[parent], child, AdaptedLinear(linear.weight, linear.bias, group))

    def copy_module_settings(self, fast: FastBertModel, config: FastBertConfig,
                             attention: list[tuple[int, float]]) -> None:
        """What transformers' modules hold beside their tensors (padding rows, heads, scaling) into ``fast``, and
        the mode fastbert's path runs in."""
        family = families.get(config.model_type)
        word_table = _module(self.base, family.embedding_params["word"])
        fast.embeddings.padding_idx = word_table.padding_idx
        self.watched.append((word_table, "padding_idx", word_table.padding_idx))
        position_table = _module(self.base, family.embedding_params.get("position", ""))
        if position_table is not None and fast.embeddings.position_embeddings is not None:
            fast.embeddings.position_padding_idx = position_table.padding_idx
            self.watched.append((position_table, "padding_idx", position_table.padding_idx))
        for index, (heads, scale) in enumerate(attention):
            fast.layers[index].num_heads, fast.layers[index].scale = heads, scale
        fast.eval()
        # The padded form (torch.compile, jit.trace) computes padded rows as transformers does; keeping them makes
        # a head that reads a padded position (left padding) agree with transformers there too.
        fast.zero_padded_rows = False


def _hook_reason(base: nn.Module, build: _Build) -> str | None:
    """Hooks on the encoder's submodules would not fire on fastbert's path: such calls run transformers' code."""
    global_hooks = nn.modules.module
    if global_hooks._global_forward_hooks or global_hooks._global_forward_pre_hooks:
        return "global forward hooks are registered (torch.nn.modules.module.register_module_forward_hook)"
    if not any(build.hook_dicts) and not any(map(operator.contains, build.module_dicts, repeat("forward"))):
        return None
    for module in build.submodules:
        hooks = module._forward_hooks or module._forward_pre_hooks
        if (hooks and _foreign_hooks(module)) or _replaced_forward(module):
            name = next((n for n, m in base.named_modules() if m is module), type(module).__name__)
            return f"submodule {name} has forward hooks or a replaced forward (e.g. accelerate offloading)"
        if module._backward_hooks or module._backward_pre_hooks:
            name = next((n for n, m in base.named_modules() if m is module), type(module).__name__)
            return f"submodule {name} has backward hooks (fastbert's path would not run them)"
    return None


def _attention_reason(base: nn.Module) -> str | None:
    """Why the model's attention function is not one fastbert computes: one registered with transformers'
    ``AttentionInterface`` (``attn_implementation="my_attention"``, or over a built-in name), a hub kernel, or a
    replaced ``eager_attention_forward`` of the modeling file."""
    implementation = getattr(base.config, "_attn_implementation", None)
    if implementation in (None, "eager"):  # the modeling file's own eager_attention_forward
        function = getattr(inspect.getmodule(type(base)), "eager_attention_forward", None)
    else:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        function = ALL_ATTENTION_FUNCTIONS[implementation] if implementation in ALL_ATTENTION_FUNCTIONS else False
    if function is None or (function is not False and _library_code(function)):
        return None
    return (f"attn_implementation {implementation!r} runs an attention function other than transformers' own (an "
            "AttentionInterface registration, a hub kernel, a replaced eager_attention_forward): fastbert would not "
            "run it")


@functools.lru_cache(maxsize=256)
def _library_code(function: Callable) -> bool:
    """Whether ``function``, and each function it wraps (``functools.wraps``' ``__wrapped__``), is code from the
    files of transformers, torch or PEFT (a wrapper copies its wrapped function's ``__module__``, not its file)."""
    while function is not None:
        code = getattr(function, "__code__", None)
        if code is None:  # a builtin or a callable object: its module says
            return (getattr(function, "__module__", None) or "").startswith(_LIBRARIES)
        if not code.co_filename.startswith(_library_dirs()):
            return False
        function = getattr(function, "__wrapped__", None)
    return True


def _library_dirs() -> tuple[str, ...]:
    """The directories of transformers, torch and PEFT (those installed), and of the hub's ``kernels`` package
    when transformers imported it (its decorator wraps some layers' forward, e.g. ModernBERT's attention, and runs
    transformers' code unless the user kernelizes the model; a kernelized layer computes the same op)."""
    import importlib.util
    import os
    import sys

    found = []
    for name in ("transformers", "torch", "peft", "kernels"):
        module = sys.modules.get(name)
        if module is not None:
            paths = list(getattr(module, "__path__", []))
        elif name != "kernels":  # (not imported: nothing of it wraps a forward; a repository folder may shadow it)
            spec = importlib.util.find_spec(name)
            paths = list(spec.submodule_search_locations or []) if spec is not None else []
        else:
            paths = []
        found += [os.path.join(path, "") for path in paths]
    return tuple(found)


def _foreign_hooks(module: nn.Module) -> bool:
    """Hooks other than transformers' own inert ones: its output-capturing hooks (installed for good on the first
    call that asks for attentions or hidden states) and gradient checkpointing's `make_inputs_require_grads`
    (it makes the embeddings' output require grad for checkpointed layers; fastbert's path checkpoints nothing, and
    gradient checkpointing itself makes the call fall back)."""
    hooks = (*module._forward_hooks.values(), *module._forward_pre_hooks.values())
    return any(getattr(hook, "__module__", None) != _TRANSFORMERS_CAPTURE
               and getattr(hook, "__qualname__", "").rpartition(".")[2] != "make_inputs_require_grads"
               for hook in hooks)


def _replaced_forward(module: nn.Module) -> bool:
    """A ``forward`` set on the instance, other than its own class's forward bound to it (what accelerate leaves
    behind after removing its hooks; its ``unwrap_model(keep_fp32_wrapper=False)`` binds the function under
    transformers' decorators)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return False
    function = getattr(forward, "__func__", None)
    own = type(module).forward
    return not (getattr(forward, "__self__", None) is module
                and (function is own or (function is not None and function is inspect.unwrap(own))))


class OptimizedState:
    """What `optimize` attaches to a transformers base model (as ``_fastbert``): the requested backend, whether
    inference on CUDA replays CUDA graphs, and a cache of fastbert's encoder over the model's tensors. Copies and
    pickles carry the request, not the cache: the copy builds its own from its own tensors on its first call."""

    def __init__(self, backend: str, cuda_graphs: bool = True, dtype: str | None = None):
        self.backend = backend
        self.cuda_graphs = cuda_graphs
        self.dtype = dtype  # "int8": the encoder's GEMMs quantized (`fastbert.quantization`), else None
        self._reset()

    def _reset(self) -> None:
        self.build: _Build | None = None
        self.warned: set[str] = set()
        self.lock = threading.Lock()
        # .call: set by the head model's `_padded_loss_hook` for its next encoder call in the same thread (the
        # loss reads padded positions)
        self.padded = threading.local()

    def __getstate__(self) -> dict:
        return {"backend": self.backend, "cuda_graphs": self.cuda_graphs, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.backend = state["backend"]
        self.cuda_graphs = state.get("cuda_graphs", True)
        self.dtype = state.get("dtype")
        self._reset()

    def current(self, base: nn.Module) -> _Build:
        """The build over ``base``'s tensors as they are now (rebuilt when any of them changed)."""
        build = self.build
        if build is None or build.stale():
            with self.lock:  # one rebuild when threads share a model
                build = self.build
                if build is None or build.stale():
                    build = _build(base, self.backend)
                    if self.cuda_graphs and build.fast is not None:
                        enable_on_cuda(build.fast)  # (a move to another device rebuilds: this runs again)
                    if self.dtype == "int8" and build.fast is not None:
                        _quantize(build)
                    self.build = build
        if build.packs and not torch.is_grad_enabled():  # under autograd the layers read the sources themselves
            build.sync_packs()
        return build

    def call_reason(self, base: nn.Module, arguments: dict | None) -> str | None:
        """Why this call, whatever the model's tensors, runs transformers' code; None when it need not."""
        if arguments is None:
            return "arguments that do not match the forward signature"
        config = base.config
        if _is_onnx_exporting():
            return ("torch.onnx.export records transformers' code: fastbert's ops are PyTorch custom ops that ONNX "
                    "does not know (ONNX Runtime then runs its own kernels)")
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            return "config.is_decoder / config.add_cross_attention is set"
        for name, value in arguments.items():
            if name in ENCODER_INPUTS or name in OUTPUT_OPTIONS or name in LOSS_ONLY or value is None:
                continue
            if name in OFF_FLAGS and value is False:
                continue
            return f"argument {name}={_describe(value)}"
        if not _valid_selection(arguments.get("output_hidden_states")):
            return f"argument output_hidden_states={_describe(arguments['output_hidden_states'])}"
        mask = arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() != 2:  # transformers also takes prepared 3-D/4-D masks
            return f"a {mask.dim()}-D attention_mask (fastbert takes [batch, seq] masks)"
        if arguments.get("output_attentions") is None and getattr(config, "output_attentions", False):
            return "config.output_attentions is True"
        if not torch.compiler.is_compiling() or _is_exporting():  # (compiled: checked outside the graph, `_eager`)
            reason = _attention_reason(base)
            if reason is not None:
                return reason
        if base.training and torch.is_grad_enabled() and self._checkpointing(base):
            return ("gradient checkpointing is enabled (fastbert's encoder does not checkpoint): call "
                    "model.gradient_checkpointing_disable() for fastbert's path")
        return None

    def _checkpointing(self, base: nn.Module) -> bool:
        """Whether transformers' gradient checkpointing is on (its modules' ``gradient_checkpointing`` flag)."""
        dicts = self.build.module_dicts if self.build is not None else [m.__dict__ for m in base.modules()]
        return any(d.get("gradient_checkpointing") is True for d in dicts)

    @staticmethod
    def model_reason(base: nn.Module, build: _Build, arguments: dict, first_padded: bool = False) -> str | None:
        """Why fastbert cannot run this call on the model as it now is; None when it can. ``first_padded``: a row's
        first position is padding (`_first_position_padded`)."""
        if build.unsupported:
            return build.unsupported
        if not torch.compiler.is_compiling() or _is_exporting():  # (compiled: checked outside the graph, `_eager`)
            reason = _hook_reason(base, build)
            if reason is not None:
                return reason
        if first_padded:
            return _left_padding_reason(build.fast, arguments["attention_mask"])
        return None

    def warn_once(self, reason: str) -> None:
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(f"fastbert: this call runs transformers' code (no speed-up): {reason}", stacklevel=4)

    def run(self, base: nn.Module, build: _Build, arguments: dict, keep_padded_rows: bool = False):
        config = base.config
        output_hidden_states = arguments.get("output_hidden_states")
        if output_hidden_states is None:
            output_hidden_states = getattr(config, "output_hidden_states", False)
        return_dict = arguments.get("return_dict")
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        inputs = {k: arguments.get(k) for k in build.inputs}
        # transformers' heads read position 0 of last_hidden_state, padding or not: a batch whose position 0 is
        # padding in some row runs the padded form (rows at padding are kept here: `zero_padded_rows` is off).
        inputs["reads_first_position"] = True
        if keep_padded_rows:  # (`FastBertModel.forward`: the padded form for this call)
            inputs["keep_padded_rows"] = True
        if self.dtype == "int8":  # inference only: the int8 GEMMs have no gradient
            if base.training:
                raise RuntimeError("fastbert: a model optimized with dtype='int8' is for inference only: call "
                                   "model.eval(), or fastbert.optimize(model) without dtype to train it")
            with torch.no_grad():
                out = _run_encoder(build.fast, inputs, bool(output_hidden_states))
            out = _without_gradient(out, build, inputs.get("inputs_embeds"))
        else:
            out = _run_encoder(build.fast, inputs, bool(output_hidden_states))
        fields = {"last_hidden_state": out.last_hidden_state}
        if "pooler_output" in build.output_class.__dataclass_fields__:
            fields["pooler_output"] = out.pooler_output
        if output_hidden_states:
            fields["hidden_states"] = _selected_states(out.hidden_states, output_hidden_states)
        result = build.output_class(**fields)
        return result if return_dict else result.to_tuple()


class _NoInt8Gradient(torch.autograd.Function):
    """Identity on an int8 encoder's output whose backward raises: the int8 GEMMs have no gradient, and without it a
    loss's backward would leave the encoder's parameters (or the inputs_embeds) without gradients, silently."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, *anchors: torch.Tensor) -> torch.Tensor:
        return output.clone()  # (a view could not be edited in place, as transformers' outputs can)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError("fastbert: a model optimized with dtype='int8' computes no gradient through its encoder: "
                           "freeze it (requires_grad_(False) on the encoder's parameters, its pooler's included, and "
                           "on inputs_embeds) to train the head alone, or fastbert.optimize(model) without dtype to "
                           "train it")


def _without_gradient(out, build: _Build, inputs_embeds: torch.Tensor | None):
    """An int8 encoder's outputs, marked (`_NoInt8Gradient`) where autograd would expect a gradient through them:
    an encoder parameter or the inputs_embeds requires one."""
    if not torch.is_grad_enabled():
        return out
    anchors = [t for t in (*build.tensors, inputs_embeds) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not anchors:
        return out
    anchors = anchors[:1]  # one is enough for autograd to record the node
    out.last_hidden_state = _NoInt8Gradient.apply(out.last_hidden_state, *anchors)
    if getattr(out, "pooler_output", None) is not None:
        out.pooler_output = _NoInt8Gradient.apply(out.pooler_output, *anchors)
    if out.hidden_states is not None:
        out.hidden_states = tuple(_NoInt8Gradient.apply(h, *anchors) for h in out.hidden_states)
    return out


def _selected_states(states: tuple[torch.Tensor, ...], selection) -> tuple[torch.Tensor | None, ...]:
    """The hidden states ``output_hidden_states`` asks for, as transformers 5 returns them: all for True; for
    layer indices (an int or a sequence, negative from the end, out of range selecting nothing) the full-length
    tuple with None where a state was not asked for. A transformers without indices takes any truthy value as
    True."""
    if selection is True or not _selects_by_index():
        return states
    count = len(states)
    chosen = {i % count for i in ([selection] if isinstance(selection, int) else selection) if -count <= i < count}
    return tuple(state if i in chosen else None for i, state in enumerate(states))


@functools.cache
def _selects_by_index() -> bool:
    """Whether the installed transformers selects hidden states by index (5.x's output capturing)."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True


def _valid_selection(value) -> bool:
    """Whether ``output_hidden_states`` is a flag, a layer index or a sequence of them (what fastbert returns)."""
    if value is None or isinstance(value, int):  # (bool is an int)
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _current_outside_graph(state: OptimizedState, base: nn.Module) -> tuple[_Build, str | None]:
    """`state.current` for a compiled model, and the model's attention function's `_attention_reason`, run eagerly
    on every call (the one graph break; see `_eager`): a compiled model is checked like an uncompiled one (the code
    check reads files and caches by function, which dynamo would trace through), a rebuild makes dynamo trace the
    new encoder, the dropout probabilities are read from the modules, and the backends are loaded before dynamo
    traces the ops (an import inside the graph would break it)."""
    build = state.current(base)
    if build.fast is not None:
        build.dropout.apply(build.fast)
        backends.preload(build.fast.backend, build.fast.embeddings.word_embeddings.device.type)
    # dynamo does not trace the submodules fastbert's encoder replaces, so it would not see their hooks
    return build, _attention_reason(base) or (None if build.unsupported else _hook_reason(base, build))


_eager_current: Callable | None = None


def _eager(state: OptimizedState, base: nn.Module) -> tuple[_Build, str | None]:
    """`_current_outside_graph` excluded from compilation, wrapped on first use: torch.compiler.disable imports
    torch._dynamo (about 2 s), which a model that is never compiled does not need."""
    global _eager_current
    if _eager_current is None:
        _eager_current = torch.compiler.disable(_current_outside_graph)
    return _eager_current(state, base)


def _is_onnx_exporting() -> bool:
    return bool(getattr(torch.onnx, "is_in_onnx_export", lambda: False)())


def _is_exporting() -> bool:
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(is_exporting and is_exporting())


def _run_encoder(fast: FastBertModel, inputs: dict, output_hidden_states: bool):
    """fastbert's encoder on ``inputs``; under autocast on the parameters' device, in the autocast dtype with
    autocast off inside (the fused ops take one dtype), the hidden states cast back to the parameters' dtype."""
    weight = fast.embeddings.word_embeddings
    device_type = weight.device.type
    if not (device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)):
        return fast(**inputs, output_hidden_states=output_hidden_states)
    dtype = torch.get_autocast_dtype(device_type)
    if weight.dtype == dtype or not weight.is_floating_point():
        with torch.autocast(device_type, enabled=False):
            return fast(**inputs, output_hidden_states=output_hidden_states)
    # Under autograd a layer concatenates Q/K/V from the model's own parameters (`PostNormLayer.packed_qkv`): its
    # packed copy goes unread, so it is not cast (a 3H x H copy per layer and step).
    unread = {f"{name}.qkv_weight" for name, module in fast.named_modules()
              if torch.is_grad_enabled() and getattr(module, "qkv_sources", None) is not None}
    params = {name: p.to(dtype) for name, p in fast.named_parameters() if name not in unread}
    if inputs.get("inputs_embeds") is not None:
        inputs = {**inputs, "inputs_embeds": inputs["inputs_embeds"].to(dtype)}
    with torch.autocast(device_type, enabled=False):
        out = torch.func.functional_call(fast, params, (), {**inputs, "output_hidden_states": output_hidden_states})
    back = weight.dtype  # as transformers' LayerNorms give them under autocast; its pooler (Linear, tanh) gives `dtype`
    out.last_hidden_state = out.last_hidden_state.to(back)
    out.hidden_states = None if out.hidden_states is None else tuple(h.to(back) for h in out.hidden_states)
    return out


def _signature(cls: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(positional parameter names, encoder inputs it names) of a transformers class's forward."""
    found = _SIGNATURES.get(cls)
    if found is None:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
        positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
        named = {p.name for p in params}
        found = _SIGNATURES[cls] = (positional, tuple(name for name in ENCODER_INPUTS if name in named))
    return found


def _arguments(cls: type, args: tuple, kwargs: dict) -> dict | None:
    """The call's arguments by name (None when they do not bind: the original forward raises the error)."""
    if not args:
        return kwargs
    names = _signature(cls)[0]
    if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return None
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _forward(base: nn.Module, args: tuple, kwargs: dict):
    state: OptimizedState = base.__dict__["_fastbert"]
    padded, state.padded.call = getattr(state.padded, "call", False), False  # (taken by this call, whichever path)
    arguments = _arguments(type(base), args, kwargs)
    reason = state.call_reason(base, arguments)  # first: a call that falls back anyway needs no build
    if reason is not None:
        state.warn_once(reason)
        return type(base).forward(base, *args, **kwargs)
    mask = arguments.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:  # transformers reads any nonzero value as a token
        arguments = {**arguments, "attention_mask": mask != 0}
    first_padded = _first_position_padded(arguments)
    if _is_exporting():  # a one-time capture of the model as it is (fake tensors: no storage to check)
        build = state.build
        if build is None:
            raise RuntimeError("fastbert: this copy of the model has not run yet, and torch.export cannot build "
                               "fastbert's encoder over fake tensors: call the model once (or fastbert.optimize "
                               "it again) before exporting it")
        if build.reshaped(tensors=False):
            raise RuntimeError("fastbert: the model changed since its last call (a module replaced, or an attribute "
                               "such as eps changed), and torch.export cannot rebuild fastbert's "
                               "encoder over fake tensors: call the model once before exporting it")
    elif torch.compiler.is_compiling():
        build, reason = _eager(state, base)
        if reason is not None:
            state.warn_once(reason)
            return type(base).forward(base, *args, **kwargs)
    else:
        build = state.current(base)
        if build.fast is not None:
            build.dropout.apply(build.fast)
    reason = state.model_reason(base, build, arguments, first_padded)
    if reason is not None:
        state.warn_once(reason)
        return type(base).forward(base, *args, **kwargs)
    if padded:
        mask = arguments.get("attention_mask")
        if isinstance(mask, torch.Tensor) and build.fast.config.window_narrower_than(mask.shape[-1]):
            state.warn_once(PADDED_WINDOW_REASON)
            return type(base).forward(base, *args, **kwargs)
        return _run_padded(state, base, build, arguments)
    return state.run(base, build, arguments)


def _first_position_padded(arguments: dict) -> bool:
    """Whether a row of the call's [B, S] attention mask starts with padding (left padding, or a row without
    tokens). Heads (the pooler, the RoBERTa/ELECTRA/DistilBERT/ModernBERT "cls" classifiers) read position 0, which
    transformers computes there: fastbert's encoder runs such a batch in its padded form (`OptimizedState.run`),
    except where that cannot agree with transformers (`_left_padding_reason`). (Compiled or traced calls cannot
    read the mask; they run the padded form.)"""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    return first_position_padded(mask)


def _left_padding_reason(fast: FastBertModel, mask: torch.Tensor) -> str | None:
    """Why a left-padded call cannot run fastbert's padded form as transformers computes it; None when it can."""
    if not bool(mask.any(dim=1).all()):
        return "a row without tokens (transformers averages the padding there; fastbert's attention gives zeros)"
    reach = fast.config.window_reach()
    if reach is not None and first_token_beyond(mask, reach):
        return (f"left padding that puts a row's first token more than {reach} positions from position 0 (a sliding "
                "window there holds no token: transformers averages the padding, fastbert's attention gives zeros)")
    return None


PADDED_WINDOW_REASON = ("the loss reads padded positions (labels there that are not -100, or question answering's "
                        "span positions on a padded batch), and with sliding-window attention fastbert's padded "
                        "form computes some of them differently (a window holding no real key gives zeros)")


def _run_padded(state: OptimizedState, base: nn.Module, build: _Build, arguments: dict):
    """`OptimizedState.run` in the padded form, which computes padded positions as transformers does (a loss that
    reads them then equals transformers'); per call, so that other threads' calls keep the padding-free form."""
    return state.run(base, build, arguments, keep_padded_rows=True)


# Head arguments whose loss reads the head's output at padded positions: token labels there that are not
# ignored (a collator that does not write -100 at padding), and question answering's span positions (its softmax
# runs over every position of the row).
_IGNORED_LABEL = -100
_SPAN_LABELS = ("start_positions", "end_positions")


def _loss_reads_padding(arguments: dict) -> bool:
    """Whether a head call's loss reads positions that ``attention_mask`` marks as padding."""
    mask = arguments.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    labels = arguments.get("labels")
    if isinstance(labels, torch.Tensor) and labels.shape == mask.shape:
        return bool(((mask == 0) & (labels != _IGNORED_LABEL)).any())
    if any(arguments.get(name) is not None for name in _SPAN_LABELS):
        return not bool(mask.all())
    return False


def _padded_loss_hook(head: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of a head model over an optimized encoder: when this call's loss reads padded positions,
    its encoder call runs the padded form, so that the loss equals transformers' (the padding-free form leaves
    zeros there)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():  # (traced calls run the padded form anyway)
        return
    state = head.base_model.__dict__.get("_fastbert")
    if state is None:
        return
    arguments = _arguments(type(head), args, kwargs)
    state.padded.call = arguments is not None and _loss_reads_padding(arguments)


def _watch_losses(model: nn.Module, base: nn.Module) -> None:
    """Install `_padded_loss_hook` (once) on each head model in ``model`` whose encoder is ``base``."""
    from transformers import PreTrainedModel

    for head in model.modules():
        if isinstance(head, PreTrainedModel) and head is not base and head.base_model is base:
            if _padded_loss_hook not in head._forward_pre_hooks.values():
                head.register_forward_pre_hook(_padded_loss_hook, with_kwargs=True)


class OptimizedForward:
    """What `optimize` installs as a base model's ``forward``: fastbert's path when it can take the call, else
    transformers' own forward. It reads everything from the model it is attached to (and travels with it through
    deepcopy and pickle), and shows the original signature to ``inspect.signature``."""

    __name__ = "forward"

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return _forward(self.module, args, kwargs)

    @property
    def __func__(self) -> Callable:
        """As on a bound method: a wrapper over ``forward.__func__`` bound to the model again (accelerate's prepare
        with mixed precision) is a method, which a copy of the model rebinds to the copy (a closure over this object
        would keep calling the original's forward). Its ``__wrapped__`` leads accelerate's ``unwrap_model`` back
        here."""
        def call(module: nn.Module, *args, **kwargs):
            return _forward(module, args, kwargs)

        call.__wrapped__ = self
        call.__signature__ = inspect.signature(type(self.module).forward)  # (the bound method drops ``self``)
        call.fastbert_call = True  # (wrappers copy it with functools.wraps: `_reaches_fastbert` stops at them)
        return call

    @property
    def __self__(self) -> nn.Module:
        return self.module

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    @property
    def __code__(self):  # torch.export and code that reads argument names look here, as on a function
        return inspect.unwrap(type(self.module).forward).__code__

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return type(self.module).forward.__doc__

    def __repr__(self) -> str:
        return f"<fastbert-optimized forward of {type(self.module).__name__}>"


def _bases(model: nn.Module) -> list[nn.Module]:
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.base_model is m]


def _quantize(build: _Build) -> None:
    """The build's encoder with int8 GEMMs; where that cannot run (the model moved to CUDA or to another dtype),
    the reason makes calls take transformers' code. The int8 weights are copies: the build is stale once a source
    changes in place (`_Build.quantized_stamps`); inference tensors have no version counter to tell that by."""
    try:
        quantize_int8(build.fast, freeze=False)
    except ValueError as err:
        build.unsupported = str(err)
        return
    if not any(tensor.is_inference() for tensor in build.tensors):
        build.quantized_stamps = _coarse_stamps(build.tensors)
        build.quantized_sources = _stamps(build.tensors)
    else:
        warnings.warn("fastbert.optimize(dtype='int8'): the model's weights are inference tensors (made under "
                      "torch.inference_mode()), whose in-place changes cannot be seen: call fastbert.optimize "
                      "again after changing them", stacklevel=2)


def optimize(model: nn.Module, backend: str = "auto", cuda_graphs: bool = True, dtype: str | None = None) -> nn.Module:
    """Speed up a transformers model of the BERT family (any head class), or a sentence-transformers model
    wrapping one, in place; returns the same object. Calling it again re-checks the model and may change the
    backend.

    cuda_graphs: inference calls on CUDA (eval mode, grad mode off) replay CUDA graphs of the packed encoder, one
    per bucket of shapes (`fastbert.cuda_graphs`); False launches every op. On CPU it does nothing.

    dtype: None (the model's own), or "int8": the encoder's GEMMs run int8 (weights per output channel,
    activations per token: `fastbert.quantization`), for inference on CPU of a float32 model (ValueError on CUDA;
    a call in training mode raises). The transformers model keeps its float weights; the int8 copies are extra.

    Raises TypeError for anything but a torch module, ValueError for an unknown backend, when the model holds no
    supported encoder, or one configured in a way fastbert cannot run (decoder, cross-attention, relative position
    embeddings).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastbert.optimize takes a torch.nn.Module (a transformers or sentence-transformers model), "
                        f"got {type(model).__name__}")
    targets = _bases(model)
    if not targets:
        raise ValueError(f"fastbert.optimize: found no transformers model inside {type(model).__name__}")
    if dtype not in (None, "int8"):
        raise ValueError(f"fastbert.optimize: dtype must be None or 'int8', got {dtype!r} (cast the model with "
                         "model.to(dtype) for float16/bfloat16)")
    backends.requested_backend(backend)  # an unknown name fails here, not at the first forward
    for base in targets:
        FastBertConfig.from_hf_dict(base.config.to_dict())  # raises for unsupported model types and configurations
        weight = next(base.parameters())
        reason = int8_unavailable(weight.device, weight.dtype) if dtype == "int8" else None
        if reason is not None:
            raise ValueError(f"fastbert.optimize(dtype='int8'): {reason}")
    for base in targets:
        reason = None if _reaches_fastbert(base) else _wrapped_forward_reason(base)
        if reason is not None:
            warnings.warn(f"fastbert.optimize: {type(base).__name__} is left as it is: {reason}", stacklevel=2)
            continue
        state = base.__dict__.get("_fastbert")
        if state is None:
            state = base._fastbert = OptimizedState(backend, cuda_graphs, dtype)
        state.backend, state.cuda_graphs, state.dtype = backend, cuda_graphs, dtype
        state.build = None
        if not _reaches_fastbert(base):
            base.forward = OptimizedForward(base)
        _watch_losses(model, base)
        build = state.current(base)
        if build.unsupported:
            state.warn_once(build.unsupported)
    return model


_CHOICE_INPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds"})


def is_optimized(model: nn.Module) -> bool:
    """True when a base model inside ``model`` runs through fastbert's forward (the model may still fall back
    for a given call: `explain` says when)."""
    return any(_reaches_fastbert(m) for m in model.modules())


def _head_of(model: nn.Module, base: nn.Module) -> nn.Module:
    """The transformers head model in ``model`` that calls ``base`` (inside a PEFT or other wrapper, whose forward
    passes ``**kwargs`` on), else ``model``."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules()
                 if m is not base and isinstance(m, PreTrainedModel) and m.base_model is base), model)


def _flatten_choices(kwargs: dict) -> dict:
    """The encoder inputs a transformers ForMultipleChoice head passes on: each [batch, choices, ...] tensor with its
    first two dimensions merged (inputs_embeds keeps its last two). (DistilBERT's head passes position_ids on
    unfolded, and transformers then fails on 3-D ones.)"""
    flat = dict(kwargs)
    for name, value in kwargs.items():
        rank = 4 if name == "inputs_embeds" else 3
        if name in _CHOICE_INPUTS and isinstance(value, torch.Tensor) and value.dim() == rank:
            flat[name] = value.flatten(0, 1)
    return flat


def _reaches_fastbert(module: nn.Module) -> bool:
    """Whether ``module``'s calls reach fastbert's forward for ``module``: its instance ``forward``, or through
    wrappers set over it (accelerate's mixed-precision forward and its hooks name what they wrap ``__wrapped__``;
    the mixed-precision forward is a method of the module over `OptimizedForward.__func__`)."""
    forward = module.__dict__.get("forward")
    bound_to = getattr(forward, "__self__", None)
    for _ in range(64):  # (a chain that loops back on itself ends here)
        if getattr(forward, "fastbert_call", False):  # `OptimizedForward.__func__`, or a wrapper over it
            return bound_to is module
        if isinstance(forward, OptimizedForward):
            return forward.module is module  # (a copy's closure over the original's forward runs the original)
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return False
    return False


def _wrapped_forward_reason(base: nn.Module) -> str | None:
    """Why `optimize` keeps the base model's instance ``forward``: a wrapper set over transformers' forward
    (accelerate's ``prepare`` with mixed precision runs it under autocast, its hooks move weights and inputs) would be
    lost if fastbert's forward replaced it."""
    if not _replaced_forward(base):
        return None
    return (f"its forward was replaced on the instance by {_code_name(base.__dict__['forward'])} (accelerate's "
            "prepare with mixed precision and its hooks do this), and replacing it would drop what that does. Call "
            "fastbert.optimize(model) before accelerator.prepare(model) or adding hooks, or remove the wrapper first "
            "(accelerator.unwrap_model(model, keep_fp32_wrapper=False), accelerate.hooks.remove_hook_from_module("
            "model, recurse=True), or `del model.forward` for one set by hand)")


def _code_name(function: Callable) -> str:
    """Where a callable's code is, by its code object (``functools.wraps`` copies the wrapped function's names onto
    a wrapper, its code stays its own)."""
    for _ in range(8):
        inner = getattr(function, "__func__", None) or getattr(function, "func", None)  # method, partial
        if inner is None:
            break
        function = inner
    code = getattr(function, "__code__", None)
    if not isinstance(code, types.CodeType):
        return f"a {type(function).__module__}.{type(function).__qualname__} object"
    return f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})"


def explain(model: nn.Module, **call_kwargs) -> str:
    """Which path a call ``model(**call_kwargs)`` would take through each optimized encoder in ``model``, and why.

    Keywords that the model's own forward consumes before its encoder (labels, ...) are left out for the encoder.
    Does not run the model (it may build fastbert's encoder over its tensors). Example:
    ``print(fastbert.explain(model, input_ids=ids, output_attentions=True))``.
    """
    lines = []
    for base in _bases(model):
        state = base.__dict__.get("_fastbert")
        name = type(base).__name__
        if state is None or not _reaches_fastbert(base):
            wrapped = _wrapped_forward_reason(base)
            lines.append(f"{name}: not optimized (transformers' code runs): {wrapped}" if wrapped else
                         f"{name}: not optimized (transformers' code runs); call fastbert.optimize(model)")
            continue
        kwargs = dict(call_kwargs)
        if base is not model:
            head = _head_of(model, base)
            own = inspect.signature(type(head).forward).parameters
            encoder = inspect.signature(type(base).forward).parameters
            kwargs = {k: v for k, v in kwargs.items() if k in encoder or k not in own}
            if type(head).__name__.endswith("ForMultipleChoice"):
                kwargs = _flatten_choices(kwargs)
        reason = state.call_reason(base, _arguments(type(base), (), kwargs))
        if reason is None:
            reason = state.model_reason(base, state.current(base), kwargs, _first_position_padded(kwargs))
        if reason is None:
            requested = state.backend if state.backend != "auto" else ("auto: per op among the device's backends, "
                                                                        "fastbert.backends.auto_order")
            lines.append(f"{name}: fastbert's path (backend {requested})")
        else:
            lines.append(f"{name}: transformers' code runs: {reason}")
    return "\n".join(lines) if lines else f"{type(model).__name__} holds no transformers model"
