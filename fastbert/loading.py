"""Loading HF checkpoints of the BERT family into fastbert, without importing transformers.

`encoder_key_map` names, for each fastbert encoder parameter, the HF keys it is made of (Q, K and V are three
keys concatenated into one packed weight). The same map serves `from_pretrained` (tensors from a checkpoint file)
and `fastbert.optimize` (parameters shared with a live transformers module); the names are each family's, from
`fastbert.families`.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import torch

from fastbert import backends, families
from fastbert.config import FastBertConfig
from fastbert.cuda_graphs import enable_on_cuda
from fastbert.devices import checked_device
from fastbert.heads import build_task_model, head_key_map, redundant_checkpoint_keys
from fastbert.model import FastBertModel
from fastbert.quantization import PRECISIONS, precision_for, quantize_int8

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARD_INDEX_SUFFIX = ".index.json"  # what save_pretrained writes beside the shards of a large checkpoint
# Non-persistent buffers that older checkpoints saved; they carry no weights.
_IGNORED_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: a file missing, keys missing or unexpected, wrong shapes."""


def _module_params(ours: str, theirs: str, bias: bool = True) -> list[tuple[str, list[str]]]:
    """fastbert's ``<ours>_weight`` (and ``<ours>_bias``) from the HF module ``theirs``."""
    return [(f"{ours}_weight", [f"{theirs}.weight"])] + ([(f"{ours}_bias", [f"{theirs}.bias"])] if bias else [])


def encoder_key_map(config: FastBertConfig, prefix: str = "") -> list[tuple[str, list[str]]]:
    """[(fastbert key, [HF keys concatenated along dim 0])] for the encoder, HF keys under ``prefix``. Biases
    appear where the config says the modules have them (`FastBertConfig.attention_bias` / ``mlp_bias`` /
    ``norm_bias``); pre-LN's first layer has no attention norm (it reads the embedding LayerNorm's output)."""
    p = prefix
    family = families.get(config.model_type)
    emb = {part: f"{p}{name}" for part, name in family.embedding_params.items()}
    pairs = [("embeddings.word_embeddings", [f"{emb['word']}.weight"])]
    if config.positions == "absolute":
        pairs.append(("embeddings.position_embeddings", [f"{emb['position']}.weight"]))
    pairs += _module_params("embeddings.norm", emb["norm"], config.norm_bias)
    if config.type_vocab_size:
        pairs.append(("embeddings.token_type_embeddings", [f"{emb['token_type']}.weight"]))
    if config.embedding_size != config.hidden_size:
        proj = f"{p}{family.embed_proj}"
        pairs += [("embed_proj.weight", [f"{proj}.weight"]), ("embed_proj.bias", [f"{proj}.bias"])]
    biases = {"qkv": config.attention_bias, "attn_out": config.attention_bias, "attn_norm": config.norm_bias,
              "ffn_in": config.mlp_bias, "ffn_out": config.mlp_bias, "ffn_norm": config.norm_bias}
    for index in range(config.num_unique_layers):
        ours = f"layers.{index}."
        layer = f"{p}{family.layer(config, index)}."
        names = {role: layer + name for role, name in family.layer_params.items()}
        packed = [names[families.PACKED_QKV_ROLE]] if families.PACKED_QKV_ROLE in names else [names[n] for n in "qkv"]
        pairs.append((f"{ours}qkv_weight", [f"{name}.weight" for name in packed]))
        if biases["qkv"]:
            pairs.append((f"{ours}qkv_bias", [f"{name}.bias" for name in packed]))
        for role in ("attn_out", "attn_norm", "ffn_in", "ffn_out", "ffn_norm"):
            if role == "attn_norm" and config.norm_placement == "pre" and index == 0:
                continue
            pairs += _module_params(f"{ours}{role}", names[role], biases[role])
    if config.final_norm:
        pairs += _module_params("final_norm", f"{p}{family.final_norm}", config.norm_bias)
    if config.has_pooler:
        pooler = f"{p}{family.pooler}"
        pairs += [("pooler.weight", [f"{pooler}.weight"]), ("pooler.bias", [f"{pooler}.bias"])]
    return pairs


