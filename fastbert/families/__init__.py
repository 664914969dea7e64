"""The model families fastbert runs: one module per family, each registering one `Family`.

A `Family` is everything that is particular to one transformers architecture: how its ``config.json`` maps onto
`fastbert.config.FastBertConfig`, the names of its parameters in a checkpoint and in a live transformers model
(the key map `fastbert.loading.encoder_key_map` builds, which `fastbert.optimize` also walks), the module paths
`fastbert.optimize` reads, and its task heads (`fastbert.heads`). The shared code looks the family up here by the
config's ``model_type`` and holds no per-family branch.

Adding a family: a new module here that calls `register(Family(...))`, and one import line at the end of this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig
    from fastbert.heads import DenseSpec, MLMSpec

    HeadTable = dict[str, dict[str, MLMSpec | DenseSpec]]

# The parts of an encoder layer that `Family.layer_params` names (fastbert's parameters are "<role>_weight" and
# "<role>_bias", except q/k/v, which are concatenated into "qkv_weight"/"qkv_bias"). A family whose checkpoints
# hold Q, K and V as one packed Linear (ModernBERT's Wqkv) names it as the role "qkv" instead of q, k and v.
LAYER_ROLES = ("q", "k", "v", "attn_out", "attn_norm", "ffn_in", "ffn_out", "ffn_norm")
PACKED_QKV_ROLE = "qkv"
# The embedding parts that `Family.embedding_params` names: the tables ("word", "position", "token_type": the
# nn.Embedding modules) and the LayerNorm after their sum ("norm"). BERT's names are the default.
BERT_EMBEDDING_PARAMS = {"word": "embeddings.word_embeddings", "position": "embeddings.position_embeddings",
                         "token_type": "embeddings.token_type_embeddings", "norm": "embeddings.LayerNorm"}
# The dropout sites of fastbert's encoder (`fastbert.model`) that `Family.dropout_sites` may name: "embedding" on the
# embedding LayerNorm's output; per layer "attention" (the attention probabilities), "attention_output" and "ffn"
# (each output projection's result, before the residual add) and "glu" (the GLU's output, before the FFN output).
DROPOUT_SITES = ("embedding", "attention", "attention_output", "glu", "ffn")
BERT_DROPOUT_SITES = {"embedding": "embeddings.dropout", "attention": "attention.self:dropout.p",
                      "attention_output": "attention.output.dropout", "ffn": "output.dropout"}


def _no_check(config: FastBertConfig, task: str) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """What is particular to one model family. Module paths are relative to the base model (``BertModel``); in a
    checkpoint saved from a task class they sit under ``base_prefix + "."``."""

    name: str
    # The ``model_type`` values of config.json that this family runs (MiniLM and bge declare "bert").
    model_types: tuple[str, ...]
    # The base model's attribute name in transformers' task classes ("bert" in BertForMaskedLM.bert).
    base_prefix: str
    # config.json dict -> the FastBertConfig fields of the architecture (sizes, activation, eps, embedding size,
    # layer sharing, pooler); the fields every family shares (vocabulary, positions, labels) are read by
    # `FastBertConfig.from_hf_dict`.
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]
    # (config, index of a unique layer) -> the path of that layer ("encoder.layer.3").
    layer: Callable[[FastBertConfig, int], str]
    # role (`LAYER_ROLES`, or "qkv" in place of q/k/v) -> the Linear / LayerNorm module of that role, under the
    # layer. Which of them hold a bias, and whether pre-LN's first layer has an attention norm, is the config's
    # (`FastBertConfig.attention_bias` / `mlp_bias` / `norm_bias` / `norm_placement`).
    layer_params: Mapping[str, str]
    # The attention module (it holds the number of heads and the scaling), under the layer.
    attention: str
    # The FFN's activation module, under the layer.
    ffn_activation: str
    # task -> {attribute name: head spec} (`fastbert.heads.MLMSpec` / `DenseSpec`); its keys are the tasks the
    # family offers. A pretraining table with a "discriminator" head is ELECTRA-style replaced-token detection.
    heads: Callable[[FastBertConfig], HeadTable]
    # The ModuleList of layers, whose length transformers' forward uses as the depth; None when the forward reads
    # the depth from the config on every call instead (`live_config`).
    layer_list: str | None = "encoder.layer"
    # Config attributes that transformers' modules read on every call (ALBERT's layer count and sharing).
    live_config: tuple[str, ...] = ()
    # The Linear that projects factorised embeddings (E) to the hidden size (H), when E != H.
    embed_proj: str = "embeddings_project"
    # The pooler's Linear (first token -> dense -> tanh).
    pooler: str = "pooler.dense"
    # RoBERTa's positions: ids start at pad_token_id + 1 and skip padding tokens (the embeddings' padding_idx).
    offset_positions: bool = False
    # The embedding modules by part ("word", "position", "token_type", "norm"); a family without a position or
    # token type table (rotary positions, `type_vocab_size == 0`) leaves those parts unused.
    embedding_params: Mapping[str, str] = field(default_factory=lambda: dict(BERT_EMBEDDING_PARAMS))
    # The LayerNorm after the last layer (pre-LN stacks: `FastBertConfig.final_norm`), when the family has one.
    final_norm: str | None = None
    # (config, task) -> raises ValueError for a head configuration the family's table cannot express.
    check_task: Callable[[FastBertConfig, str], None] = field(default=_no_check)
    # Where transformers' modules apply dropout, by site (`DROPOUT_SITES`; a site not named has none): the
    # embedding site's path is under the base model, the others under each layer. "a.b" names an nn.Dropout module
    # (its p, while that module is in training mode; an nn.Identity there drops nothing); "a:b.p" the module "a"
    # and the attribute path "b.p" that holds p, applied while "a" is in training mode (transformers passes the
    # attention probabilities' p to its attention function this way). `fastbert.optimize` reads them on every call:
    # the modules win over the config they were built from.
    dropout_sites: Mapping[str, str] = field(default_factory=lambda: dict(BERT_DROPOUT_SITES))


_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` the one that runs each of its model types."""
    taken = [t for t in family.model_types if t in _REGISTRY and _REGISTRY[t].name != family.name]
    if taken:
        raise ValueError(f"model types {taken} are already registered (family {_REGISTRY[taken[0]].name!r})")
    roles = set(family.layer_params)
    if PACKED_QKV_ROLE in roles:  # one packed Linear stands for q, k and v
        roles |= {"q", "k", "v"}
    missing = [role for role in LAYER_ROLES if role not in roles]
    if missing:
        raise ValueError(f"family {family.name!r} names no module for the layer roles {missing}")
    unknown = sorted(set(family.dropout_sites) - set(DROPOUT_SITES))
    if unknown:
        raise ValueError(f"family {family.name!r} names unknown dropout sites {unknown}")
    for model_type in family.model_types:
        _REGISTRY[model_type] = family
    return family


def get(model_type: str) -> Family:
    """The family that runs ``model_type``; ValueError (listing the supported ones) when none does."""
    family = _REGISTRY.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not supported by fastbert; supported: {sorted(_REGISTRY)}")
    return family


def model_types() -> dict[str, str]:
    """model_type -> family name, for every registered model type."""
    return {model_type: family.name for model_type, family in _REGISTRY.items()}


# The families: one line each (each module registers its family when imported).
from fastbert.families import (  # noqa: E402 - the modules import Family and register from above
    albert,  # noqa: F401
    bert,  # noqa: F401
    distilbert,  # noqa: F401
    electra,  # noqa: F401
    modernbert,  # noqa: F401
    roberta,  # noqa: F401
)
