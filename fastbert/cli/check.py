"""``fastbert check``: fastbert against transformers on one checkpoint and a batch of real sentences (random token
ids when the checkpoint has no tokenizer); PASS/FAIL by `fastbert.numerics`' rule, exit status 1 on FAIL."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import torch

from fastbert import numerics
from fastbert.bench import report
from fastbert.bench.workloads import Workload
from fastbert.cli import shared
from fastbert.common.resolve import UserError, resolve_device, resolve_dtype, resolve_model
from fastbert.common.text import SENTENCES, TextEncoder, has_tokenizer_files, mean_pool

if TYPE_CHECKING:
    from fastbert.config import FastBertConfig


def check_rule(dtype: torch.dtype, fast_err: float, hf_err: float | None, ref_scale: float) -> tuple[bool, str]:
    """PASS/FAIL of one output by `fastbert.numerics`' rule, the one the kernel tests apply, with transformers as
    plain PyTorch and its float32 output as the reference. float32: max|fastbert - HF| / max|HF| <= 1e-4 (a whole
    model); float16/bfloat16: err(fastbert) <= 2 x err(HF in the same dtype) + HALF_ATOL_REL[dtype] x max|HF|."""
    return numerics.judge(dtype, fast_err, hf_err, ref_scale, fp32_rel=numerics.FP32_MODEL_REL, plain_name="HF")


def run(args: argparse.Namespace) -> int:
    """Print the error table, the embeddings' agreement and the backends used; 0 on PASS, 1 on FAIL."""
    model_dir, config = resolve_model(args.model)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or "float32", device)
    shared.need_transformers("check")
    batch, source = check_batch(model_dir, config, device)
    mask = batch["attention_mask"].bool()
    seen: dict = {}
    # fastbert first, before anything is printed: its errors (a checkpoint it cannot load, a backend that cannot run
    # on the device) name what is wrong
    fast = shared.load_fastbert(model_dir, dtype, device, args.backend)
    ours = outputs(fast, batch, seen)
    print(f"fastbert check: {shared.model_line(model_dir, config, device, dtype)}")
    print(f"{source} padded to {batch['input_ids'].shape[1]} tokens ({int(mask.sum())} real); reference: "
          "transformers AutoModel (eager) in float32; hidden states compared at real tokens only\n")
    reference_model = shared.load_hf_model(model_dir, torch.float32, device)
    reference = outputs(reference_model, batch)
    broken = [name for name, tensor in reference_model.state_dict().items()
              if tensor.is_floating_point() and not tensor.isfinite().all()]
    if broken:  # the comparison below fails on transformers' own nan: say where it comes from
        more = f" and {len(broken) - 3} more" if len(broken) > 3 else ""
        print(f"the checkpoint's weights hold nan or inf: {', '.join(broken[:3])}{more} (transformers' output is not "
              "finite either)\n")
    hf_same = outputs(shared.load_hf_model(model_dir, dtype, device), batch) if dtype != torch.float32 else None
    untrained = untrained_pooler(reference, hf_same, fast)
    rows, passed = compare(reference, hf_same, ours, mask, dtype)
    headers = ("output", "max abs err", "mean abs err", f"HF {str(dtype)[6:]} err", "rule", "result")
    print(report.format_table(headers, rows))
    if untrained:
        print(untrained)
    ref_emb = mean_pool(reference["last_hidden_state"], batch["attention_mask"])
    our_emb = mean_pool(ours["last_hidden_state"], batch["attention_mask"])
    print(f"\nsentence embeddings (mean pooling, normalised): min cosine {float((ref_emb * our_emb).sum(1).min()):.6f}")
    if "pooler_output" in reference and "pooler_output" in ours:
        cosine = torch.nn.functional.cosine_similarity(reference["pooler_output"], ours["pooler_output"], dim=1)
        print(f"pooler_output: min cosine {float(cosine.min()):.6f}")
    for line in shared.backend_lines(seen):
        print(line)
    print("\nPASS" if passed else "\nFAIL")
    return 0 if passed else 1


def check_batch(model_dir: str, config: FastBertConfig, device: torch.device) -> tuple[dict, str]:
    """The inputs (SENTENCES, or random token ids without a usable tokenizer) and a description of them. A tokenizer
    that cannot be read is named: the model is still checked, but `embed` and `serve` would refuse the checkpoint."""
    try:
        return TextEncoder(model_dir, config)(SENTENCES, device), f"{len(SENTENCES)} English sentences"
    except UserError as err:  # the model is still checked, on random token ids
        why = "no tokenizer in the checkpoint"
        if has_tokenizer_files(model_dir):
            why = "the checkpoint's tokenizer cannot be read; fastbert embed and serve refuse it"
            sys.stderr.write(f"fastbert check: warning: {err}\n")
        seqlen = min(32, config.token_positions)
        lengths = torch.linspace(1, seqlen, len(SENTENCES)).round().long().tolist()
        batch = Workload("check", len(lengths), seqlen, lengths, True).inputs(config, device)
        return batch, f"{len(lengths)} random token sequences ({why})"


def untrained_pooler(reference: dict[str, torch.Tensor], hf_same: dict[str, torch.Tensor] | None,
                     fast: torch.nn.Module) -> str | None:
    """For a checkpoint without pooler weights (saved from a masked-LM class, say), transformers' AutoModel adds a
    pooler initialised at random, and fastbert has none: its pooler_output is dropped from the comparison, and the
    line that says so is returned."""
    if "pooler_output" not in reference or fast.config.has_pooler:
        return None
    for found in (reference, hf_same or {}):
        found.pop("pooler_output", None)
    return ("pooler_output: not compared: the checkpoint holds no pooler weights (transformers initialises a pooler "
            "at random; fastbert has none)")


def outputs(model: torch.nn.Module, batch: dict, seen: dict | None = None) -> dict[str, torch.Tensor]:
    """The model's last_hidden_state (and pooler_output when it has one) in float32."""
    out = shared.forward(model, batch, seen)
    found = {"last_hidden_state": out.last_hidden_state.float()}
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        found["pooler_output"] = pooled.float()
    return found


def compare(reference: dict[str, torch.Tensor], hf_same: dict[str, torch.Tensor] | None,
            ours: dict[str, torch.Tensor], mask: torch.Tensor, dtype: torch.dtype) -> tuple[list[list[str]], bool]:
    """One table row per reference output (hidden states at real tokens only) and whether all of them pass."""
    rows, passed = [], True
    for name, ref in reference.items():
        if name not in ours:
            rows.append([name, "-", "-", "-", "-", "FAIL: fastbert gives no " + name])
            passed = False
            continue
        keep = mask if name == "last_hidden_state" else slice(None)
        if not ref[keep].isfinite().all():
            rows.append([name, "-", "-", "-", "-", "FAIL: transformers' own float32 output is not finite"])
            passed = False
            continue
        diff = (ours[name][keep] - ref[keep]).abs()
        hf_err = float((hf_same[name][keep] - ref[keep]).abs().max()) if hf_same is not None else None
        ok, why = check_rule(dtype, float(diff.max()), hf_err, float(ref[keep].abs().max()))
        passed &= ok
        rows.append([name, f"{float(diff.max()):.2e}", f"{float(diff.mean()):.2e}",
                     "-" if hf_err is None else f"{hf_err:.2e}", why, "PASS" if ok else "FAIL"])
    return rows, passed