def _rename_legacy(key: str) -> str:
    """TF-era checkpoints name LayerNorm parameters gamma/beta."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


def read_state_dict(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint directory: its `weight_files`, one file or every shard."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        state.update((_rename_legacy(k), v) for k, v in _read_weights_file(path).items())
    return state


def weight_files(directory: str | os.PathLike) -> list[Path]:
    """The files holding a checkpoint's tensors: model.safetensors, else the shards its index names, else the same
    for pytorch_model.bin. CheckpointError when there are none, or the index is broken or names a missing shard."""
    directory = Path(directory)
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return [directory / name]
        index = directory / (name + SHARD_INDEX_SUFFIX)
        if index.is_file():
            return _shard_files(index)
    expected = [n for name in WEIGHT_FILES for n in (name, name + SHARD_INDEX_SUFFIX)]
    raise CheckpointError(f"{directory} holds no weights: expected one of {', '.join(expected)}")


def _shard_files(index: Path) -> list[Path]:
    """The shards a sharded checkpoint's index maps tensors to, each once, in their names' order."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{index} is not a readable shard index (a JSON object with a 'weight_map' of tensor "
                              f"names to files): {type(err).__name__}: {err}") from err
    if not names:
        raise CheckpointError(f"{index}: its weight_map names no shard file")
    suffix = index.name.removesuffix(SHARD_INDEX_SUFFIX).rsplit(".", 1)[-1]  # safetensors or bin
    odd = [n for n in names if not (isinstance(n, str) and n == Path(n).name and n.endswith(f".{suffix}"))]
    if odd:
        raise CheckpointError(f"{index}: its weight_map must name .{suffix} shard files in the same directory, "
                              f"not {odd[0]!r}")
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise CheckpointError(f"{index} names {len(missing)} shard(s) that are not there: {', '.join(missing[:3])}")
    return [index.parent / n for n in names]


def _read_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one weights file; CheckpointError, with the reader's first line, for a broken one."""
    if path.name.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except SafetensorError as err:
            raise CheckpointError(f"{path} is not a readable safetensors file: {str(err)[:200]}") from err
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:  # (its message is a page on weights_only)
        raise CheckpointError(f"{path} is not a torch checkpoint holding only tensors (torch.load(weights_only=True) "
                              "refused it)") from err
    except (EOFError, RuntimeError) as err:  # an empty or truncated file
        reason = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise CheckpointError(f"{path} is not a readable torch checkpoint: {reason}") from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    return state


def detect_prefix(config: FastBertConfig, keys) -> str:
    """'bert.' for a checkpoint saved from a task class, '' for one saved from the bare base model."""
    prefix = families.get(config.model_type).base_prefix + "."
    return prefix if any(k.startswith(prefix + "embeddings.") for k in keys) else ""


def map_state_dict(pairs: list[tuple[str, list[str]]], source: dict[str, torch.Tensor],
                   expected_shapes: dict[str, torch.Size], where: str) -> dict[str, torch.Tensor]:
    """Assemble fastbert tensors from HF ones; raises CheckpointError listing every missing key or bad shape."""
    out, missing, bad = {}, [], []
    for ours, theirs in pairs:
        absent = [k for k in theirs if k not in source]
        if absent:
            missing.extend(absent)
            continue
        tensor = source[theirs[0]] if len(theirs) == 1 else torch.cat([source[k] for k in theirs], dim=0)
        if tensor.shape != expected_shapes[ours]:
            bad.append(f"{' + '.join(theirs)}: {tuple(tensor.shape)}, expected {tuple(expected_shapes[ours])}")
            continue
        out[ours] = tensor
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if bad:
        problems.append("wrong shapes: " + "; ".join(bad[:20]))
    if problems:
        raise CheckpointError(f"{where}: " + " | ".join(problems))
    return out


def unexpected_keys(source: dict[str, torch.Tensor], used: set[str]) -> list[str]:
    return sorted(k for k in source if k not in used and not k.endswith(_IGNORED_SUFFIXES))


