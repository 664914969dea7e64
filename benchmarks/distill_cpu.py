"""Distillation figures for benchmarks/results/ (issue 24): three measured runs on this CPU, one JSON per part.

    .venv/bin/python benchmarks/distill_cpu.py --out benchmarks/results/cpu-2core-distill --runs /tmp/distill
    .venv/bin/python benchmarks/distill_cpu.py --out /tmp/distill-quick --runs /tmp/distill-quick-runs --quick
    .venv/bin/python benchmarks/distill_cpu.py --out DIR --runs DIR --parts embedding    # one part
    .venv/bin/python benchmarks/distill_cpu.py --out DIR --runs DIR --parts throughput   # part 2's throughput again

1. ``mlm``: `fastbert pretrain` trains a BERT teacher; `fastbert distill` distils it into a DistilBERT student with
   half its layers (the triple loss, the student initialised from the teacher's layers); the same student is trained
   from scratch (random initialisation, masked-LM loss only) for the same steps on the same batches. Held-out
   masked-LM loss and accuracy of all three on the same held-out documents and masks.
2. ``embedding``: all-MiniLM-L6-v2 -> 3 layers on the CPython corpus (MSE + cosine of the embeddings, cosine of the
   hidden states token by token, half of each batch sentence pairs); held-out mean cosine between student and
   teacher embeddings; `fastbert finetune` topic / pair / code with the teacher and with the student (same steps,
   data, seed); encode throughput of each as `fastbert embed` encodes (`fastbert.embedding.Embedder`), teacher and
   student interleaved chunk by chunk, and where each one's time goes (tokenisation, embeddings, layers, the rest).
3. ``roberta``: a short `fastbert pretrain --objective roberta` (byte-level BPE), its held-out MLM loss before and
   after, and decode(encode(text)) == text on the held-out sentences plus non-ASCII sentences.
4. ``mlm-ablation`` (not in the default parts; after ``mlm``): the triple loss on a randomly initialised student,
   to separate what the copied layers give from what the loss gives.
5. ``throughput`` (not in the default parts; after ``embedding``): part 2's encode throughput alone, for the student
   under --runs (to re-measure on a quiet machine).
6. ``pair-distill`` (not in the default parts): the pair task with task distillation (`fastbert finetune
   --teacher`): the teacher fine-tuned for 1 epoch and for 5 epochs of resampled pairs; the student (--student, default
   part 2's) fine-tuned alone the same two ways, and with each fine-tuned teacher; held-out accuracy of each on all
   the held-out pairs, written after every run.

The runs (checkpoints, models, metrics.jsonl, curves) stay under --runs; --out gets ``<part>.json`` for each part
(figures, settings, machine, CPU flags) and the curves. Every figure written comes from the run just made.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import io
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from fastbert.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("mlm", "embedding", "roberta", "mlm-ablation", "throughput", "pair-distill")
FINETUNE_TASKS = ("topic", "pair", "code")
# Sentences outside ASCII for the byte-level BPE round trip: accents, CJK, Cyrillic, Greek, emoji, symbols.
NON_ASCII = ("Café, naïve façade: déjà vu in São Paulo and Zürich.", "日本語のテキストも、正しく戻ります。",
             "Привет, мир! Это проверка.", "Ελληνικά: αβγ δεζ.", "Emoji 🙂🚀 and symbols ∑ ≤ ≠ → ✓.",
             "Tabs\tand  double  spaces , before punctuation .", "한국어 문장과 العربية والعبرية עברית.")


def machine() -> dict:
    """CPU model, flags, cores, load, versions: what each result records about where it ran (``cpu_flags``: the
    CPU's features among `fastbert.cpu.FEATURES`, space-separated)."""
    from fastbert.bench.machine import git_commit, machine_info

    info = machine_info("cpu")
    return {"cpu": info["cpu"], "cpu_flags": " ".join(info["cpu_flags"]) or "none", "cores": info["cpu_cores"],
            "load_average": info["load_average"], "torch_threads": info["torch_threads"],
            "platform": info["platform"], "python": info["python"], "torch": info["versions"]["torch"],
            "transformers": info["versions"]["transformers"], "commit": git_commit(ROOT) or "unknown"}


def write_json(path: Path, record: dict) -> None:
    write_atomic(path, (json.dumps(record, indent=2) + "\n").encode())


def last_eval(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("eval")][-1]


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


# ------------------------------------------------------------------------------------------------------ 1. mlm
def part_mlm(runs: Path, out: Path, size: dict) -> dict:
    """Teacher pretraining, distilled student, scratch student; held-out MLM figures of all three."""
    from fastbert.training.distill import DistillSettings, distill
    from fastbert.training.loop import latest_checkpoint
    from fastbert.training.pretrain import PretrainSettings, pretrain

    started = time.time()
    teacher_run = fresh(runs / "mlm-teacher")
    pretrain(PretrainSettings(output_dir=str(teacher_run), corpus="cpython", pack=True, hidden_size=size["hidden"],
                              num_layers=size["teacher_layers"], num_heads=size["heads"], vocab_size=size["vocab"],
                              max_length=size["max_length"], batch_size=32, learning_rate=1e-3,
                              max_steps=size["teacher_steps"], save_every=0, eval_every=0, threads=2,
                              progress=False, log_every=50))
    teacher = latest_checkpoint(teacher_run)
    common = dict(teacher=str(teacher), objective="mlm", corpus="cpython", pack=True, max_length=size["max_length"],
                  batch_size=32, max_steps=size["student_steps"], save_every=0, eval_every=0, threads=2,
                  progress=False, log_every=50, eval_sentences=size["eval"])
    runs_done = {}
    for name, extra in (("distilled", {}), ("scratch", {"init": "random", "alpha_ce": 0.0, "alpha_cos": 0.0})):
        run_dir = fresh(runs / f"mlm-{name}")
        distill(DistillSettings(output_dir=str(run_dir), **common, **extra))
        runs_done[name] = {"eval": last_eval(run_dir), "summary": json.loads((run_dir / "summary.json").read_text()),
                           "settings": {**common, **extra}}
        shutil.copyfile(run_dir / "loss_curve.png", out / f"mlm-{name}-loss_curve.png")
    distilled, scratch = runs_done["distilled"]["eval"], runs_done["scratch"]["eval"]
    return {"teacher_checkpoint": str(teacher), "teacher_run": json.loads((teacher_run / "summary.json").read_text()),
            "held_out": {"teacher": {"mlm_loss": distilled["eval_teacher_mlm_loss"],
                                     "mlm_accuracy": distilled["eval_teacher_mlm_accuracy"]},
                         "distilled": {"mlm_loss": distilled["eval_mlm_loss"],
                                       "mlm_accuracy": distilled["eval_mlm_accuracy"]},
                         "scratch": {"mlm_loss": scratch["eval_mlm_loss"],
                                     "mlm_accuracy": scratch["eval_mlm_accuracy"]},
                         "masked_tokens": distilled["eval_mlm_tokens"]},
            "distillation_gain": {"mlm_loss": scratch["eval_mlm_loss"] - distilled["eval_mlm_loss"],
                                  "mlm_accuracy": distilled["eval_mlm_accuracy"] - scratch["eval_mlm_accuracy"]},
            "runs": runs_done, "size": size, "wall_s": round(time.time() - started, 1)}


def part_mlm_ablation(runs: Path, out: Path, size: dict) -> dict:
    """The triple loss on a randomly initialised student (the teacher of part 1, its settings otherwise): how much
    of part 1's gain comes from the loss alone, without the copied layers. Needs part 1's runs under --runs."""
    from fastbert.training.distill import DistillSettings, distill

    started = time.time()
    settings = json.loads((out / "mlm.json").read_text())["runs"]["distilled"]["settings"]
    run_dir = fresh(runs / "mlm-random-init-triple-loss")
    distill(DistillSettings(output_dir=str(run_dir), **settings, init="random"))
    shutil.copyfile(run_dir / "loss_curve.png", out / "mlm-ablation-loss_curve.png")
    found = last_eval(run_dir)
    return {"settings": {**settings, "init": "random"},
            "held_out": {"mlm_loss": found["eval_mlm_loss"], "mlm_accuracy": found["eval_mlm_accuracy"],
                         "masked_tokens": found["eval_mlm_tokens"]},
            "summary": json.loads((run_dir / "summary.json").read_text()), "size": size,
            "wall_s": round(time.time() - started, 1)}


# ------------------------------------------------------------------------------------------------ 2. embedding
def encode_throughput(embedders: dict, sentences: list[str], rounds: int, chunk: int = 256) -> dict:
    """Encode throughput of each checkpoint as `fastbert embed` encodes (`fastbert.embedding.Embedder`: its
    tokenizer, length-sorted token-budget batches, the padding-free encoder, pooling and normalisation as the
    checkpoint declares), interleaved: every round walks the sentences in chunks of ``chunk`` (one ``embed`` call
    each, as one window of `fastbert embed`) and encodes each chunk with every model in turn, the order reversed
    from chunk to chunk, so a change of the machine's load hits all of them alike. Each model first encodes all the
    sentences once, untimed: the `auto` backend times its candidates on each new shape it meets, a cost a long
    `fastbert embed` run pays once, not throughput. Returns per model the seconds and sentences per second of each
    round, and their totals."""
    for embedder in embedders.values():
        embedder.embed(sentences)
    seconds = {name: [0.0] * rounds for name in embedders}
    names = list(embedders)
    for round_ in range(rounds):
        for index, start in enumerate(range(0, len(sentences), chunk)):
            for name in names if index % 2 == 0 else names[::-1]:
                began = time.perf_counter()
                embedders[name].embed(sentences[start:start + chunk])
                seconds[name][round_] += time.perf_counter() - began
    return {name: {"seconds_per_round": values, "sentences_per_s": [len(sentences) / v for v in values],
                   "sentences_per_s_total": rounds * len(sentences) / sum(values)}
            for name, values in seconds.items()}


def fixed_costs(embedder, sentences: list[str]) -> dict:
    """Where one model's encode time goes in one pass of its (warmed-up) `Embedder` over ``sentences`` (seconds):
    tokenisation; in the model's forward, the embedding layer, the encoder layers and the rest (packing the padded
    batch into sequences and back, the pooler); outside the forward (building the padded batch, pooling,
    normalising)."""
    found = dict.fromkeys(("tokenize", "embed_batches", "forward", "embeddings", "layers"), 0.0)
    began = time.perf_counter()
    token_lists, _ = embedder.tokenize(sentences)
    found["tokenize"] = time.perf_counter() - began
    clock: dict[object, float] = {}

    def timed(module: torch.nn.Module, name: str) -> list:
        def before(*_):
            clock[module] = time.perf_counter()

        def after(*_):
            found[name] += time.perf_counter() - clock[module]
        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    model = embedder.model
    handles = timed(model, "forward") + timed(model.embeddings, "embeddings")
    for layer in model.layers:
        handles += timed(layer, "layers")
    for batch in embedder.batches([len(t) for t in token_lists]):
        began = time.perf_counter()
        embedder.embed_batch([token_lists[i] for i in batch])
        found["embed_batches"] += time.perf_counter() - began
    for handle in handles:
        handle.remove()
    found["forward_other"] = found["forward"] - found["embeddings"] - found["layers"]
    found["outside_forward"] = found["embed_batches"] - found["forward"]
    found["total"] = found["tokenize"] + found["embed_batches"]
    found["tokens"] = sum(len(t) for t in token_lists)
    return found


def part_embedding(runs: Path, out: Path, size: dict) -> dict:
    """all-MiniLM-L6-v2 -> 3 layers; held-out cosine; finetune tasks with both; encode throughput of both."""
    from fastbert.common.resolve import default_model_dir
    from fastbert.training.distill import DistillSettings, distill
    started = time.time()
    teacher = default_model_dir()
    run_dir = fresh(runs / "embedding-student")
    settings = dict(objective="embedding", student_layers=3, corpus="cpython", batch_size=size["batch"],
                    max_steps=size["steps"], learning_rate=size["lr"], save_every=0, eval_every=size["eval_every"],
                    threads=2, progress=False, log_every=25, eval_sentences=size["eval"], alpha_cos=size["alpha_cos"],
                    alpha_hidden=size["alpha_hidden"], pairs=size["pairs"])
    # the teacher's fine-tunes do not depend on the student: they run in another process during the distillation
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        teacher_runs = pool.submit(finetune_all, "teacher", teacher, runs, size)
        distill(DistillSettings(output_dir=str(run_dir), **settings))
        shutil.copyfile(run_dir / "loss_curve.png", out / "embedding-loss_curve.png")
        student_runs = finetune_all("student", str(run_dir / "model"), runs, size)
        found = {"teacher": teacher_runs.result(), "student": student_runs}
    student = str(run_dir / "model")
    evals = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("eval")]
    record: dict = {"teacher": teacher, "student": student, "distill_settings": settings,
                    "held_out_cosine": {"before": evals[0]["eval_cosine"], "after": evals[-1]["eval_cosine"],
                                        "sentences": evals[-1]["eval_sentences"],
                                        "curve": [(r["step"], r["eval_cosine"]) for r in evals]},
                    "distill_summary": json.loads((run_dir / "summary.json").read_text()), "finetune": {}}
    for task in FINETUNE_TASKS:
        for name in ("teacher", "student"):
            record["finetune"].setdefault(task, {})[name] = found[name][task]
        pair = record["finetune"][task]
        pair["student_share_of_teacher"] = pair["student"]["accuracy"] / pair["teacher"]["accuracy"]
    record["throughput"] = throughput_record(teacher, student, size)
    record["parameters"] = {name: parameters(model_dir) for name, model_dir in (("teacher", teacher),
                                                                                ("student", student))}
    record.update(size=size, wall_s=round(time.time() - started, 1))
    return record


