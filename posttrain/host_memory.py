"""Keep freed host memory in the process, so that XLA:CPU's per-step buffers are not faulted in
again every step; on by default for every posttrain command.

XLA:CPU allocates each execution's scratch buffers with `malloc` and frees them when the
execution ends. glibc hands an allocation above its mmap threshold (128 KiB, rising to at most
32 MiB) a fresh `mmap` and unmaps it on `free`; an allocation of more than 64 MiB made from any
thread but the main one gets an `mmap` whatever the threshold (a thread arena's heap is at most
64 MiB). Either way the next step's buffers are new pages, which the kernel zeroes and maps one
page fault at a time. Measured on the reference SFT step (batch 16 x 256, `python -m
benchmarks.host_memory`): ~131,000 minor faults (~540 MB) per step with glibc's defaults, none
with these settings, and the step that much faster (BENCHMARKS.md). The settings:

- one malloc arena (`M_ARENA_MAX` 1), so that every thread allocates from the main heap, which
  grows without the 64 MiB cap;
- an mmap threshold of 1 GiB (`M_MMAP_THRESHOLD`): smaller blocks come from the heap;
- no trimming in practice (`M_TRIM_THRESHOLD` 2 GiB - 1, the largest it takes): freed blocks
  stay mapped, and the next step reuses them.

The cost: the process keeps its peak heap instead of returning it to the kernel (what tcmalloc
and jemalloc do too), and threads share one arena's lock (XLA's threads allocate a few large
blocks per step, not many small ones). Accelerator memory is untouched: only host malloc.

`POSTTRAIN_HOST_MALLOC=default` keeps glibc's behaviour. The settings also go into the
environment (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, which glibc
reads at start-up), so every process the run starts (Ray workers, trainer-group hosts, the
reward pool) starts with them. A `MALLOC_*` variable already set is left to the user (glibc applied
it at start-up). Only glibc on Linux is tuned; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # malloc.h
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int
SETTINGS = {"MALLOC_ARENA_MAX": (M_ARENA_MAX, 1),
            "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, TRIM_THRESHOLD)}


def wanted(environ: dict | None = None) -> bool:
    e = os.environ if environ is None else environ
    return e.get("POSTTRAIN_HOST_MALLOC", "keep").strip().lower() != "default"


def keep_freed_memory() -> bool:
    """Apply the settings to this process (call it before JAX runs anything: arenas that threads
    already hold keep their own rules) and put them in the environment for its children.
    Returns whether glibc took them."""
    if not wanted() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = True
    for name, (param, value) in SETTINGS.items():
        if name in os.environ:  # the user's choice, applied by glibc when the process started
            continue
        if libc.mallopt(param, value) != 1:
            ok = False
            continue
        os.environ[name] = str(value)
    return ok
