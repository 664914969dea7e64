"""OpenMP worker threads and the thread that runs the model.

torch's CPU kernels (ATen's parallel loops, oneDNN) run on OpenMP, whose GNU runtime (libgomp, what torch's wheels
load) keeps a team of worker threads for every thread that has started a parallel region, for as long as that
thread lives. Once the workers of all teams outnumber the CPUs, libgomp stops spinning between regions (100 spins
instead of 300,000): each parallel region then waits for its workers to wake from the kernel. A model loaded in the
main thread and run in another (a server's model thread) therefore runs about half as fast on 2 cores as in the
main thread (MiniLM bf16: 10 ms instead of 5 per request-sized forward), and elementwise ops up to 3.6 times
slower. `release_openmp_threads` ends the calling thread's team (OpenMP 5's ``omp_pause_resource_all``), so that
the thread that runs the model next is the only one with workers.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

OMP_PAUSE_SOFT = 1


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime when it is GNU's (libgomp), or None (another runtime, none, or not Linux). Looked up
    through torch's own CPU library, already loaded (``RTLD_NOLOAD``): its dependencies resolve the symbol to the
    copy torch uses, whatever its file is called (some wheels ship a renamed ``libgomp-<hash>.so``), rather than
    another copy the process may hold. LLVM's and Intel's runtimes (which export ``__kmpc_fork_call``) pause every
    thread's workers: not what this module wants."""
    if not sys.platform.startswith("linux") or not hasattr(os, "RTLD_NOLOAD"):
        return None
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:
        return None
    if not hasattr(library, "omp_pause_resource_all") or hasattr(library, "__kmpc_fork_call"):
        return None
    return library


def release_openmp_threads() -> bool:
    """End the calling thread's OpenMP worker team (after this thread ran the model's loading or warm-up, before
    another thread runs it): True when libgomp released it (or none was held), False when torch does not run on
    libgomp (nothing done). With libgomp, safe at any time outside a parallel region; a later parallel region in
    this thread starts a new team."""
    library = _openmp_runtime()
    if library is None:
        return False
    return library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
