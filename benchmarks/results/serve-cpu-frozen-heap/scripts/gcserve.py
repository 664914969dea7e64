"""`fastbert serve ARGS` with every garbage collection over 5 ms logged to stderr (generation, ms, thread, objects
frozen), the types of the objects the collector tracks once (at the first over 50 ms), and GC_THRESH="a,b,c" set as
gc.set_threshold(a, b, c)."""

import collections
import gc
import os
import sys
import threading
import time

from fastbert.cli import main

started: dict[str, float] = {}
shown: list[int] = []


def log_collection(phase: str, info: dict) -> None:
    if phase == "start":
        started["t"] = time.perf_counter()
        return
    ms = (time.perf_counter() - started["t"]) * 1e3
    if ms <= 5:
        return
    print(f"GC gen{info['generation']} {ms:.1f} ms collected {info['collected']} in "
          f"{threading.current_thread().name} frozen {gc.get_freeze_count()}", file=sys.stderr, flush=True)
    if ms > 50 and not shown:
        shown.append(1)
        tracked = gc.get_objects()
        kinds = collections.Counter(type(o).__qualname__ for o in tracked)
        print("TRACKED", len(tracked), kinds.most_common(25), file=sys.stderr, flush=True)


gc.callbacks.append(log_collection)
if os.environ.get("GC_THRESH"):
    gc.set_threshold(*map(int, os.environ["GC_THRESH"].split(",")))
sys.exit(main(sys.argv[1:]))