def from_pretrained(
    path: str | os.PathLike,
    task: str | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    backend: str = "auto",
    cuda_graphs: bool = True,
    require_head: bool = False,
) -> torch.nn.Module:
    """Build fastbert's model from an HF checkpoint directory (config.json + model.safetensors or
    pytorch_model.bin, either one file or the shards of a ``.index.json``), offline and without transformers.
    ``device``: the CPU or a CUDA GPU torch sees; anything else (a missing GPU, mps) is a ValueError
    (`fastbert.devices.checked_device`).

    task: None for the bare encoder (`FastBertModel`), else one of `fastbert.heads.TASKS`. Encoder keys that are
    missing, or tensors of the wrong shape, raise `CheckpointError`; checkpoint keys fastbert does not use are
    reported in a warning and in ``model.loading_info``; head keys that are missing (a base checkpoint loaded for
    fine-tuning) are initialised randomly and reported the same way, or raise `CheckpointError` with
    ``require_head`` (a server, which would answer with an untrained head).

    dtype: a torch dtype or its name (None: float32); "int8": the encoder's GEMMs int8 for CPU inference
    (`fastbert.quantization.quantize_int8`); "auto": bfloat16 on a CPU where it is faster than float32 (AMX, or
    AVX-512 BF16 measured faster: `fastbert.quantization.auto_cpu_dtype`), float32 on other CPUs, float16 on
    CUDA, the choice and its reason warned once.

    cuda_graphs: with ``device`` a CUDA device, inference calls (eval mode, grad mode off: under
    ``torch.inference_mode()``) replay CUDA graphs of the packed encoder, one per bucket of shapes
    (`fastbert.cuda_graphs`); False launches every op. On CPU it does nothing.
    """
    backends.requested_backend(backend)  # an unknown name or a missing GPU fails before the checkpoint is read
    device = checked_device(device) if device is not None else None
    dtype, quantize = _resolve_dtype(dtype, device)
    directory = Path(path)
    config, source = _read_checkpoint(directory)
    prefix = detect_prefix(config, source)
    if task is None and not any(k.startswith(f"{prefix}pooler") for k in source):
        config.has_pooler = False  # saved without one (e.g. from a masked-LM class): no pooler_output
    model, required, optional = _model_and_key_map(config, task, prefix, backend)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    present = [(ours, theirs) for ours, theirs in optional if all(k in source for k in theirs)]
    missing_head = [theirs[0] for ours, theirs in optional if not all(k in source for k in theirs)]
    if require_head and missing_head:
        raise CheckpointError(f"{directory}: no trained {task} head ({', '.join(missing_head[:6])} missing): it is "
                              f"not a {task} checkpoint (fine-tune one first, e.g. with fastbert finetune)")
    state = map_state_dict(required + present, source, shapes, str(directory))
    used = {k for _, theirs in required + present for k in theirs}
    if task is not None:  # tied copies (a decoder's view of the word embeddings) are not unused weights
        used.update(redundant_checkpoint_keys(config, task))
    extra = unexpected_keys(source, used)
    model.load_state_dict(state, strict=False)
    _initialise_missing(model, state, config.extra.get("initializer_range", 0.02))
    model.loading_info = {"unexpected_keys": extra, "missing_head_keys": missing_head}
    _warn_about_keys(directory, task, extra, missing_head)
    model.to(device=device, dtype=dtype)
    if quantize:
        quantize_int8(model)
    if cuda_graphs:
        enable_on_cuda(model)
    return model.eval()


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | None) -> tuple[torch.dtype | None, bool]:
    """(the dtype to cast the model to, whether to quantize it to int8) for `from_pretrained`'s ``dtype``:
    torch.int8 means "int8"; ValueError for any other dtype that is not floating."""
    if dtype == torch.int8:
        dtype = "int8"
    if isinstance(dtype, str) and dtype in PRECISIONS:
        name, _ = precision_for(dtype, device or "cpu")
        return (torch.float32, True) if name == "int8" else (getattr(torch, name), False)
    if dtype is None:
        return None, False
    found = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype  # a floating dtype by name: "float64"
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating dtype; use one of {', '.join(PRECISIONS)} or a torch "
                         "floating dtype (or its name)")
    return found, False


def _read_checkpoint(directory: Path) -> tuple[FastBertConfig, dict[str, torch.Tensor]]:
    """(config, tensors) of a checkpoint directory; CheckpointError when it is not one."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    return FastBertConfig.from_json_file(config_path), read_state_dict(directory)


def _model_and_key_map(config: FastBertConfig, task: str | None, prefix: str, backend: str):
    """(model, required pairs, optional pairs): the model to load, with the (fastbert key, [checkpoint keys]) pairs
    a checkpoint must hold and those it may lack (the head, and the pooler: HF initialises both when absent)."""
    if task is None:
        model = FastBertModel(config, backend=backend)
        encoder, own_prefix, head_pairs = model, "", []
    else:
        model = build_task_model(config, task, backend=backend)
        encoder, own_prefix = model.encoder, "encoder."
        head_pairs = head_key_map(config, task)
    # The task model's encoder has a pooler only where its head reads one: map the encoder as built.
    encoder_pairs = [(own_prefix + ours, theirs) for ours, theirs in encoder_key_map(encoder.config, prefix)]
    optional = head_pairs + [pair for pair in encoder_pairs if pair[0].startswith(own_prefix + "pooler.")]
    required = [pair for pair in encoder_pairs if pair not in optional]
    return model, required, optional


def _initialise_missing(model: torch.nn.Module, loaded: dict[str, torch.Tensor], initializer_range: float) -> None:
    """HF's initialisation for the parameters the checkpoint did not hold (a head absent from it): zero biases,
    unit norm weights, normal(0, initializer_range) matrices."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in loaded:
                continue
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                param.normal_(0.0, initializer_range)


def _warn_about_keys(directory: Path, task: str | None, extra: list[str], missing_head: list[str]) -> None:
    if extra:
        warnings.warn(f"{directory}: {len(extra)} checkpoint keys unused by fastbert ({task or 'encoder'}): "
                      f"{', '.join(extra[:10])}" + (" ..." if len(extra) > 10 else ""), stacklevel=3)
    if missing_head:
        warnings.warn(f"{directory}: no weights for the {task} head ({', '.join(missing_head[:6])}); initialised "
                      "randomly: fine-tune before use", stacklevel=3)
