"""Keep freed host memory in the process, so that XLA:CPU's per-step buffers are not faulted in
again every step; on for every posttrain command.

XLA:CPU allocates each execution's scratch buffers with `malloc` and frees them when the
execution ends. glibc hands an allocation above its mmap threshold (128 KiB, rising to at most
32 MiB) a fresh `mmap` and unmaps it on `free`; an allocation of more than 64 MiB made from any
thread but the main one gets an `mmap` whatever the threshold (a thread arena's heap is at most
64 MiB). Either way the next step's buffers are new pages, which the kernel zeroes and maps one
page fault at a time. Measured on the reference SFT step (batch 16 x 256; `python -m
benchmarks.host_memory`): ~131,000 minor faults (~540 MB, one block allocated by XLA's dispatch
threads) per step with glibc's defaults, none with these settings, and the step ~1.2x faster
(BENCHMARKS.md). The settings:

- an mmap threshold of 1 GiB (`M_MMAP_THRESHOLD`): smaller blocks come from a heap;
- no trimming in practice (`M_TRIM_THRESHOLD` 2 GiB - 1, the largest it takes): freed blocks
  stay mapped, and the next step reuses them;
- in processes that train, one malloc arena (`M_ARENA_MAX` 1), so that XLA's dispatch threads
  allocate from the main heap, which grows without the 64 MiB cap. Nothing less moves the big
  block off `mmap`, and it has a price: every thread then takes one arena's lock, which costs
  the JAX engine's decode loop (its executor threads make many small allocations; strace shows
  4x the futex calls) 5-10%. Processes that only generate (`posttrain generate` / `eval`, Ray
  rollout workers) keep per-thread arenas (`thread_arenas`); the colocated engine shares its
  trainer's process and its one arena.

The cost otherwise: a process keeps its peak heap instead of returning it to the kernel (what
tcmalloc and jemalloc do too). Accelerator memory is untouched: only host malloc.

`POSTTRAIN_HOST_MALLOC=default` keeps glibc's behaviour. The settings also go into the
environment (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, which glibc
reads at start-up), so every process the run starts (Ray workers, trainer-group hosts, the
reward pool) starts with them. A `MALLOC_*` variable already set is left to the user (glibc
applied it at start-up). Only glibc on Linux is tuned; elsewhere this does nothing.
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
MARKER = "POSTTRAIN_HOST_MALLOC_SET"  # the variables above that posttrain set, not the user


def wanted(environ: dict | None = None) -> bool:
    e = os.environ if environ is None else environ
    return e.get("POSTTRAIN_HOST_MALLOC", "keep").strip().lower() != "default"


def _libc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory(one_arena: bool = True) -> bool:
    """Apply the settings to this process (call it before JAX runs anything: a thread keeps the
    arena it first allocated from) and put them in the environment for its children; without
    `one_arena` (a process that only generates), the thresholds only. Returns whether glibc
    took them."""
    libc = _libc() if wanted() else None
    if libc is None:
        return False
    ok = True
    for name, (param, value) in SETTINGS.items():
        if name in os.environ or (param == M_ARENA_MAX and not one_arena):
            continue  # a variable set is the user's choice, applied by glibc at start-up
        if libc.mallopt(param, value) != 1:
            ok = False
            continue
        os.environ[name] = str(value)
        os.environ[MARKER] = ",".join(sorted({*_set_by_us(), name}))
    return ok


def _set_by_us() -> set[str]:
    return {n for n in os.environ.get(MARKER, "").split(",") if n}


def thread_arenas() -> None:
    """In a process started with one arena (a Ray rollout worker inherits the trainer's
    environment) that only generates: let threads that have not allocated yet, such as XLA's,
    take arenas of their own again (glibc's default limit, 8 per core), unless the user chose
    the limit."""
    libc = _libc()
    if libc is not None and "MALLOC_ARENA_MAX" in _set_by_us():
        libc.mallopt(M_ARENA_MAX, 8 * (os.cpu_count() or 1))
