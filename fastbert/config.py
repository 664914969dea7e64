"""fastbert's model configuration, read from a Hugging Face ``config.json`` of the BERT family.

Every family is normalised onto one set of fields (BERT's names); the per-family differences that change the
computation (embedding size, position ids, layer sharing, pooler) are explicit fields, not `model_type` checks
spread over the code. What maps each family's ``config.json`` onto these fields is its module in `fastbert.families`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from fastbert import families

# The attention kinds of `FastBertConfig.layer_types` (transformers' names).
LAYER_TYPES = ("full_attention", "sliding_attention")

# HF activation name -> fastbert activation name (the names every backend of `linear_activation` accepts).
ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


@dataclass
class FastBertConfig:
    """The shape and numerics of a BERT-family encoder.

    ``embedding_size`` differs from ``hidden_size`` for ALBERT and ELECTRA (factorised embeddings projected to H).
    ``position_offset`` is RoBERTa's: position ids start at ``pad_token_id + 1`` and skip padding tokens.
    ``num_hidden_groups``/``inner_group_num`` are ALBERT's layer sharing (1/1 and unshared for the others).

    The layer architecture (BERT's defaults; ModernBERT's values in brackets):

    - ``norm_placement``: "post" (LayerNorm after each residual sum) [or "pre": LayerNorm before attention and
      before the FFN, the first layer's attention reading the embedding LayerNorm's output directly, and
      ``final_norm`` after the last layer];
    - ``positions``: "absolute" (a learned position table added to the embeddings) [or "rotary": RoPE on q and k,
      with ``rope_theta`` per attention kind];
    - ``layer_types``: per layer "full_attention" or "sliding_attention" (empty: all full); a sliding layer attends
      keys within ``local_attention // 2`` positions (``local_attention`` is transformers' total window width);
    - ``glu``: the FFN input projection gives [input | gate] and computes act(input) * gate (GeGLU) [True];
    - ``attention_bias`` / ``mlp_bias`` / ``norm_bias``: whether the attention Linears, the FFN Linears and the
      LayerNorms have a bias [ModernBERT's config says; all False in ModernBERT-base].

    Dropout probabilities in training mode, by site (each family maps its config's names onto them, where its
    transformers modules apply dropout): ``embedding_dropout`` on the embedding LayerNorm's output;
    ``attention_dropout`` on the attention probabilities; ``attention_output_dropout`` and ``ffn_dropout`` on the
    attention output projection's and the FFN output projection's results, before the residual add;
    ``glu_dropout`` on the GLU's output, before the FFN output projection (ModernBERT's mlp_dropout).
    """

    model_type: str = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    embedding_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_hidden_groups: int = 1
    inner_group_num: int = 1
    shared_layers: bool = False
    has_pooler: bool = True
    num_labels: int = 2
    problem_type: str | None = None
    classifier_activation: str | None = None
    norm_placement: str = "post"
    final_norm: bool = False
    positions: str = "absolute"
    rope_theta: dict[str, float] = field(default_factory=dict)
    layer_types: tuple[str, ...] = ()
    local_attention: int | None = None
    glu: bool = False
    attention_bias: bool = True
    mlp_bias: bool = True
    norm_bias: bool = True
    embedding_dropout: float = 0.0
    attention_dropout: float = 0.0
    attention_output_dropout: float = 0.0
    ffn_dropout: float = 0.0
    glu_dropout: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        families.get(self.model_type)  # raises for a model type no family runs
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.num_hidden_layers % self.num_hidden_groups:
            raise ValueError("num_hidden_layers must be a multiple of num_hidden_groups")
        self._check_architecture()

    def _check_architecture(self) -> None:
        """The combinations fastbert's layers implement: post-LN with absolute positions (BERT and relatives), or
        pre-LN with rotary positions, a GLU FFN and a final norm (ModernBERT)."""
        if self.norm_placement not in ("post", "pre"):
            raise ValueError(f"norm_placement must be 'post' or 'pre', got {self.norm_placement!r}")
        if self.positions not in ("absolute", "rotary"):
            raise ValueError(f"positions must be 'absolute' or 'rotary', got {self.positions!r}")
        pre = self.norm_placement == "pre"
        if pre != (self.positions == "rotary") or pre != self.glu or pre != self.final_norm:
            raise ValueError("fastbert runs post-LN layers with absolute positions, or pre-LN layers with rotary "
                             "positions, a GLU FFN and a final LayerNorm; got norm_placement="
                             f"{self.norm_placement!r}, positions={self.positions!r}, glu={self.glu}, "
                             f"final_norm={self.final_norm}")
        if self.layer_types:
            self.layer_types = tuple(self.layer_types)
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"layer_types {unknown} are not supported; supported: {list(LAYER_TYPES)}")
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, num_hidden_layers is "
                                 f"{self.num_hidden_layers}")
            if "sliding_attention" in self.layer_types and (self.local_attention is None or self.local_attention < 0):
                raise ValueError(f"sliding_attention layers need local_attention >= 0, got {self.local_attention!r}")
        if self.positions == "rotary":
            if self.head_dim % 2:
                raise ValueError(f"rotary positions need an even head dimension, got {self.head_dim}")
            kinds = set(self.layer_types or ("full_attention",))
            missing = sorted(kinds - set(self.rope_theta))
            if missing:
                raise ValueError(f"rotary positions: no rope_theta for the layer types {missing}")
            bad = [kind for kind in kinds if not self.rope_theta[kind] > 0]
            if bad:
                raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if self.shared_layers and pre:
            raise ValueError("pre-LN layers are not shared across depth in any supported family")

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s attention window (total width, as `fastbert.ops.attention` takes it); None: global."""
        if self.layer_types and self.layer_types[index] == "sliding_attention":
            return self.local_attention
        return None

    def window_reach(self) -> int | None:
        """How many positions each side the narrowest sliding window reaches (``window // 2``); None: no layer
        slides."""
        windows = [self.layer_window(index) for index in range(self.num_hidden_layers)]
        return min((window // 2 for window in windows if window is not None), default=None)

    def window_narrower_than(self, seqlen: int) -> bool:
        """Whether a sliding window reaches fewer than ``seqlen - 1`` positions each side: in a padded batch of
        ``seqlen`` positions, a padded position's window may then hold no token."""
        reach = self.window_reach()
        return reach is not None and reach < seqlen - 1

    def layer_theta(self, index: int) -> float | None:
        """Layer ``index``'s RoPE theta (rotary positions), else None."""
        if self.positions != "rotary":
            return None
        return self.rope_theta[self.layer_types[index] if self.layer_types else "full_attention"]

    @property
    def family(self) -> str:
        return families.get(self.model_type).name

    @property
    def activation(self) -> str:
        """The encoder FFN activation, as a `fastbert.ops.linear_activation` name."""
        return ACTIVATIONS[self.hidden_act]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def position_offset(self) -> int | None:
        """RoBERTa-style position ids start after the padding index; None for absolute arange positions."""
        return self.pad_token_id + 1 if families.get(self.model_type).offset_positions else None

    @property
    def token_positions(self) -> int:
        """The most tokens one sequence may hold: the position table less RoBERTa's offset."""
        return self.max_position_embeddings - (self.position_offset or 0)

    @property
    def num_unique_layers(self) -> int:
        return self.num_hidden_groups * self.inner_group_num if self.shared_layers else self.num_hidden_layers

    def layer_schedule(self) -> list[int]:
        """Indices of the unique layers applied in order (ALBERT repeats its groups across depth)."""
        if not self.shared_layers:
            return list(range(self.num_hidden_layers))
        schedule = []
        for depth in range(self.num_hidden_layers):
            group = int(depth / (self.num_hidden_layers / self.num_hidden_groups))
            schedule.extend(group * self.inner_group_num + j for j in range(self.inner_group_num))
        return schedule

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> FastBertConfig:
        """Normalise an HF config dict of any supported family onto fastbert's fields."""
        model_type = raw.get("model_type")
        if model_type is None:
            raise ValueError("config.json has no 'model_type'; cannot tell which BERT-family model this is")
        family = families.get(model_type)  # raises for a model type no family runs
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise ValueError("fastbert runs encoders only: is_decoder / add_cross_attention are not supported")
        position_type = raw.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type {position_type!r} is not supported (only 'absolute')")
        num_labels = raw.get("num_labels", len(raw.get("id2label", {}) or {}) or 2)
        common = dict(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 512),
            pad_token_id=raw.get("pad_token_id") if raw.get("pad_token_id") is not None else 0,
            num_labels=num_labels,
            problem_type=raw.get("problem_type"),
            extra=raw,
        )
        return cls(**family.config_fields(raw), **common)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> FastBertConfig:
        with open(path, encoding="utf-8") as handle:
            try:
                raw = json.load(handle)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not the object of a model's configuration")
        return cls.from_hf_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        return out
