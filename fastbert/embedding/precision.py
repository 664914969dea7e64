"""``--dtype auto`` for embeddings on a CPU with int8 dot products: int8 where it embeds faster than the float
precision ``auto`` picks (`fastbert.quantization.precision_for`) and stays within `INT8_MIN_COSINE` of float32.

int8's accuracy depends on the checkpoint (all-MiniLM-L6-v2: worst cosine 0.9975 to float32 on 200 sentences), so
the choice is measured per checkpoint, once per machine and thread count: the worst cosine between float32's and
int8's embeddings of `PROBE_TEXTS`, and both precisions' time for a batch of 8 x 128 tokens, interleaved. The result
is kept beside the tuning cache (`fastbert.backends.tuning`; ``fastbert tune --clear`` forgets it). With measuring
off (``FASTBERT_TUNE=0``) and nothing kept, the float precision runs."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fastbert.backends import tuning
from fastbert.cpu import INT8_DOT, cpu_flags
from fastbert.embedding.checkpoint import config_digest
from fastbert.files import write_atomic
from fastbert.quantization import announce_once, int8_unavailable

INT8_MIN_COSINE = 0.995  # the accuracy int8 must keep to be chosen unasked
INT8_MIN_SPEEDUP = 1.05  # and the speed-up over the float precision, beyond a few rounds' noise
PROBE_BATCH = (8, 128)  # texts x tokens of the timed batch
PROBE_ROUNDS = 5
# (the tuning cache's state, probe key) -> probe, for this process: `tuning.forget` / `tuning.clear` (``fastbert
# tune --clear``) and a move of the cache directory change the state, so this process measures (or reads) again
PROCESS_PROBES: dict[tuple[tuple, str], dict] = {}
# Varied prose, short and long (sentence embeddings' usual inputs): the accuracy probe.
PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password?",
    "Interest rates rose for the third consecutive quarter, pushing mortgage costs to a ten-year high.",
    "A transformer encoder maps a sequence of token embeddings to contextual representations.",
    "She left the keys on the kitchen table before catching the early train to the coast.",
    "Is it safe to eat raw cookie dough?",
    "The committee postponed its decision until the auditors had reviewed every invoice from the last fiscal year.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Our flight was delayed by four hours because of a storm over the Atlantic.",
    "Return the list sorted in ascending order, keeping equal elements in their original order.",
    "The museum's new wing displays sculptures from the early Bronze Age alongside modern installations.",
    "Best hiking trails near the lake",
    "Symptoms include fever, a dry cough and fatigue lasting more than a week.",
    "The contract may be terminated by either party with thirty days' written notice.",
    "He practised the violin every morning, even on holidays, until his teacher finally said he was ready.",
    "Why is the sky blue during the day and red at sunset?",
    "Add two cups of flour, a pinch of salt and stir until the dough no longer sticks to the bowl.",
    "The server returned an error because the request body was not valid JSON.",
    "In 1969, astronauts landed on the Moon and returned safely to Earth.",
    "Cheap flights to Tokyo in April",
    "Regular exercise lowers blood pressure and improves sleep quality in most adults.",
    "The novel follows three generations of a family living through war, migration and reconciliation.",
    "Please confirm the delivery address before we ship your order.",
    "Gradient descent updates the parameters in the direction that reduces the loss the most.",
    "The orchestra tuned their instruments while the audience slowly found their seats in the dim hall.",
    "What time does the pharmacy close on Sundays?",
    "Volcanic eruptions can cool the global climate for several years by injecting ash into the stratosphere.",
    "The library extends its opening hours during the exam period.",
    "Customers who bought this item also bought a protective case and a spare charging cable.",
    "Tides are caused mainly by the gravitational pull of the Moon.",
    "A short walk after dinner helps digestion.",
    "The startup raised its first round of funding from angel investors and a regional venture fund.",
)


def auto_precision(model_dir: str, float_precision: str, float_reason: str | None, device: torch.device) -> str:
    """What ``--dtype auto`` runs embeddings of ``model_dir`` in: int8 where it pays (see the module), else
    ``float_precision`` (what `fastbert.quantization.precision_for` resolved "auto" to, for ``float_reason``).
    Announced once, in one line: the float precision and why, and int8's verdict where int8 was considered (on
    CPU only: int8 never runs elsewhere, and a line on CUDA states the float choice alone)."""
    float_text = float_reason or float_precision
    if device.type != "cpu":
        choice, reason = float_precision, float_text
    else:
        found, why_not = int8_probe(model_dir, float_precision, device)
        if found is None:
            choice, reason = float_precision, f"{float_text}; not int8: {why_not}"
        else:
            verdict = (f"int8 {found['int8_ms']:.1f} ms against {float_precision} {found['float_ms']:.1f} ms for "
                       f"{PROBE_BATCH[0]} x {PROBE_BATCH[1]} tokens, worst cosine {found['worst_cosine']:.4f} to "
                       f"float32 on {len(PROBE_TEXTS)} probe sentences (int8 needs >= {INT8_MIN_COSINE} and "
                       f"{INT8_MIN_SPEEDUP}x)")
            if int8_pays(found):
                choice, reason = "int8", f"int8: {verdict}; the float precision otherwise: {float_text}"
            else:
                choice, reason = float_precision, f"{float_text}; not int8: {verdict}"
    announce_once(f"dtype auto for embeddings: {reason}; --dtype overrides")
    return choice


def int8_probe(model_dir: str, float_precision: str, device: torch.device) -> tuple[dict | None, str | None]:
    """(the probe of int8 against ``float_precision`` for this checkpoint: kept, or measured now; None and why
    when int8 is not considered here)."""
    if int8_unavailable(device) is not None:  # (a device other than the CPU among others)
        return None, int8_unavailable(device)
    if not any(flag in cpu_flags() for flag in INT8_DOT):
        return None, "the CPU has no int8 dot products (VNNI, AMX)"
    key = probe_key(model_dir, float_precision)
    kept = (tuning.state(), key)
    found = PROCESS_PROBES.get(kept) or read_probes().get(key)
    if found is None:
        if not tuning.enabled() or not tuning.can_measure([]):
            return None, "not measured for this model yet, and measuring is off (FASTBERT_TUNE=0)"
        found = measure(model_dir, float_precision)
        write_probe(key, found)
    PROCESS_PROBES[kept] = found
    return found, None


def int8_pays(probe: dict) -> bool:
    """Whether a probe's int8 is accurate enough and faster enough to run unasked."""
    return (probe["worst_cosine"] >= INT8_MIN_COSINE
            and probe["float_ms"] >= INT8_MIN_SPEEDUP * probe["int8_ms"])


