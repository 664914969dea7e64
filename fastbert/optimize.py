"""`fastbert.optimize`: swap the encoder computation of a live transformers model for fastbert's, in place.

The model keeps its class, heads, forward signature, output types and state_dict keys. fastbert's encoder
shares the transformers parameters (no copy), except Q, K and V: they are packed into one [3H, H] tensor and the
original query/key/value parameters become views of it, so in-place updates (``load_state_dict``, optimizer
steps) reach both. After ``.to()``/``.half()`` the packing is rebuilt on the next call.

What runs transformers' own code instead (for that call only, results still correct):
- training mode (dropout) or autograd (grad enabled and parameters requiring grad; a warning says so once);
- ``output_attentions=True``, a ``head_mask``, cross-attention inputs, caches, or keyword arguments fastbert does
  not know.
Configurations fastbert cannot run at all (decoders, cross-attention, relative position embeddings) raise at
``optimize`` time.
"""

from __future__ import annotations

import inspect
import warnings
from types import MethodType

import torch
from torch import nn

from fastbert.config import FastBertConfig
from fastbert.loading import encoder_key_map
from fastbert.model import FastBertModel

_FAST_ARGS = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds"}
_HARMLESS_KWARGS = {"output_hidden_states", "return_dict"}
_FALLBACK_ARGS = ("output_attentions", "head_mask", "encoder_hidden_states", "encoder_attention_mask",
                  "past_key_values", "use_cache")


def _output_class(base: nn.Module) -> type:
    """The ModelOutput class the original forward returns (annotations are not reliable: run it on one token)."""
    param = next(base.parameters())
    token = torch.full((1, 1), int(getattr(base.config, "pad_token_id", 0) or 0), device=param.device)
    with torch.inference_mode():
        return type(type(base).forward(base, input_ids=token, return_dict=True))


class _Shared:
    """fastbert's encoder bound to one transformers base model's parameters."""

    def __init__(self, base: nn.Module, backend: str):
        self.base = base
        self.backend = backend
        self.config = FastBertConfig.from_hf_dict(base.config.to_dict())
        self.config.has_pooler = getattr(base, "pooler", None) is not None  # e.g. RoBERTa's MLM class has none
        self.output_class = _output_class(base)
        self.signature = inspect.signature(type(base).forward)
        self.original_forward = type(base).forward
        self.warned_grad = False
        self.fast: FastBertModel | None = None
        self.qkv_views: list[tuple[torch.Tensor, list[nn.Parameter]]] = []
        self.build()

    def build(self) -> None:
        """(Re)create the fastbert encoder over the base model's current parameters."""
        hf = dict(self.base.named_parameters())
        with torch.device("meta"):
            fast = FastBertModel(self.config, backend=self.backend)
        owners = dict(fast.named_modules())
        self.qkv_views = []
        for ours, theirs in encoder_key_map(self.config):
            missing = [k for k in theirs if k not in hf]
            if missing:
                raise ValueError(f"fastbert.optimize: {type(self.base).__name__} has no parameter {missing[0]}")
            owner_name, _, attr = ours.rpartition(".")
            owner = owners[owner_name]
            if len(theirs) == 1:
                setattr(owner, attr, hf[theirs[0]])
                continue
            params = [hf[k] for k in theirs]
            packed = torch.cat([p.detach() for p in params], dim=0)
            offset = 0
            for param in params:  # the originals become views of the packed tensor: one copy in memory
                rows = param.shape[0]
                param.data = packed[offset: offset + rows]
                offset += rows
            setattr(owner, attr, nn.Parameter(packed, requires_grad=False))
            self.qkv_views.append((packed, params))
        fast.eval()
        self.fast = fast

    def in_sync(self) -> bool:
        """False once .to()/.half() or a parameter swap separated the views from the packed tensors."""
        for packed, params in self.qkv_views:
            base_ptr, step = packed.data_ptr(), packed[: params[0].shape[0]].numel() * packed.element_size()
            if params[0].dtype != packed.dtype or params[0].device != packed.device:
                return False
            if any(p.data_ptr() != base_ptr + i * step for i, p in enumerate(params)):
                return False
        return True

    def fallback_reason(self, arguments: dict) -> str | None:
        if self.base.training:
            return "training mode"
        for name in _FALLBACK_ARGS:
            value = arguments.get(name)
            if value is not None and value is not False:
                return f"{name} is not supported by fastbert"
        extra = set(arguments) - set(self.signature.parameters) - _HARMLESS_KWARGS
        if extra:
            return f"keyword arguments {sorted(extra)} are not supported by fastbert"
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.base.parameters()):
            if not self.warned_grad:
                warnings.warn("fastbert: autograd is enabled, so transformers' own code runs; call the model "
                              "under torch.inference_mode() or torch.no_grad() for fastbert's path", stacklevel=3)
                self.warned_grad = True
            return "autograd"
        return None

    def forward(self, base: nn.Module, *args, **kwargs):
        bound = self.signature.bind(base, *args, **kwargs)
        flat = dict(bound.arguments)
        flat.pop("self", None)
        flat.update(flat.pop("kwargs", {}))
        if self.fallback_reason(flat) is not None:
            return self.original_forward(base, *args, **kwargs)
        if not self.in_sync():
            self.build()
        config = base.config
        output_hidden_states = flat.get("output_hidden_states")
        if output_hidden_states is None:
            output_hidden_states = getattr(config, "output_hidden_states", False)
        return_dict = flat.get("return_dict")
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        inputs = {k: flat.get(k) for k in _FAST_ARGS}
        out = self.fast(**inputs, output_hidden_states=bool(output_hidden_states))
        fields = {"last_hidden_state": out.last_hidden_state}
        if "pooler_output" in self.output_class.__dataclass_fields__:
            fields["pooler_output"] = out.pooler_output
        if output_hidden_states:
            fields["hidden_states"] = out.hidden_states
        result = self.output_class(**fields)
        return result if return_dict else result.to_tuple()


def optimize(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Speed up a transformers model of the BERT family (any head class), or a sentence-transformers model
    wrapping one, in place; returns the same object.

    Raises ValueError when the model holds no supported encoder, or one configured in a way fastbert cannot run
    (decoder, cross-attention, relative position embeddings).
    """
    from transformers import PreTrainedModel

    targets = [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.base_model is m]
    if not targets:
        raise ValueError(f"fastbert.optimize: found no transformers model inside {type(model).__name__}")
    for base in targets:
        if getattr(base, "_fastbert", None) is not None:
            base._fastbert.backend = backend
            base._fastbert.build()
            continue
        shared = _Shared(base, backend)  # raises for unsupported model types and configurations
        base._fastbert = shared
        base.forward = MethodType(shared.forward, base)
    return model


def is_optimized(model: nn.Module) -> bool:
    return any(getattr(m, "_fastbert", None) is not None for m in model.modules())
