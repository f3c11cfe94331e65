"""Fault points: named moments where a crash test can kill the run for real.

`POSTTRAIN_FAULT=NAME:N` makes this process SIGKILL itself the N-th time (from 1) it reaches
the point `NAME`; unset, `point` is one dictionary lookup. The points:

- `step`: an update was dispatched (pretrain/SFT) or applied (RL);
- `checkpoint_write`: an asynchronous checkpoint save has just started, its files are being
  written by background threads;
- `weight_sync`: between two buckets of a weight push to the rollout engines;
- `reward`: the reward workers are scoring a batch;
- `eval`: during held-out evaluation.

SIGKILL is what an OOM killer, a preempted VM or `kill -9` does: no handler runs, nothing is
flushed. `benchmarks/faults.py` and the resume tests drive it, together with kills from outside
at random times.
"""

from __future__ import annotations

import os
import signal

POINTS = ("step", "checkpoint_write", "weight_sync", "reward", "eval")
_hits: dict[str, int] = {}


def _target() -> tuple[str, int] | None:
    spec = os.environ.get("POSTTRAIN_FAULT")
    if not spec:
        return None
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"POSTTRAIN_FAULT={spec}: unknown point {name!r} (one of {', '.join(POINTS)})")
    return name, int(n or 1)


def point(name: str) -> None:
    target = _target()
    if target is None or target[0] != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == target[1]:
        os.kill(os.getpid(), signal.SIGKILL)
