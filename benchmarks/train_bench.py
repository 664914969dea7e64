"""CPU training benchmark: one training step (forward + loss + backward + AdamW step) of a BERT model with a head,
fastbert against transformers eager, SDPA and torch.compile, same weights and batch, interleaved.

Models (random weights, transformers' seeded initialisation, saved once and loaded by every runner): ``minilm``
(all-MiniLM-L6-v2's shapes: H 384, 6 layers, 12 heads, inner 1536) and ``base`` (BERT-base: H 768, 12 layers,
12 heads, inner 3072), vocabulary 30522, with the head of ``--task`` (BertForSequenceClassification with 2 labels
by default, or BertForMaskedLM with 15 % of real positions scored), in train() mode, dropout 0.1 as BERT's config
says, or 0 in the ``nodropout`` cases.

Runners, each with its own copy of the model and its own AdamW (lr 1e-5):
- ``HF eager`` / ``HF SDPA``: the transformers model (attn_implementation eager / sdpa);
- ``torch.compile (HF SDPA)``: torch.compile(model) (inductor; its first call, the compilation, is untimed and its
  duration recorded; a compilation that fails is recorded as the runner's result);
- ``fastbert (optimize)``: fastbert.optimize of the eager model; ``fastbert.explain(model, **batch)`` and the fused
  ops that ran (`fastbert.bench.recording`) are recorded per case, so a call that fell back to transformers' code is
  marked as such and never meets a target;
- ``fastbert (from_pretrained)``: fastbert's own task model (`fastbert.from_pretrained(dir, task=...)`);
- ``fastbert (from_pretrained, backend cpp)`` (``--runners ... own-cpp``, not by default): the same through the cpp
  backend forced for every op, where `auto` trains only attention through cpp on CPU and the other ops through
  eager (`fastbert.backends.autograd_order`); with dropout on it cannot run (the cpp LayerNorm-family kernels
  decline dropout) and is recorded as failed.

Batches: ``fixed`` (``--batch`` x ``--seqlen``, every token real) and ``varlen`` (``--batch`` sequences of seeded
lengths uniform in [0.2, 1.0] x seqlen, the first full: mean ~60 %, padded to seqlen; every runner gets the same
padded batch and mask, fastbert removes the padding itself). Per setup (model size, dropout) the runners are built
once; per case, first an untimed check at the initial weights (forward + backward, no optimizer step: the loss and,
for runners with transformers' parameter names, every gradient against HF eager's, meaningful with dropout off;
whether two calls in train mode differ, i.e. dropout is applied), then ``--warmup`` untimed steps, then rounds, each
timing one step of every runner, the order rotating per round. Figures: median and minimum wall time per step.

    .venv/bin/python benchmarks/train_bench.py --threads 2 --out benchmarks/results/cpu-2core-train
    .venv/bin/python benchmarks/train_bench.py --cases tiny:varlen:nodropout --batch 4 --seqlen 16 --rounds 1

Writes <name>.json and <name>.md (default results.*) into --out. Not a test: targets are ratios measured in the
same run, on a VM whose speed drifts by +-30 % between runs. `benchmarks/train_step_cpu.py` is a different
measurement (fastbert's own encoder through forced backends, no optimizer) that `fastbert.backends` cites.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import fastbert
from fastbert.bench import peers
from fastbert.bench.machine import git_commit, machine_info
from fastbert.bench.recording import backends_used, record_backends
from fastbert.bench.report import format_table, interleaved_report, write_interleaved
from fastbert.bench.timing import time_ms
from fastbert.bench.workloads import Workload

CPU = torch.device("cpu")
SIZES = {  # transformers.BertConfig fields per model size; "tiny" is for smoke tests
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=512,
                 max_position_embeddings=64),
}
HF_CLASSES = {"sequence-classification": "BertForSequenceClassification", "masked-lm": "BertForMaskedLM"}
RUNNERS = {  # --runners key -> runner name
    "hf-eager": "HF eager", "hf-sdpa": "HF SDPA", "compile": "torch.compile (HF SDPA)",
    "optimize": "fastbert (optimize)", "own": "fastbert (from_pretrained)",
    "own-cpp": "fastbert (from_pretrained, backend cpp)",  # not by default: auto's choice under autograd re-checked
}
DEFAULT_RUNNERS = ("hf-eager", "hf-sdpa", "compile", "optimize", "own")
DEFAULT_CASES = ("minilm:fixed", "minilm:varlen", "minilm:fixed:nodropout", "minilm:varlen:nodropout",
                 "base:fixed", "base:varlen")
TARGETS = [("varlen", "fastbert (optimize)", "HF eager", 1.3)]  # (batch kind, runner, peer, needed speed-up)
DROPOUT = 0.1  # BERT's hidden_dropout_prob and attention_probs_dropout_prob


# ------------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    """One timed case: a model size, a batch kind (fixed or varlen) and whether dropout is on."""

    size: str
    kind: str
    dropout: bool

    @classmethod
    def parse(cls, text: str) -> Case:
        """'minilm:varlen' or 'base:fixed:nodropout'."""
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[0] not in SIZES or parts[1] not in ("fixed", "varlen") or (
                len(parts) == 3 and parts[2] != "nodropout"):
            raise SystemExit(f"train_bench: bad case {text!r}: SIZE:fixed|varlen[:nodropout], SIZE one of "
                             f"{', '.join(SIZES)}")
        return cls(parts[0], parts[1], len(parts) == 2)

    @property
    def name(self) -> str:
        return f"{self.size} {self.kind}" + ("" if self.dropout else ", dropout off")

    @property
    def setup(self) -> tuple[str, bool]:
        """Cases of one setup share the runners (models, optimizers, the compiled graph)."""
        return self.size, self.dropout


def make_workload(kind: str, batch: int, seqlen: int, seed: int) -> Workload:
    """``fixed``: every token real; ``varlen``: lengths uniform in [0.2, 1.0] x seqlen (seeded), the first full."""
    if kind == "fixed":
        return Workload("fixed", batch, seqlen, [seqlen] * batch, False)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, round(0.2 * seqlen)), seqlen + 1, (batch,), generator=generator).tolist()
    lengths[0] = seqlen
    return Workload("varlen", batch, seqlen, lengths, True)


def make_batch(workload: Workload, config, task: str, seed: int) -> dict[str, torch.Tensor]:
    """The padded inputs plus labels: a class per sequence, or (masked LM) the token at 15 % of real positions
    and -100 elsewhere."""
    inputs = workload.inputs(config, CPU, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    if task == "sequence-classification":
        inputs["labels"] = torch.randint(0, config.num_labels, (workload.batch,), generator=generator)
    else:
        scored = (torch.rand(inputs["input_ids"].shape, generator=generator) < 0.15) & inputs["attention_mask"].bool()
        scored[:, 0] |= True  # at least one scored token per row
        inputs["labels"] = torch.where(scored, inputs["input_ids"], torch.full_like(inputs["input_ids"], -100))
    return inputs


# ------------------------------------------------------------------------------------------------- runners
@dataclass
class Runner:
    """A model, what is called (the model or its compiled wrapper) and the optimizer over the model's parameters."""

    name: str
    model: nn.Module
    call: Callable[..., Any]
    optimizer: torch.optim.Optimizer
    hf_names: bool  # parameter names are transformers' (gradients comparable with HF eager's by name)
    notes: dict[str, Any] = field(default_factory=dict)

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.call(**batch).loss
        loss.backward()
        return loss.detach()

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        """One training step: zero the gradients, forward with the head's loss, backward, AdamW step."""
        self.forward_backward(batch)
        self.optimizer.step()


