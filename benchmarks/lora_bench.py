"""CPU benchmark of a PEFT LoRA fine-tuning step: one training step (zero_grad, forward with the head's loss,
backward, AdamW step over the trainable parameters only) of BertForSequenceClassification (2 labels) wrapped by
``peft.get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=R, lora_alpha=2*R, lora_dropout=D,
target_modules=T))``, through PEFT on transformers (eager and SDPA attention) and through fastbert.optimize of the
PEFT model, same weights, same adapter and same batch, interleaved; then a forward-only section: the optimized PEFT
model with its adapter unmerged against the same model merged (``merge_and_unload()``) and optimized.

Models: random weights, transformers' seeded initialisation, saved once per (size, dropout) and loaded by every
runner (``train_bench.save_checkpoint``): ``minilm`` (H 384, 6 layers, 12 heads, inner 1536), ``base`` (H 768,
12 layers, 12 heads, inner 3072) and ``tiny`` (smoke tests), vocabulary 30522 (512 for tiny).

Cases: ``SIZE:fixed|varlen:rR:TARGETS[:nodropout]``, e.g. ``minilm:varlen:r8:qkvd``. Batches as in
train_bench: ``fixed`` (--batch x --seqlen, every token real) or ``varlen`` (seeded lengths uniform in
[0.2, 1.0] x seqlen, the first full, padded). TARGETS:
- ``attn``: ["query", "key", "value"];
- ``qkvd``: ["query", "key", "value", "dense"]. In BERT's module names "dense" is attention.output.dense,
  intermediate.dense, output.dense and also pooler.dense, so ``qkvd`` adapts every nn.Linear of BertModel: the
  issue's "q/k/v/dense" and "all linears" are the same set for BERT, hence no separate ``all``. The classifier is
  not a LoRA target: task_type SEQ_CLS trains a full copy of it (PEFT's modules_to_save).
Dropout: 0.1 for LoRA (lora_dropout) and for the model (hidden and attention-probability dropout, BERT's config),
or 0 for both with ``nodropout`` (what the exact loss and gradient checks need).

The adapter: ``init_lora_weights=False`` (PEFT's random A and B), seeded before get_peft_model and then copied by
name from the first runner built into the others, so every runner starts from the same adapter and classifier. With
PEFT's default B = 0 the adapter would be a no-op at the start and lora_A's gradients exactly zero, so the checks
would not see the adapter's path; the cost of a step is the same either way.

Runners, each its own model from the checkpoint and its own AdamW (lr 1e-4, weight decay 0.01) over the trainable
parameters (LoRA A/B and the classifier copy): ``peft-eager`` (PEFT on transformers' attn_implementation="eager"),
``peft-sdpa`` (the same on "sdpa") and ``fastbert`` (PEFT on eager, then ``fastbert.optimize(peft_model)``).

Per case, before timing (untimed, at the initial weights, no optimizer step): one forward + backward per runner,
recording
- the loss and every trainable gradient by name against peft-eager's (dropout-off cases only: with dropout on each
  runner draws its own masks): |loss - ref| / |ref|, and per parameter max|g - g_ref| / max|g_ref|, the worst
  reported with its name;
- "activation memory saved for backward": the bytes of the distinct storages autograd saves for backward during
  that forward (``torch.autograd.graph.saved_tensors_hooks``), leaving out the storages of the model's own
  parameters and buffers (they are in memory anyway). Deterministic, unlike the RSS of a process; it counts what
  is saved through autograd (save_for_backward included), not what an op may keep elsewhere;
- for fastbert: ``fastbert.explain(peft_model, **batch)``, the fused ops that ran (`fastbert.bench.recording`) and
  the warnings of optimize and of the call. A runner whose call ran transformers' code (explain does not say
  fastbert's path, no fused op ran, or a warning "fastbert: this call runs transformers' code") is marked "fell
  back" and never meets a target. Until fastbert runs PEFT LoRA layers itself, that is what happens.
Then --warmup untimed steps and --rounds rounds of one timed step per runner, the order rotated per round; median
and min wall time per step.

Inference (per size, batch kind, rank and targets; eval mode, torch.inference_mode, logits only, an
--infer-batch batch of the case's kind): ``fastbert-unmerged`` = fastbert.optimize(peft_model) with the adapter
unmerged, and ``fastbert-merged`` = fastbert.optimize(copy.deepcopy(peft_model).merge_and_unload()), same adapter,
interleaved rounds as above, their logits compared.

Targets (ratios of medians measured in the same run): fastbert's step against peft-sdpa >= 1.5x at minilm, r8,
qkvd (either batch kind, dropout on or off); fastbert against peft-eager and at the other cases: reported, no
target; inference: unmerged speed >= 0.95x merged speed, i.e. merged median / unmerged median >= 0.95 (met only
when neither fell back).

    .venv/bin/python benchmarks/lora_bench.py --threads 2 --out benchmarks/results/cpu-2core-lora
    .venv/bin/python benchmarks/lora_bench.py --cases tiny:varlen:r8:qkvd:nodropout --batch 2 --seqlen 16 \\
        --rounds 1 --warmup 0 --infer-batch 2x16

Writes <name>.json and <name>.md (default results.*) into --out. Not a test: the VM drifts +-30 % between runs.
Imports train_bench from its own folder (on sys.path when this file runs as a script).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import os
import statistics
import subprocess
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from train_bench import CPU, DROPOUT, SIZES, Runner, gradient_error, make_batch, make_workload, save_checkpoint

import fastbert
from fastbert.bench import peers
from fastbert.bench.machine import git_commit, machine_info, package_version
from fastbert.bench.recording import backends_used, record_backends
from fastbert.bench.report import format_table, interleaved_report, ratio_text, write_interleaved
from fastbert.bench.timing import time_ms
from fastbert.bench.workloads import Workload
from fastbert.cpu import cpu_info

TASK = "sequence-classification"
TARGET_MODULES = {"attn": ["query", "key", "value"], "qkvd": ["query", "key", "value", "dense"]}
RUNNERS = ("peft-eager", "peft-sdpa", "fastbert")  # peft-eager first: the reference of the checks
REFERENCE = "peft-eager"
INFER_RUNNERS = ("fastbert-unmerged", "fastbert-merged")
FALLBACK_WARNING = "fastbert: this call runs transformers' code"
LR = 1e-4
STEP_TARGET = ("minilm", 8, "qkvd", "peft-sdpa", 1.5)  # size, rank, targets, peer, needed speed-up of fastbert
INFER_TARGET = 0.95  # unmerged speed / merged speed
DEFAULT_CASES = ("minilm:varlen:r8:qkvd", "minilm:fixed:r8:qkvd", "minilm:varlen:r8:qkvd:nodropout",
                 "minilm:varlen:r16:qkvd", "minilm:varlen:r8:attn", "base:varlen:r8:qkvd", "base:varlen:r16:qkvd")


# ------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class LoraCase:
    """One timed case: model size, batch kind, LoRA rank and targets, dropout on or off."""

    size: str
    kind: str
    rank: int
    targets: str
    dropout: bool

    @classmethod
    def parse(cls, text: str) -> LoraCase:
        """'minilm:varlen:r8:qkvd' or 'base:fixed:r16:attn:nodropout'."""
        parts = text.split(":")
        ok = (len(parts) in (4, 5) and parts[0] in SIZES and parts[1] in ("fixed", "varlen")
              and parts[2][:1] == "r" and parts[2][1:].isdigit() and int(parts[2][1:]) > 0
              and parts[3] in TARGET_MODULES and (len(parts) == 4 or parts[4] == "nodropout"))
        if not ok:
            raise SystemExit(f"lora_bench: bad case {text!r}: SIZE:fixed|varlen:rRANK:TARGETS[:nodropout], SIZE one "
                             f"of {', '.join(SIZES)}, TARGETS one of {', '.join(TARGET_MODULES)}")
        return cls(parts[0], parts[1], int(parts[2][1:]), parts[3], len(parts) == 4)

    @property
    def adapter(self) -> str:
        return f"{self.size} {self.kind} r{self.rank} {self.targets}"

    @property
    def name(self) -> str:
        return self.adapter + ("" if self.dropout else ", dropout off")

    def lora_config(self) -> Any:
        import peft

        return peft.LoraConfig(task_type="SEQ_CLS", r=self.rank, lora_alpha=2 * self.rank,
                               lora_dropout=DROPOUT if self.dropout else 0.0,
                               target_modules=list(TARGET_MODULES[self.targets]), init_lora_weights=False)


# ------------------------------------------------------------------------------------------------- models
def fastbert_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    """The distinct fastbert warnings among ``caught``, shortened."""
    return sorted({str(w.message)[:400] for w in caught if "fastbert" in str(w.message)})


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def peft_model(directory: str, attn: str, case: LoraCase, seed: int,
               adapter: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """The checkpoint in ``directory`` (transformers, attention ``attn``) wrapped by get_peft_model, in train
    mode; its trainable parameters copied from ``adapter`` (name -> tensor) when given."""
    import peft
    import transformers

    base = peers.load_hf_model(directory, attn=attn, model_class=transformers.BertForSequenceClassification)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecations, seen by PEFT
        model = peft.get_peft_model(base, case.lora_config())
    if adapter is not None:
        params = trainable(model)
        if set(params) != set(adapter):
            differ = sorted(set(params) ^ set(adapter))
            raise RuntimeError(f"trainable parameters differ from the first runner's: {differ}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(adapter[name])
    return model.train()


def build_runner(key: str, directory: str, case: LoraCase, seed: int,
                 adapter: dict[str, torch.Tensor] | None) -> Runner:
    """``key``'s runner: the PEFT model (optimized for ``fastbert``) and AdamW over its trainable parameters; the
    fastbert warnings of the build go to notes["build_warnings"]."""
    attn = "sdpa" if key == "peft-sdpa" else "eager"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft_model(directory, attn, case, seed, adapter)
        if key == "fastbert":
            fastbert.optimize(model)
    notes = {"attn_implementation": attn, "build_warnings": fastbert_warnings(caught)}
    optimizer = torch.optim.AdamW(trainable(model).values(), lr=LR, weight_decay=0.01)
    return Runner(key, model, model, optimizer, hf_names=True, notes=notes)


def build_runners(directory: str, case: LoraCase, keys: list[str], seed: int,
                  failed: dict[str, str]) -> dict[str, Runner]:
    """The runners named by ``keys`` (in RUNNERS' order), all with the first one's adapter; a runner that cannot be
    built is recorded in ``failed`` instead."""
    runners: dict[str, Runner] = {}
    adapter = None
    for key in sorted(set(keys), key=RUNNERS.index):
        try:
            runners[key] = build_runner(key, directory, case, seed, adapter)
        except Exception as err:  # noqa: BLE001 - a runner that cannot be built is a result, not a crash
            failed[key] = f"build: {type(err).__name__}: {err}"[:600]
            continue
        if adapter is None:
            adapter = {name: p.detach().clone() for name, p in trainable(runners[key].model).items()}
    return runners


# ------------------------------------------------------------------------------------------------- checks
@contextlib.contextmanager
def saved_for_backward(model: nn.Module) -> Iterator[dict[str, int]]:
    """Within the block, the storages autograd saves for backward, leaving out the storages of ``model``'s
    parameters and buffers: yields a dict that holds, after the block, "bytes" (their sum) and "storages" (how
    many)."""
    own = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    totals = {"bytes": 0, "storages": 0}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield totals
    totals.update(bytes=sum(storages.values()), storages=len(storages))


def worst_gradient_error(grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]
                         ) -> tuple[float | None, str | None]:
    """Per parameter max|g - g_ref| / max|g_ref| (the absolute difference where g_ref is all zero): the worst and
    its name; (None, name) when a gradient is missing on either side."""
    worst, worst_name = 0.0, None
    for name, expected in reference.items():
        actual = grads.get(name)
        if expected is None or actual is None:
            return None, name
        scale = float(expected.abs().max())
        error = float((actual - expected).abs().max())
        error = error / scale if scale else error
        if worst_name is None or error > worst:
            worst, worst_name = error, name
    return worst, worst_name


def fell_back(entry: dict[str, Any]) -> bool:
    """Whether a fastbert runner's checked call ran transformers' code: explain did not say fastbert's path, no
    fused op ran, or a warning said "fastbert: this call runs transformers' code" (at optimize or in the call)."""
    path_ok = "fastbert's path" in (entry.get("path") or "") and "transformers' code" not in (entry.get("path") or "")
    warned = any(w.startswith(FALLBACK_WARNING) for w in entry.get("warnings") or [])
    return not (path_ok and bool(entry.get("ops_ran_on")) and not warned)


def observe_call(model: nn.Module, call: Callable[[], Any], explain_kwargs: dict[str, torch.Tensor],
                 build_warnings: list[str]) -> tuple[dict[str, Any], Any]:
    """One call of ``call`` with the fused ops and fastbert warnings recorded, and (for an optimized model)
    explain's answer and whether it fell back; returns (the entry, the call's result)."""
    optimized = fastbert.is_optimized(model)
    entry: dict[str, Any] = {"path": fastbert.explain(model, **explain_kwargs) if optimized else None}
    with record_backends() as seen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    entry["ops_ran_on"] = backends_used(seen)
    entry["warnings"] = sorted(set(build_warnings) | set(fastbert_warnings(caught)))
    entry["fell_back"] = fell_back(entry) if optimized else None
    return entry, result


def check_runner(runner: Runner, batch: dict[str, torch.Tensor], reference: dict[str, Any] | None
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """At the current weights (no optimizer step): one forward + backward, its loss, trainable gradients (against
    ``reference``'s when given), memory saved for backward and path. Returns (the entry, {"loss", "grads"})."""
    with saved_for_backward(runner.model) as saved:
        entry, loss = observe_call(runner.model, partial(runner.forward_backward, batch), batch,
                                   runner.notes["build_warnings"])
    grads = {name: p.grad for name, p in trainable(runner.model).items()}
    entry.update(loss=float(loss), saved_for_backward_bytes=saved["bytes"], saved_storages=saved["storages"],
                 trainable_params=sum(p.numel() for p in trainable(runner.model).values()),
                 params_without_grad=sorted(name for name, g in grads.items() if g is None),
                 notes={k: v for k, v in runner.notes.items() if k != "build_warnings"})
    if reference is not None:
        entry["loss_rel_err"] = abs(entry["loss"] - reference["loss"]) / abs(reference["loss"])
        entry["grad_worst_rel_err"], entry["grad_worst_param"] = worst_gradient_error(grads, reference["grads"])
        entry["grad_global_rel_err"] = gradient_error(grads, reference["grads"])
    kept = {"loss": entry["loss"], "grads": {n: None if g is None else g.clone() for n, g in grads.items()}}
    runner.optimizer.zero_grad(set_to_none=True)
    return entry, kept


def check_runners(runners: dict[str, Runner], batch: dict[str, torch.Tensor], exact: bool,
                  failed: dict[str, str]) -> dict[str, dict[str, Any]]:
    """check_runner for each runner, against peft-eager's loss and gradients when ``exact`` (dropout off); a
    runner whose check raises is recorded in ``failed`` and dropped."""
    entries, reference = {}, None
    for name, runner in list(runners.items()):
        try:
            entries[name], kept = check_runner(runner, batch, reference)
        except Exception as err:  # noqa: BLE001 - recorded, the rest goes on
            failed[name] = f"check: {type(err).__name__}: {err}"[:600]
            failed[name + " (traceback)"] = traceback.format_exc()[-1500:]
            del runners[name]
            continue
        if name == REFERENCE and exact:
            reference = kept
    return entries


# ------------------------------------------------------------------------------------------------- timing
def interleave(calls: dict[str, Callable[[], Any]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """``warmup`` untimed calls of each, then ``rounds`` rounds timing one call of each, the order rotated per
    round: milliseconds per name."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    names, times = list(calls), {name: [] for name in calls}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name] += time_ms(calls[name], repeats=1, warmup=0, device=CPU)
    return times


def add_times(entries: dict[str, dict[str, Any]], times: dict[str, list[float]], workload: Workload) -> None:
    """Each entry's times, median, min and tokens/s."""
    for name, entry in entries.items():
        entry.update(times_ms=times[name], median_ms=statistics.median(times[name]), min_ms=min(times[name]))
        entry["tokens_per_s"] = workload.tokens / entry["median_ms"] * 1e3


def add_speedups(entries: dict[str, dict[str, Any]]) -> None:
    """Each runner's speed-up (median) over peft-eager and peft-sdpa, where those ran."""
    for peer in ("peft-eager", "peft-sdpa"):
        base = entries.get(peer, {}).get("median_ms")
        for entry in entries.values():
            entry[f"speedup_vs_{peer}"] = base / entry["median_ms"] if base else None


# ------------------------------------------------------------------------------------------------- measuring
def measure_case(args: argparse.Namespace, case: LoraCase, directory: str, config: Any) -> dict[str, Any]:
    """One case's report entry: runners built, checked, then timed in interleaved rounds."""
    failed: dict[str, str] = {}
    runners = build_runners(directory, case, args.runners, args.seed, failed)
    workload = make_workload(case.kind, args.batch, args.seqlen, args.seed)
    batch = make_batch(workload, config, TASK, args.seed)
    torch.manual_seed(args.seed)  # the dropout masks' stream
    entries = check_runners(runners, batch, not case.dropout, failed)
    if entries:
        times = interleave({name: partial(runners[name].step, batch) for name in entries}, args.rounds, args.warmup)
        add_times(entries, times, workload)
        add_speedups(entries)
    data = {"size": case.size, "shapes": dict(SIZES[case.size]), "kind": case.kind, "rank": case.rank,
            "lora_alpha": 2 * case.rank, "targets": case.targets, "target_modules": TARGET_MODULES[case.targets],
            "dropout": DROPOUT if case.dropout else 0.0, "rounds": args.rounds,
            "batch": [workload.batch, workload.seqlen], "real_tokens": workload.tokens, "lengths": workload.lengths,
            "runners": entries, "failed": failed}
    print_case(case.name, data)
    del runners
    gc.collect()
    return data


def build_infer_models(directory: str, case: LoraCase, seed: int) -> tuple[dict[str, nn.Module], dict[str, list]]:
    """fastbert-unmerged (the optimized PEFT model) and fastbert-merged (a deep copy merged, then optimized), in
    eval mode, with the fastbert warnings of each one's optimize."""
    unmerged = peft_model(directory, "eager", case, seed).eval()
    models = {"fastbert-unmerged": unmerged, "fastbert-merged": copy.deepcopy(unmerged).merge_and_unload().eval()}
    notes = {}
    for name, model in models.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fastbert.optimize(model)
        notes[name] = fastbert_warnings(caught)
    return models, notes


def infer(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs).logits


def measure_inference(args: argparse.Namespace, case: LoraCase, directory: str, config: Any) -> dict[str, Any]:
    """Forward-only, unmerged against merged (both optimized): paths, logits agreement, interleaved times."""
    workload = make_workload(case.kind, *args.infer_batch, args.seed)
    inputs = make_batch(workload, config, TASK, args.seed)
    del inputs["labels"]
    data: dict[str, Any] = {"batch": [workload.batch, workload.seqlen], "real_tokens": workload.tokens,
                            "runners": {}, "failed": {}}
    try:
        models, notes = build_infer_models(directory, case, args.seed)
        logits = {}
        for name, model in models.items():
            data["runners"][name], logits[name] = observe_call(model, partial(infer, model, inputs), inputs,
                                                               notes[name])
        reference = logits["fastbert-merged"]
        data["logits_rel_err"] = float((logits["fastbert-unmerged"] - reference).abs().max() / reference.abs().max())
        times = interleave({name: partial(infer, model, inputs) for name, model in models.items()}, args.rounds,
                           args.warmup)
    except Exception as err:  # noqa: BLE001 - recorded, the training figures stand
        data["failed"]["inference"] = f"{type(err).__name__}: {err}"[:600]
        data["runners"] = {}
        return data
    add_times(data["runners"], times, workload)
    data["unmerged_over_merged_speed"] = data["runners"]["fastbert-merged"]["median_ms"] / data["runners"][
        "fastbert-unmerged"]["median_ms"]
    print_inference(case.adapter, data)
    return data


def measure_setup(args: argparse.Namespace, size: str, dropout: bool, cases: list[LoraCase], done: set[str]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The training and inference entries of the cases sharing one checkpoint (size, dropout); ``done``: the
    adapters (LoraCase.adapter) whose inference was measured already."""
    training, inference = {}, {}
    with tempfile.TemporaryDirectory() as directory:
        config = save_checkpoint(directory, size, TASK, dropout, args.seed)
        for case in cases:
            training[case.name] = measure_case(args, case, directory, config)
            if args.infer_batch and case.adapter not in done:
                done.add(case.adapter)
                inference[case.adapter] = measure_inference(args, case, directory, config)
    return training, inference


# ------------------------------------------------------------------------------------------------- targets
def step_targets(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """fastbert's step speed-up over each PEFT peer in every case; a needed value only at STEP_TARGET's case and
    peer; met only when fastbert did not fall back."""
    size, rank, targets, target_peer, needed = STEP_TARGET
    rows = []
    for name, data in cases.items():
        entry = data["runners"].get("fastbert")
        for peer in ("peft-sdpa", "peft-eager"):
            if entry is None or peer not in data["runners"]:
                continue
            applies = (data["size"], data["rank"], data["targets"], peer) == (size, rank, targets, target_peer)
            speedup = entry[f"speedup_vs_{peer}"]
            rows.append({"section": "train step", "case": name, "runner": "fastbert", "peer": peer,
                         "needed": needed if applies else None, "speedup": round(speedup, 3),
                         "fell_back": entry["fell_back"],
                         "met": bool(speedup >= needed and not entry["fell_back"]) if applies else None})
    return rows


def inference_targets(inference: dict[str, Any]) -> list[dict[str, Any]]:
    """Unmerged speed / merged speed >= INFER_TARGET, met only when neither fell back."""
    rows = []
    for name, data in inference.items():
        if "unmerged_over_merged_speed" not in data:
            continue
        ratio = data["unmerged_over_merged_speed"]
        either = any(entry["fell_back"] for entry in data["runners"].values())
        rows.append({"section": "inference", "case": name, "runner": "fastbert-unmerged", "peer": "fastbert-merged",
                     "needed": INFER_TARGET, "speedup": round(ratio, 3), "fell_back": either,
                     "met": bool(ratio >= INFER_TARGET and not either)})
    return rows


# ------------------------------------------------------------------------------------------------- main
def source_state(root: str) -> dict[str, Any]:
    """The commit checked out at ``root`` and its uncommitted files under fastbert/, kernels/ and csrc/; {} outside
    a git checkout."""
    commit = git_commit(root)
    if commit is None:
        return {}
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "fastbert", "kernels", "csrc"], cwd=root,
                                capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"root": root, "commit": commit, "uncommitted": [line[3:] for line in status.splitlines()]}


def infer_batch(text: str) -> tuple[int, int] | None:
    """'8x128' -> (8, 128); '0' -> None (no inference section)."""
    if text == "0":
        return None
    batch, _, seqlen = text.partition("x")
    if not (batch.isdigit() and seqlen.isdigit() and int(batch) > 0 and int(seqlen) > 0):
        raise argparse.ArgumentTypeError(f"BATCHxSEQLEN (e.g. 8x128) or 0, got {text!r}")
    return int(batch), int(seqlen)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                        help="SIZE:fixed|varlen:rRANK:TARGETS[:nodropout] (sizes: " + ", ".join(SIZES)
                        + "; targets: " + ", ".join(TARGET_MODULES) + ")")
    parser.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS))
    parser.add_argument("--rounds", type=int, default=8, help="timed steps (and forwards) per runner and case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per runner and case after the check")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--infer-batch", type=infer_batch, default=(8, 128),
                        help="BATCHxSEQLEN of the inference section (default 8x128); 0 leaves it out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for <name>.json / <name>.md")
    parser.add_argument("--name", default="results", help="file name stem inside --out")
    return parser.parse_args(argv)


def measure_all(args: argparse.Namespace, cases: list[LoraCase]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every case's training entry and every adapter's inference entry, one checkpoint per (size, dropout)."""
    setups: dict[tuple[str, bool], list[LoraCase]] = {}
    for case in cases:
        setups.setdefault((case.size, case.dropout), []).append(case)
    training: dict[str, Any] = {}
    inference: dict[str, Any] = {}
    done: set[str] = set()
    for (size, dropout), setup_cases in setups.items():
        trained, inferred = measure_setup(args, size, dropout, setup_cases, done)
        training.update(trained)
        inference.update(inferred)
    for data in inference.values():
        for entry in data["runners"].values():
            entry["times_ms"] = [round(t, 2) for t in entry["times_ms"]]
    return training, inference


def machine_record(threads: int, load_before: list[float]) -> dict[str, Any]:
    """machine_info plus the threads, the load before and after, every /proc/cpuinfo flag and peft's version."""
    machine = machine_info(CPU)
    machine.update(threads=threads, loadavg_before=load_before, loadavg_after=machine["load_average"],
                   cpuinfo_flags=sorted(cpu_info()[1]))  # machine_info's cpu_flags: only fastbert's FEATURES
    machine["versions"]["peft"] = package_version("peft")
    return machine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [LoraCase.parse(text) for text in args.cases]
    load_before = list(os.getloadavg())
    fastbert_root = os.path.dirname(os.path.dirname(os.path.abspath(fastbert.__file__)))
    source = {"fastbert": source_state(fastbert_root),  # the code that ran: the editable install's checkout
              "benchmark": source_state(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    training, inference = measure_all(args, cases)
    report = interleaved_report(
        machine_record(args.threads, load_before), f"BertForSequenceClassification (2 labels), random weights "
        f"(seed {args.seed}), float32, PEFT LoRA", args.rounds, training,
        step_targets(training) + inference_targets(inference), warmup=args.warmup, lr=LR, source=source,
        inference=inference, infer_batch=list(args.infer_batch) if args.infer_batch else None)
    write_interleaved(report, markdown(report), args.out, args.name)
    return 0


# ------------------------------------------------------------------------------------------------- report
def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _ran(entry: dict[str, Any]) -> str:
    if entry.get("fell_back") is None:
        return "transformers (PEFT)"
    if entry["fell_back"]:
        return "**fell back** (transformers' code)"
    backends = {part.split(" x")[0] for used in entry["ops_ran_on"].values() for part in used.split(", ")}
    return "fastbert (ops on " + (", ".join(sorted(backends)) or "none") + ")"


def print_case(name: str, data: dict[str, Any]) -> None:
    """One case's figures and failures on stdout, as they come."""
    print(f"== {name}: batch {data['batch'][0]} x {data['batch'][1]}, {data['real_tokens']} real tokens", flush=True)
    for runner, entry in data["runners"].items():
        print(f"  {runner:12s} median {entry['median_ms']:9.1f} ms  min {entry['min_ms']:9.1f} ms  "
              f"{_ratio(entry['speedup_vs_peft-sdpa'])} peft-sdpa  loss err {_err(entry.get('loss_rel_err'))}  "
              f"grad err {_err(entry.get('grad_worst_rel_err'))}  saved {entry['saved_for_backward_bytes'] / 2**20:.1f}"
              f" MiB  {_ran(entry)}", flush=True)
    for runner, error in data["failed"].items():
        if not runner.endswith("(traceback)"):
            print(f"  {runner:12s} FAILED: {error.splitlines()[0] if error else ''}", flush=True)


def print_inference(name: str, data: dict[str, Any]) -> None:
    print(f"== inference {name}: batch {data['batch'][0]} x {data['batch'][1]}; unmerged/merged speed "
          f"{data['unmerged_over_merged_speed']:.2f}, logits rel err {data['logits_rel_err']:.1e}", flush=True)
    for runner, entry in data["runners"].items():
        print(f"  {runner:18s} median {entry['median_ms']:9.1f} ms  min {entry['min_ms']:9.1f} ms  {_ran(entry)}",
              flush=True)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: header, one table per case, inference, targets, what each fastbert runner ran."""
    lines = markdown_header(report)
    for name, data in report["cases"].items():
        lines += case_table(name, data)
    lines += inference_table(report["inference"])
    rows = [[t["section"], t["case"], t["runner"], t["peer"], "-" if t["needed"] is None else ratio_text(t["needed"]),
             f"{t['speedup']:.2f}x", "FELL BACK" if t["fell_back"] else "no",
             "-" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in report["targets"]]
    lines += ["## Targets", "", "fastbert's step against each PEFT peer (speed-up of medians); inference: unmerged "
              "speed / merged speed. A runner that fell back never meets a target.", "",
              format_table(("section", "case", "runner", "peer", "needed", "measured (median)", "fell back", "met"),
                           rows, markdown=True), ""]
    return "\n".join(lines + fastbert_paths(report)) + "\n"


def _source_line(name: str, source: dict[str, Any]) -> str:
    if not source:
        return f"- {name}: not a git checkout"
    dirty = f", with uncommitted changes in {', '.join(source['uncommitted'])}" if source["uncommitted"] else ""
    return f"- {name}: {source['root']} at commit {source['commit']}{dirty}"


def markdown_header(report: dict[str, Any]) -> list[str]:
    """Date, machine, versions, command, code, model and the protocol of the run."""
    m = report["machine"]
    return [
        "# CPU PEFT LoRA fine-tuning step: fastbert.optimize vs PEFT on transformers",
        "",
        f"- Date: {report['date_utc']}",
        f"- Machine: {m['cpu']}, {m['cpu_cores']} logical CPUs, {m['threads']} threads (torch.set_num_threads), "
        f"torch CPU capability {m['torch_cpu_capability']}; load average (1 min) before/after "
        f"{m['loadavg_before'][0]:.2f}/{m['loadavg_after'][0]:.2f}; CPU flags: {' '.join(m['cpu_flags'])}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Command: `{report['command']}`",
        _source_line("fastbert imported from", report["source"]["fastbert"]),
        _source_line("benchmark script", report["source"]["benchmark"]),
        f"- Model: {report['model']}; LoraConfig(task_type='SEQ_CLS', r, lora_alpha=2r, init_lora_weights=False), "
        "the same adapter in every runner",
        f"- Step: zero_grad, forward with the head's loss, backward, AdamW (lr {report['lr']:g}) over the trainable "
        f"parameters. Per case: an untimed check, {report['warmup']} untimed step(s), then {report['rounds']} "
        "rounds of one timed step per runner, order rotated per round; median and min wall time per step.",
        "- loss / grad rel err (dropout-off cases): against peft-eager at the initial weights; grad: the worst "
        "trainable parameter's max|g - g_ref| / max|g_ref|. saved MiB: activation memory saved for backward (the "
        "distinct storages autograd saves during one forward, the model's parameters and buffers left out).",
        "",
    ]


def case_table(name: str, data: dict[str, Any]) -> list[str]:
    """One case's heading, its table of runners, and the runners that could not be timed."""
    rows = [[runner, _ran(e), f"{e['median_ms']:.0f}", f"{e['min_ms']:.0f}", f"{e['tokens_per_s']:.0f}",
             _ratio(e["speedup_vs_peft-eager"]), _ratio(e["speedup_vs_peft-sdpa"]), _err(e.get("loss_rel_err")),
             _err(e.get("grad_worst_rel_err")), f"{e['saved_for_backward_bytes'] / 2**20:.1f}",
             f"{e['trainable_params']:,}"] for runner, e in data["runners"].items()]
    lines = [f"## {name}: batch {data['batch'][0]} x {data['batch'][1]} ({data['real_tokens']} real tokens), "
             f"LoRA r {data['rank']} on {data['target_modules']}, dropout {data['dropout']}", "",
             format_table(("runner", "ran", "median ms", "min ms", "tokens/s", "vs peft-eager", "vs peft-sdpa",
                           "loss rel err", "grad rel err (worst)", "saved MiB", "trainable params"), rows,
                          markdown=True), ""]
    failures = {k: v for k, v in data["failed"].items() if not k.endswith("(traceback)")}
    lines += [f"- {runner}: not timed: {error}" for runner, error in failures.items()]
    return lines + ([""] if failures else [])


def inference_table(inference: dict[str, Any]) -> list[str]:
    """The forward-only section: one row per runner and adapter."""
    if not inference:
        return []
    rows = []
    for name, data in inference.items():
        for runner, e in data["runners"].items():
            rows.append([name, f"{data['batch'][0]} x {data['batch'][1]}", runner, _ran(e), f"{e['median_ms']:.1f}",
                         f"{e['min_ms']:.1f}", _err(data.get("logits_rel_err"))])
        rows += [[name, "-", "-", f"not measured: {error}", "-", "-", "-"] for error in data["failed"].values()]
    return ["## Inference: fastbert.optimize, adapter unmerged vs merged (eval, torch.inference_mode)", "",
            format_table(("adapter", "batch", "runner", "ran", "median ms", "min ms", "logits rel err"), rows,
                         markdown=True), ""]


def fastbert_paths(report: dict[str, Any]) -> list[str]:
    """What each fastbert runner ran: explain, the fused ops recorded, warnings."""
    lines = ["## What each fastbert runner ran (fastbert.explain, the fused ops recorded in the checked call, "
             "warnings)", ""]
    sections = [("", report["cases"]), ("inference ", report["inference"])]
    for prefix, cases in sections:
        for name, data in cases.items():
            for runner, entry in data["runners"].items():
                if entry.get("fell_back") is None:
                    continue
                ops = ", ".join(f"{op}={b}" for op, b in entry["ops_ran_on"].items()) or "no fused op ran"
                lines.append(f"- {prefix}{name}, {runner}: explain: {(entry['path'] or '-').replace(chr(10), '; ')}; "
                             f"ops: {ops}" + (f"; warnings: {' / '.join(entry['warnings'])}" if entry["warnings"]
                                              else ""))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
