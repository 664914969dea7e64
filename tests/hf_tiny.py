"""Tiny random transformers models of every supported family, and the error metric the tests share."""

from __future__ import annotations

import torch
import transformers

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


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = 1e-6) -> float:
    """max |actual - expected| / max(max |expected|, floor): one number per tensor."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).abs().max() / max(float(expected.abs().max()), floor))