def save_checkpoint(directory: str, size: str, task: str, dropout: bool, seed: int) -> Any:
    """transformers' model with the task head at ``size``'s shapes, its own seeded initialisation, saved; returns
    its config."""
    import transformers

    torch.manual_seed(seed)
    p = DROPOUT if dropout else 0.0
    config = transformers.BertConfig(**SIZES[size], hidden_dropout_prob=p, attention_probs_dropout_prob=p,
                                     num_labels=2)
    with warnings.catch_warnings(), open(os.devnull, "w") as sink, contextlib.redirect_stderr(sink):
        warnings.simplefilter("ignore")  # and the progress bar of the save goes to the sink
        getattr(transformers, HF_CLASSES[task])(config).save_pretrained(directory)
    return config


def build_runners(directory: str, task: str, keys: list[str], failed: dict[str, str]) -> dict[str, Runner]:
    """The runners named by ``keys`` over the checkpoint in ``directory``, in train mode; a runner that cannot be
    built is recorded in ``failed`` (name -> error) instead."""
    import transformers

    hf_class = getattr(transformers, HF_CLASSES[task])
    runners = {}

    def optimizer(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)

    for key in sorted(set(keys), key=list(RUNNERS).index):  # HF eager first: the reference of the checks
        name = RUNNERS[key]
        try:
            if key in ("hf-eager", "hf-sdpa", "compile", "optimize"):
                attn = "eager" if key in ("hf-eager", "optimize") else "sdpa"
                model = peers.load_hf_model(directory, attn=attn, model_class=hf_class).train()
                call: Callable[..., Any] = model
                notes: dict[str, Any] = {"attn_implementation": attn}
                if key == "compile":
                    call = torch.compile(model)
                    notes["compile"] = "torch.compile(model), inductor, defaults; first call untimed"
                if key == "optimize":
                    fastbert.optimize(model)
                    notes["optimize"] = "fastbert.optimize(model) (backend auto) on the eager model"
                runners[name] = Runner(name, model, call, optimizer(model), hf_names=True, notes=notes)
            else:
                backend = "cpp" if key == "own-cpp" else "auto"
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = fastbert.from_pretrained(directory, task=task, backend=backend).train()
                runners[name] = Runner(name, model, model, optimizer(model), hf_names=False, notes={
                    "model": f"fastbert.from_pretrained(dir, task={task!r}, backend={backend!r})"})
        except Exception as err:  # noqa: BLE001 - a runner that cannot be built is a result, not a crash
            failed[name] = f"build: {type(err).__name__}: {err}"[:600]
    return runners