def finetune_all(name: str, model_dir: str, runs: Path, size: dict) -> dict:
    """`fastbert finetune` of one model on each task (same data, steps, seed for teacher and student)."""
    from fastbert.training.finetune import FinetuneSettings, finetune

    torch.set_num_threads(2)
    found = {}
    for task in FINETUNE_TASKS:
        result = finetune(FinetuneSettings(task=task, output_dir=str(fresh(runs / f"ft-{task}-{name}")),
                                           model_dir=model_dir, max_steps=size["ft_steps"], batch_size=16,
                                           learning_rate=2e-4, eval_limit=size["ft_eval"], seed=0, device="cpu",
                                           progress=False, log_every=20))
        found[task] = {"accuracy": result["evaluation"]["accuracy"], "macro_f1": result["evaluation"]["macro_f1"],
                       "majority_baseline": result["majority_baseline"]["accuracy"],
                       "steps": result["training"]["steps"], "held_out": result["held_out"]["examples"],
                       "seconds": result["training"]["seconds_this_run"]}
    return found


def throughput_record(teacher: str, student: str, size: dict) -> dict:
    """`encode_throughput` of teacher and student, interleaved, on the first sentences of the CPython corpus, their
    ratio, and `fixed_costs` of each."""
    from fastbert.embedding import Embedder
    from fastbert.training.corpus import cpython_sentences

    sentences = list(cpython_sentences(size["throughput_sentences"]))
    embedders = {"teacher": Embedder(teacher, device="cpu"), "student": Embedder(student, device="cpu")}
    found = encode_throughput(embedders, sentences, size["throughput_rounds"])
    t, s = found["teacher"], found["student"]
    found["speedup"] = s["sentences_per_s_total"] / t["sentences_per_s_total"]
    found["speedup_per_round"] = [a / b for a, b in zip(t["seconds_per_round"], s["seconds_per_round"], strict=True)]
    found["speedup_median_round"] = statistics.median(found["speedup_per_round"])
    found["sentences"], found["rounds"] = len(sentences), size["throughput_rounds"]
    found["fixed_costs"] = {name: fixed_costs(embedder, sentences) for name, embedder in embedders.items()}
    return found