def probe_key(model_dir: str, float_precision: str) -> str:
    """The checkpoint (its path, config and weight files' sizes and times), the float precision and the threads."""
    weights = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model_dir).iterdir()
                     if p.suffix in (".safetensors", ".bin"))
    digest = hashlib.sha256(json.dumps([os.path.realpath(model_dir), config_digest(model_dir), weights]).encode())
    return f"{digest.hexdigest()[:16]} int8 vs {float_precision}, {torch.get_num_threads()} threads"


def probes_path() -> Path:
    """The probes' file: beside the CPU's tuning file (same environment key)."""
    path, _ = tuning.key_file(torch.device("cpu"))
    return path.with_name(path.stem + ".dtype-auto.json")


def read_probes() -> dict[str, dict]:
    try:
        probes = json.loads(probes_path().read_text(encoding="utf-8"))
        return probes if isinstance(probes, dict) else {}
    except (OSError, ValueError):
        return {}


def write_probe(key: str, probe: dict) -> None:
    """Keep ``probe`` in the file (merged; a directory that cannot be written leaves it to `PROCESS_PROBES`)."""
    path = probes_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**read_probes(), key: probe}, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass


def measure(model_dir: str, float_precision: str) -> dict:
    """int8's worst cosine to float32 over `PROBE_TEXTS`, and int8's and the float precision's median time for a
    `PROBE_BATCH` of token ids, in interleaved rounds."""
    from fastbert.embedding.embedder import Embedder

    precisions = dict.fromkeys(("float32", "int8", float_precision))
    made = {p: Embedder(model_dir, device="cpu", dtype=p, normalize=True) for p in precisions}
    reference = made["float32"].embed(list(PROBE_TEXTS))[0]
    int8_rows = made["int8"].embed(list(PROBE_TEXTS))[0]
    worst = float(np.min(np.sum(reference * int8_rows, axis=1)))  # both L2-normalised
    texts, tokens = PROBE_BATCH
    generator = torch.Generator().manual_seed(0)
    low = min(1000, made["int8"].config.vocab_size - 1)
    batch = torch.randint(low, made["int8"].config.vocab_size, (texts, tokens), generator=generator).tolist()
    timed = {"int8": made["int8"], "float": made[float_precision]}
    times: dict[str, list[float]] = {name: [] for name in timed}
    for embedder in timed.values():
        embedder.embed_batch(batch)  # warm: packing, the dispatcher's first measurements
    for _ in range(PROBE_ROUNDS):
        for name, embedder in timed.items():
            start = time.perf_counter()
            embedder.embed_batch(batch)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {"worst_cosine": round(worst, 6), "int8_ms": round(statistics.median(times["int8"]), 3),
            "float_ms": round(statistics.median(times["float"]), 3), "float": float_precision,
            "measured": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