# ------------------------------------------------------------------------------------------------- checks
def fastbert_path(runner: Runner, batch: dict[str, torch.Tensor]) -> str | None:
    """`fastbert.explain`'s answer for an optimized model (None for the other runners)."""
    if runner.name != RUNNERS["optimize"]:
        return None
    return fastbert.explain(runner.model, **batch)


def check_runner(runner: Runner, batch: dict[str, torch.Tensor], reference: dict[str, Any] | None,
                 dropout_probe: bool, keep_grads: bool = False) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """At the current weights (no optimizer step): the loss and gradients of one forward + backward (compared
    with ``reference``'s when given), the fused ops that ran, the path, and (``dropout_probe``) whether two more
    train-mode calls give different logits. The first call of a compiled runner compiles: its duration is
    recorded as ``first_call_s``. Returns (the figures, {"loss", "grads"} copied when ``keep_grads``)."""
    entry: dict[str, Any] = {"path": fastbert_path(runner, batch)}
    started = time.perf_counter()
    with record_backends() as seen, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = runner.forward_backward(batch)
    entry["first_call_s"] = round(time.perf_counter() - started, 2)
    entry["ops_ran_on"] = backends_used(seen)
    entry["warnings"] = sorted({str(w.message)[:300] for w in caught if "fastbert" in str(w.message)})
    entry["loss"] = float(loss)
    grads = {name: p.grad for name, p in runner.model.named_parameters() if p.requires_grad}
    entry["params_without_grad"] = sorted(name for name, g in grads.items() if g is None)
    if reference is not None:
        entry["loss_rel_err_vs_hf_eager"] = abs(entry["loss"] - reference["loss"]) / abs(reference["loss"])
        if runner.hf_names:
            entry["grad_max_rel_err_vs_hf_eager"] = gradient_error(grads, reference["grads"])
    kept = None
    if keep_grads:
        kept = {"loss": entry["loss"], "grads": {n: None if g is None else g.clone() for n, g in grads.items()}}
    del grads
    if dropout_probe:  # with grad mode on, as in training (grad mode may decide the path)
        first = runner.call(**batch).logits.detach()
        second = runner.call(**batch).logits.detach()
        entry["dropout_observed"] = not torch.equal(first, second)
    runner.optimizer.zero_grad(set_to_none=True)
    return entry, kept


def gradient_error(grads: dict[str, torch.Tensor | None], reference: dict[str, torch.Tensor | None]) -> float | None:
    """max |g - g_ref| over every parameter / max |g_ref| over every parameter (by transformers' parameter
    names); None when a gradient is missing on either side."""
    worst, scale = 0.0, 0.0
    for name, expected in reference.items():
        actual = grads.get(name)
        if expected is None or actual is None:
            return None
        worst = max(worst, float((actual - expected).abs().max()))
        scale = max(scale, float(expected.abs().max()))
    return worst / scale if scale else worst