def part_throughput(runs: Path, out: Path, size: dict) -> dict:
    """The encode throughput of part 2 alone (`throughput_record`), for the student part 2 left under --runs: to
    re-measure on a quiet machine without distilling again (throughput depends on the architecture, not on the
    weights)."""
    from fastbert.common.resolve import default_model_dir

    started = time.time()
    teacher, student = default_model_dir(), str(runs / "embedding-student" / "model")
    if not os.path.isdir(student):
        raise SystemExit(f"distill_cpu: no student at {student}: run --parts embedding first")
    return {"teacher": teacher, "student": student, "throughput": throughput_record(teacher, student, size),
            "size": size, "wall_s": round(time.time() - started, 1)}


# ------------------------------------------------------------------------------------ 6. pair task distillation
PAIR_RUNS = (  # name, model, teacher run (None: fine-tuned alone), epochs, resampled pairs
    ("teacher-1ep", "teacher", None, 1, False),
    ("student-1ep", "student", None, 1, False),
    ("student-kd-1ep", "student", "teacher-1ep", 1, False),
    ("student-5ep", "student", None, 5, True),
    ("student-kd-5ep", "student", "teacher-1ep", 5, True),
    ("teacher-5ep", "teacher", None, 5, True),
    ("student-kd-5ep-from-5ep", "student", "teacher-5ep", 5, True),
)


