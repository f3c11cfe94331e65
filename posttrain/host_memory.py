"""Keep freed host memory in a training process, so that XLA:CPU's per-step buffers are not
faulted in again every step; on in every process that trains (`posttrain run`, trainer-group
hosts).

XLA:CPU allocates each execution's scratch buffers with `malloc` and frees them when the
execution ends. glibc hands an allocation above its mmap threshold (128 KiB, rising to at most
32 MiB) a fresh `mmap` and unmaps it on `free`; an allocation of more than 64 MiB made from any
thread but the main one gets an `mmap` whatever the threshold (a thread arena's heap is at most
64 MiB). Either way the next step's buffers are new pages, which the kernel zeroes and maps one
page fault at a time. On the reference SFT step (batch 16 x 256) that is one ~540 MB block,
allocated by XLA's dispatch threads: ~131,000 minor faults per step with glibc's defaults, none
with the settings below, and the step ~1.2x faster (`python -m benchmarks.host_memory`,
BENCHMARKS.md). The settings:

- one malloc arena (`M_ARENA_MAX` 1), so that XLA's threads allocate from the main heap, which
  grows without the 64 MiB cap (nothing less moves the block off `mmap`);
- an mmap threshold of 1 GiB (`M_MMAP_THRESHOLD`): smaller blocks come from the heap;
- no trimming in practice (`M_TRIM_THRESHOLD` 2 GiB - 1, the largest it takes): freed blocks
  stay mapped, and the next step reuses them.

The price: a process keeps its peak heap instead of returning it to the kernel (as tcmalloc and
jemalloc do), and every thread takes one arena's lock. The second costs the JAX engine's decode
loop, whose executor threads make many small allocations, 4-12% (strace: 4x the futex calls),
which is why processes that only generate (`posttrain generate` / `eval`, Ray rollout workers,
reward workers) keep glibc's defaults; a colocated engine shares its trainer's process.
Accelerator memory is untouched: only host malloc.

Applied by `mallopt` in the process itself, before JAX starts its threads (a thread keeps the
arena it first allocated from), and not put in the environment, so that the processes a run
starts keep glibc's defaults unless they train too. A `MALLOC_*` variable the user set is left
alone (glibc applied it at start-up); `POSTTRAIN_HOST_MALLOC=default` turns all of this off
(`keep`, the default, leaves it on; any other value is an error).
Only glibc on Linux is tuned; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import platform

from posttrain.errors import UserError

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # malloc.h
SETTINGS = {"MALLOC_ARENA_MAX": (M_ARENA_MAX, 1),
            "MALLOC_MMAP_THRESHOLD_": (M_MMAP_THRESHOLD, 1 << 30),
            "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, (1 << 31) - 1)}  # mallopt takes an int


def wanted() -> bool:
    choice = os.environ.get("POSTTRAIN_HOST_MALLOC", "keep").strip().lower()
    if choice not in ("keep", "default"):
        raise UserError(f"POSTTRAIN_HOST_MALLOC={choice!r}: expected 'keep' (posttrain's malloc "
                        "settings in processes that train) or 'default' (glibc's)")
    return choice == "keep"


def keep_freed_memory() -> bool:
    """Apply the settings to this process; call it before JAX runs anything. Returns whether
    glibc took them all (False where turned off or not glibc)."""
    if not wanted() or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    taken = [libc.mallopt(param, value) == 1 for name, (param, value) in SETTINGS.items()
             if name not in os.environ]  # every one tried, even after a refusal
    return all(taken)