# ------------------------------------------------------------------------------------------------- timing
def run_setup(cases: list[Case], runners: dict[str, Runner], failed: dict[str, str], batches: dict[Case, dict],
              rounds: int, warmup: int) -> dict[Case, dict[str, Any]]:
    """Check every case at the initial weights, then time each case (warm-up steps, then interleaved rounds)."""
    results: dict[Case, dict[str, Any]] = {case: {} for case in cases}
    for index, case in enumerate(cases):
        batch = batches[case]
        reference = None
        for name, runner in list(runners.items()):
            is_reference = name == RUNNERS["hf-eager"] and not case.dropout
            try:
                entry, kept = check_runner(runner, batch, reference, dropout_probe=index == 0,
                                           keep_grads=is_reference)
            except Exception as err:  # noqa: BLE001 - e.g. a compilation that fails: recorded, the rest goes on
                failed[name] = f"{case.name}: {type(err).__name__}: {err}"[:600]
                failed[name + " (traceback)"] = traceback.format_exc()[-1500:]
                del runners[name]
                continue
            if is_reference:  # HF eager comes first: the others' loss and gradients are compared with these
                reference = kept
            results[case][name] = {**entry, "times_ms": []}
        del reference
    for case in cases[1:]:  # dropout was probed in the setup's first case; it holds for the setup
        for name, entry in results[case].items():
            if "dropout_observed" in results[cases[0]].get(name, {}):
                entry["dropout_observed"] = results[cases[0]][name]["dropout_observed"]
    for case in cases:
        batch = batches[case]
        names = [name for name in runners if name in results[case]]
        for name in names:
            for _ in range(warmup):
                runners[name].step(batch)
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                results[case][name]["times_ms"] += time_ms(lambda r=runners[name], b=batch: r.step(b), repeats=1,
                                                           warmup=0, device=CPU)
        for name in list(results[case]):
            entry = results[case][name]
            if not entry["times_ms"]:
                del results[case][name]
                continue
            entry["median_ms"] = statistics.median(entry["times_ms"])
            entry["min_ms"] = min(entry["times_ms"])
    return results


def runs_fastbert(name: str, entry: dict[str, Any]) -> bool:
    """Did fastbert's code run this runner's steps? optimize: explain says fastbert's path and fused ops ran;
    from_pretrained: fused ops ran."""
    if name == RUNNERS["optimize"]:
        return "fastbert's path" in (entry.get("path") or "") and bool(entry.get("ops_ran_on"))
    return bool(entry.get("ops_ran_on"))


def source_state() -> dict[str, Any]:
    """The checkout's commit and its uncommitted files under the code the run imports (fastbert/, kernels/, csrc/),
    read when the run starts; {} outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = git_commit(root)
    if commit is None:
        return {}
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", "fastbert", "kernels", "csrc"], cwd=root,
                                capture_output=True, text=True, check=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "uncommitted": [line[3:] for line in status.splitlines()]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                        help="SIZE:fixed|varlen[:nodropout] (sizes: " + ", ".join(SIZES) + ")")
    parser.add_argument("--task", choices=sorted(HF_CLASSES), default="sequence-classification")
    parser.add_argument("--runners", nargs="+", choices=list(RUNNERS), default=list(DEFAULT_RUNNERS))
    parser.add_argument("--base-runners", nargs="+", choices=list(RUNNERS),
                        default=["hf-eager", "compile", "optimize", "own"],
                        help="runners of the base cases (a step there takes ~10 s on 2 cores)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8, help="timed steps per runner and case")
    parser.add_argument("--base-rounds", type=int, default=3, help="--rounds for the base cases")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per runner and case after the check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="directory for <name>.json / <name>.md")
    parser.add_argument("--name", default="results", help="file name stem inside --out")
    return parser.parse_args(argv)


def measure_setup(args: argparse.Namespace, size: str, dropout: bool, setup_cases: list[Case]) -> dict[str, Any]:
    """The report entries of the cases sharing one checkpoint (size, dropout): runners built once, then timed."""
    keys = args.base_runners if size == "base" else args.runners
    rounds = args.base_rounds if size == "base" else args.rounds
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as directory:
        config = save_checkpoint(directory, size, args.task, dropout, args.seed)
        runners = build_runners(directory, args.task, keys, failed)
    torch.manual_seed(args.seed)  # the dropout masks' stream
    workloads = {case: make_workload(case.kind, args.batch, args.seqlen, args.seed) for case in setup_cases}
    batches = {case: make_batch(workloads[case], config, args.task, args.seed) for case in setup_cases}
    results = run_setup(setup_cases, runners, failed, batches, rounds, args.warmup)
    report_cases = {}
    for case in setup_cases:
        workload, entries = workloads[case], results[case]
        add_rates(entries, workload)
        report_cases[case.name] = {
            "size": size, "shapes": dict(SIZES[size]), "kind": case.kind,
            "dropout": DROPOUT if dropout else 0.0, "task": args.task, "rounds": rounds,
            "batch": [workload.batch, workload.seqlen], "real_tokens": workload.tokens,
            "lengths": workload.lengths, "runners": entries, "failed": dict(failed)}
        print_case(case, workload, entries, failed)
    del runners, results
    gc.collect()
    return report_cases


def add_rates(entries: dict[str, dict[str, Any]], workload: Workload) -> None:
    """Each runner's tokens/s, speed-up over HF eager, and whether fastbert's path ran."""
    base = entries.get(RUNNERS["hf-eager"], {}).get("median_ms")
    for name, entry in entries.items():
        entry["tokens_per_s"] = workload.tokens / entry["median_ms"] * 1e3
        entry["speedup_vs_hf_eager"] = base / entry["median_ms"] if base else None
        entry["runs_fastbert"] = runs_fastbert(name, entry) if name.startswith("fastbert") else None


def print_case(case: Case, workload: Workload, entries: dict[str, dict[str, Any]], failed: dict[str, str]) -> None:
    """One case's figures and failures on stdout, as they come."""
    print(f"== {case.name}: batch {workload.batch} x {workload.seqlen}, {workload.tokens} real tokens", flush=True)
    for name, entry in entries.items():
        speedup = entry["speedup_vs_hf_eager"]
        print(f"  {name:28s} median {entry['median_ms']:9.1f} ms  min {entry['min_ms']:9.1f} ms  "
              f"{'' if speedup is None else f'{speedup:.2f}x HF eager'}"
              f"{'' if entry['path'] is None else '  path: ' + entry['path'].replace(chr(10), '; ')}", flush=True)
    for name, error in failed.items():
        if not name.endswith("(traceback)"):
            print(f"  {name:28s} FAILED: {error.splitlines()[0] if error else ''}", flush=True)