def part_pair_distill(runs: Path, out: Path, size: dict, student: str | None = None) -> dict:
    """`fastbert finetune --task pair` of the teacher and the student, alone and with a fine-tuned teacher (see the
    module docstring); every held-out pair; the record is written to ``out`` after each run."""
    from fastbert.common.resolve import default_model_dir
    from fastbert.training.finetune import FinetuneSettings, finetune

    started = time.time()
    models = {"teacher": default_model_dir(), "student": student or str(runs / "embedding-student" / "model")}
    if not os.path.isdir(models["student"]):
        raise SystemExit(f"distill_cpu: no student at {models['student']}: give --student DIR or run --parts embedding")
    record: dict = {"models": models, "size": size, "runs": {}}
    for name, model, teacher, epochs, resample in PAIR_RUNS[:size["runs"]]:
        rate = size["teacher_lr"] if model == "teacher" else size["student_lr"]
        settings = FinetuneSettings(
            task="pair", output_dir=str(fresh(runs / f"pair-{name}")), model_dir=models[model], epochs=epochs,
            batch_size=16, learning_rate=rate, train_limit=size["train"], eval_limit=size["eval"], seed=0,
            device="cpu", progress=False, log_every=50, resample_pairs=resample,
            teacher=str(runs / f"pair-{teacher}" / "model") if teacher else None)
        result = finetune(settings)
        record["runs"][name] = {
            "model": model, "teacher": teacher, "epochs": epochs, "resample_pairs": resample, "learning_rate": rate,
            "accuracy": result["evaluation"]["accuracy"], "macro_f1": result["evaluation"]["macro_f1"],
            "held_out": result["held_out"]["examples"], "steps": result["training"]["steps"],
            "seconds": result["training"]["seconds_this_run"], "teacher_figures": result.get("teacher")}
        record["wall_s"] = round(time.time() - started, 1)
        write_json(out / "pair-distill.json", {**record, "machine": machine(), "partial": True})
    return record


def parameters(model_dir: str) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(os.path.join(model_dir, "model.safetensors")).values())


# -------------------------------------------------------------------------------------------------- 3. roberta
def part_roberta(runs: Path, out: Path, size: dict) -> dict:
    """A short byte-level-BPE RoBERTa pretraining; held-out MLM loss first/last; the tokenizer's round trip."""
    import transformers

    from fastbert.training.corpus import cpython_documents
    from fastbert.training.loop import latest_checkpoint
    from fastbert.training.pretrain import PretrainSettings, hold_out, pretrain

    started = time.time()
    run_dir = fresh(runs / "roberta-bpe")
    log = io.StringIO()
    pretrain(PretrainSettings(output_dir=str(run_dir), corpus="pydoc", objective="roberta", pack=True,
                              hidden_size=size["hidden"], num_layers=size["layers"], num_heads=size["heads"],
                              vocab_size=size["vocab"], max_length=size["max_length"], batch_size=32,
                              learning_rate=1e-3, max_steps=size["steps"], save_every=0,
                              eval_every=size["eval_every"], threads=2, progress=False, log_every=50), log=log)
    shutil.copyfile(run_dir / "loss_curve.png", out / "roberta-loss_curve.png")
    checkpoint = latest_checkpoint(run_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForMaskedLM.from_pretrained(checkpoint)
    _, held_docs = hold_out(cpython_documents("pydoc"), 0.05, 0)
    held = [s for doc in held_docs for s in doc]
    texts = held + list(NON_ASCII)
    failures = [t for t in texts if tokenizer.decode(tokenizer(t)["input_ids"], skip_special_tokens=True) != t]
    unknown = sum(tokenizer(t)["input_ids"].count(tokenizer.unk_token_id) for t in texts)
    evals = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
             if r.get("eval")]
    return {"tokenizer_class": type(tokenizer).__name__, "model_class": type(model).__name__,
            "vocab_size": len(tokenizer), "specials": {t: tokenizer.convert_tokens_to_ids(t)
                                                       for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")},
            "held_out_mlm_loss": [(r["step"], r["eval_mlm_loss"]) for r in evals],
            "held_out_mlm_accuracy": [(r["step"], r["eval_mlm_accuracy"]) for r in evals],
            "round_trip": {"texts": len(texts), "held_out_sentences": len(held), "non_ascii_sentences": len(NON_ASCII),
                           "exact": len(texts) - len(failures), "failures": failures[:10],
                           "unknown_tokens": unknown},
            "log_first_line": log.getvalue().splitlines()[0], "size": size, "wall_s": round(time.time() - started, 1)}


SIZES = {
    "full": {"mlm": dict(hidden=128, heads=2, teacher_layers=4, vocab=5000, max_length=64, teacher_steps=500,
                         student_steps=300, eval=512),
             "embedding": dict(batch=16, steps=200, lr=1e-4, eval_every=100, eval=512, ft_steps=40, ft_eval=500,
                               throughput_sentences=2048, throughput_rounds=3, alpha_cos=1.0, alpha_hidden=1.0,
                               pairs=0.5),
             "roberta": dict(hidden=128, heads=2, layers=2, vocab=5000, max_length=64, steps=300, eval_every=100),
             "mlm-ablation": {}, "throughput": dict(throughput_sentences=2048, throughput_rounds=3),
             "pair-distill": dict(runs=len(PAIR_RUNS), train=None, eval=None, teacher_lr=2e-4, student_lr=3e-4)},
    "quick": {"mlm": dict(hidden=32, heads=2, teacher_layers=4, vocab=500, max_length=32, teacher_steps=10,
                          student_steps=5, eval=32),
              "embedding": dict(batch=8, steps=3, lr=1e-4, eval_every=0, eval=16, ft_steps=2, ft_eval=16,
                                throughput_sentences=32, throughput_rounds=1, alpha_cos=1.0, alpha_hidden=1.0,
                                pairs=0.5),
              "roberta": dict(hidden=32, heads=2, layers=1, vocab=500, max_length=32, steps=10, eval_every=5),
              "mlm-ablation": {}, "throughput": dict(throughput_sentences=32, throughput_rounds=1),
              "pair-distill": dict(runs=3, train=32, eval=16, teacher_lr=2e-4, student_lr=3e-4)},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where the JSON figures and curves go")
    parser.add_argument("--runs", required=True, help="where the runs (checkpoints, models) go")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a sanity run of the whole script")
    parser.add_argument("--parts", nargs="*", choices=PARTS, default=list(PARTS[:3]),
                        help="default: mlm embedding roberta; mlm-ablation reuses mlm's teacher and settings, "
                        "throughput embedding's student")
    parser.add_argument("--student", default=None, help="pair-distill: the student (default: embedding's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    runs.mkdir(parents=True, exist_ok=True)
    sizes = SIZES["quick" if args.quick else "full"]
    functions = {"mlm": part_mlm, "embedding": part_embedding, "roberta": part_roberta,
                 "mlm-ablation": part_mlm_ablation, "throughput": part_throughput,
                 "pair-distill": functools.partial(part_pair_distill, student=args.student)}
    for part in args.parts:
        began = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        record = functions[part](runs, out, sizes[part])
        record.update(part=part, quick=args.quick, started=began, machine=machine(),
                      ended=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        write_json(out / f"{part}.json", record)
        sys.stderr.write(f"distill_cpu: {part} done in {record['wall_s']} s -> {out / (part + '.json')}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