def target_results(report_cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Each TARGETS entry that applies to a measured case: the speed-up measured and whether it was met (only
    with fastbert's own path running)."""
    targets = []
    for case_name, data in report_cases.items():
        for kind, runner, peer, needed in TARGETS:
            if data["kind"] != kind or runner not in data["runners"] or peer not in data["runners"]:
                continue
            entry = data["runners"][runner]
            speedup = data["runners"][peer]["median_ms"] / entry["median_ms"]
            targets.append({"case": case_name, "runner": runner, "peer": peer, "needed": needed,
                            "speedup": round(speedup, 3), "runs_fastbert": entry["runs_fastbert"],
                            "met": bool(speedup >= needed and entry["runs_fastbert"])})
    return targets


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = [Case.parse(text) for text in args.cases]
    load_before = list(os.getloadavg())
    source = source_state()
    setups: dict[tuple[str, bool], list[Case]] = {}
    for case in cases:
        setups.setdefault(case.setup, []).append(case)
    report_cases: dict[str, Any] = {}
    for (size, dropout), setup_cases in setups.items():
        report_cases.update(measure_setup(args, size, dropout, setup_cases))
    machine = machine_info(CPU)
    machine.update(threads=args.threads, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                   loadavg_before=load_before, loadavg_after=machine["load_average"])
    report = interleaved_report(machine, f"BERT with a {args.task} head ({HF_CLASSES[args.task]}), random weights "
                                f"(seed {args.seed}), float32", args.rounds, report_cases,
                                target_results(report_cases), base_rounds=args.base_rounds, warmup=args.warmup,
                                task=args.task, source=source)
    write_interleaved(report, markdown(report), args.out, args.name)
    return 0


# ------------------------------------------------------------------------------------------------- report
def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _path(name: str, entry: dict[str, Any]) -> str:
    if entry.get("runs_fastbert") is None:
        return "transformers"
    ops = ", ".join(sorted(set(entry["ops_ran_on"].values()))) or "none"
    return f"fastbert (ops on {ops})" if entry["runs_fastbert"] else "**FALLBACK: transformers' code**"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: header, one table per case, targets, what each fastbert runner ran, failures."""
    lines = markdown_header(report)
    for case, data in report["cases"].items():
        lines += case_table(case, data)
    rows = [[t["case"], t["runner"], t["peer"], f"{t['needed']:.1f}x", f"{t['speedup']:.2f}x",
             "yes" if t["runs_fastbert"] else "NO (fallback)", "yes" if t["met"] else "NO"]
            for t in report["targets"]]
    lines += ["## Targets", "", format_table(("case", "runner", "peer", "needed", "measured (median)",
                                              "fastbert's path ran", "met"), rows, markdown=True), ""]
    lines += fastbert_paths(report)
    return "\n".join(lines) + "\n"


def markdown_header(report: dict[str, Any]) -> list[str]:
    """Date, machine, versions, command, code, model and the protocol of the run."""
    m = report["machine"]
    return [
        "# CPU training-step benchmark: fastbert vs transformers and torch.compile",
        "",
        f"- Date: {report['date_utc']}",
        f"- Machine: {m['cpu']}, {m['cpu_cores']} logical CPUs, {m['threads']} threads for every runner "
        f"(torch.set_num_threads), torch CPU capability {m['torch_cpu_capability']}; load average (1 min) "
        f"before/after {m['loadavg_before'][0]:.2f}/{m['loadavg_after'][0]:.2f}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        f"- Command: `{report['command']}`",
        "- Code: " + (f"commit {report['source']['commit']}" + (
            f", with uncommitted changes in {', '.join(report['source']['uncommitted'])}"
            if report["source"]["uncommitted"] else "") if report.get("source") else "not a git checkout"),
        f"- Model: {report['model']}",
        f"- Step: zero_grad, forward with the head's loss, backward, AdamW (lr 1e-5) step; each runner its own copy "
        f"of the same checkpoint. Per case: an untimed check at the initial weights, {report['warmup']} untimed "
        f"step(s), then rounds of one timed step per runner, order rotated per round ({report['rounds']} rounds; "
        f"{report['base_rounds']} for base); median and min wall time per step.",
        "- loss / grad rel err: |loss - HF eager's| / |HF eager's| and max |grad - HF eager's| / max |HF eager's grad|"
        " over every parameter, at the initial weights (dropout off cases only: with dropout on each runner draws "
        "its own masks). dropout: whether two train-mode calls gave different logits.",
        "",
    ]


def case_table(case: str, data: dict[str, Any]) -> list[str]:
    """One case's heading, its table of runners, and the runners that could not be timed."""
    rows = []
    for name, entry in data["runners"].items():
        speedup = entry["speedup_vs_hf_eager"]
        rows.append([name, _path(name, entry), f"{entry['median_ms']:.0f}", f"{entry['min_ms']:.0f}",
                     f"{entry['tokens_per_s']:.0f}", "-" if speedup is None else f"{speedup:.2f}x",
                     _err(entry.get("loss_rel_err_vs_hf_eager")), _err(entry.get("grad_max_rel_err_vs_hf_eager")),
                     "-" if "dropout_observed" not in entry else ("yes" if entry["dropout_observed"] else "no")])
    lines = [f"## {case}: batch {data['batch'][0]} x {data['batch'][1]} ({data['real_tokens']} real tokens), "
             f"dropout {data['dropout']}", "",
             format_table(("runner", "ran", "median ms", "min ms", "tokens/s", "speed-up vs HF eager (median)",
                           "loss rel err", "grad rel err", "dropout"), rows, markdown=True), ""]
    failures = {k: v for k, v in data["failed"].items() if not k.endswith("(traceback)")}
    lines += [f"- {name}: not timed: {error}" for name, error in failures.items()]
    return lines + ([""] if failures else [])


def fastbert_paths(report: dict[str, Any]) -> list[str]:
    """What each fastbert runner ran (explain, the fused ops recorded, warnings) and torch.compile's first calls."""
    lines = ["## What each fastbert runner ran (fastbert.explain and the fused ops recorded in the checked call)", ""]
    for case, data in report["cases"].items():
        for name, entry in data["runners"].items():
            if entry.get("runs_fastbert") is None:
                continue
            explain = (entry.get("path") or "-").replace("\n", "; ")
            ops = ", ".join(f"{op}={b}" for op, b in entry["ops_ran_on"].items()) or "no fused op ran"
            lines.append(f"- {case}, {name}: explain: {explain}; ops: {ops}"
                         + (f"; warnings: {' / '.join(entry['warnings'])}" if entry["warnings"] else ""))
    compiled = [(case, entry["first_call_s"]) for case, data in report["cases"].items()
                for name, entry in data["runners"].items() if name == RUNNERS["compile"]]
    if compiled:
        lines += ["", "torch.compile's first call (compilation, untimed): "
                  + ", ".join(f"{case} {seconds:.0f} s" for case, seconds in compiled) + "."]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
