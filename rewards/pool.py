"""Scoring completions with isolation: every reward function runs in a worker process.

`RewardPool.score` sends each function one call for the whole batch, in parallel across
`rewards.num_workers` processes, each with a deadline of `rewards.timeout_s`. A function that
raises or hangs (its worker is killed and replaced) gives the fallback for the whole batch; a NaN
or infinite value gives the fallback for that completion; `None` means "not applicable" and is left
out of the weighted total (TRL's convention). Each is counted (`rewards/<name>/errors`,
`.../timeouts`, `.../nans`); with `fallback: drop_group` every group touched by a failure is dropped
instead. `fail_fast: true` turns the first failure into an exception.

Workers are spawned (not forked: the parent holds JAX threads) and resolve functions by their spec
string, so file-path plugins and closures defined in user files need no pickling.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field

import numpy as np

from posttrain import faults
from posttrain.config import RewardsSection
from posttrain.errors import UserError


class RewardError(RuntimeError):
    """A reward function failed and `rewards.fail_fast` is set."""


class _Worker:
    START_TIMEOUT_S = 120.0

    def __init__(self, ctx):
        from rewards._worker import worker_main

        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self._ready = False

    def wait_ready(self) -> None:
        """Block until the process is up: start-up time never counts against a call's timeout."""
        if not self._ready:
            if not self.conn.poll(self.START_TIMEOUT_S):
                raise RuntimeError("reward worker did not start")
            self.conn.recv()
            self._ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class _Pool:
    """Worker processes (`self._workers`) that are stopped together and replaced one by one."""

    _workers: list

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            w.proc.join(timeout=2)
            if w.proc.is_alive():
                w.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx)


@dataclass
class Scores:
    totals: np.ndarray  # [N] weighted total per completion (NaN where dropped)
    per_function: dict[str, np.ndarray]  # label -> [N] (NaN where None / failed)
    keep: np.ndarray  # [N] bool: False for completions of dropped groups
    metrics: dict[str, float] = field(default_factory=dict)


class RewardPool(_Pool):
    def __init__(self, cfg: RewardsSection):
        if not cfg.functions:
            raise UserError("rewards.functions: at least one reward function is required")
        self.cfg = cfg
        from rewards.registry import resolve

        for spec in cfg.functions:  # resolve now so that a bad spec fails at start-up, in the parent
            resolve(spec.fn, spec.adapter)
            if spec.fn == "code":  # refuse now, not on the first batch, if the sandbox cannot start
                from posttrain.sandbox import check_isolation, default_isolation

                check_isolation(spec.kwargs.get("isolation", default_isolation()))
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx) for _ in range(min(cfg.num_workers, len(cfg.functions)))]
        self.counts = {s.label: {"errors": 0, "timeouts": 0, "nans": 0} for s in cfg.functions}

    # ---- one batch -------------------------------------------------------------------------
    def _run_all(self, prompts, completions, columns) -> dict[str, tuple[str, object]]:
        """Run every function once; returns label -> ("ok", values) | ("error"|"timeout", why)."""
        pending = list(self.cfg.functions)
        results: dict[str, tuple[str, object]] = {}
        while pending:
            wave, pending = pending[: len(self._workers)], pending[len(self._workers):]
            for w, spec in zip(self._workers, wave):
                w.wait_ready()
                w.conn.send((spec.fn, spec.adapter, spec.kwargs, prompts, completions, columns))
            deadline = time.monotonic() + self.cfg.timeout_s
            faults.point("reward")
            for i, spec in enumerate(wave):
                w = self._workers[i]
                if w.conn.poll(max(0.0, deadline - time.monotonic())):
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        msg = ("error", "worker process died")
                        self._replace(i)
                    results[spec.label] = (msg[0], msg[1])
                else:
                    results[spec.label] = ("timeout", f"no result within {self.cfg.timeout_s}s")
                    self._replace(i)
        return results

    def score(self, prompts: list, completions: list, columns: dict, group_size: int = 1) -> Scores:
        n = len(completions)
        results = self._run_all(prompts, completions, columns)
        failed = np.zeros(n, bool)
        totals = np.zeros(n)
        per_fn, metrics = {}, {}
        fallback = self.cfg.fallback
        for spec in self.cfg.functions:
            status, payload = results[spec.label]
            c = self.counts[spec.label]
            vals = np.full(n, np.nan)
            if status == "ok" and (not isinstance(payload, list) or len(payload) != n):
                status, payload = "error", f"returned {type(payload).__name__} of length " \
                    f"{len(payload) if hasattr(payload, '__len__') else '?'}, expected a list of {n}"
            if status != "ok":
                c["errors" if status == "error" else "timeouts"] += 1
                if self.cfg.fail_fast:
                    raise RewardError(f"reward {spec.label}: {status}: {payload}")
                failed[:] = True if fallback == "drop_group" else failed
                if fallback != "drop_group":
                    vals[:] = fallback
            else:
                for i, v in enumerate(payload):
                    if v is None:
                        continue
                    try:
                        f = float(v)
                    except (TypeError, ValueError):
                        f = math.nan
                    if not math.isfinite(f):
                        c["nans"] += 1
                        if self.cfg.fail_fast:
                            raise RewardError(f"reward {spec.label}: non-finite value {v!r} at {i}")
                        if fallback == "drop_group":
                            failed[i] = True
                            continue
                        f = float(fallback)
                    vals[i] = f
            per_fn[spec.label] = vals
            totals += spec.weight * np.nan_to_num(vals, nan=0.0)
            present = vals[~np.isnan(vals)]
            metrics[f"rewards/{spec.label}/mean"] = float(present.mean()) if present.size else math.nan
            metrics[f"rewards/{spec.label}/std"] = float(present.std()) if present.size else math.nan
            for k, v in c.items():
                metrics[f"rewards/{spec.label}/{k}"] = float(v)
        keep = np.ones(n, bool)
        if fallback == "drop_group" and failed.any():
            groups = np.arange(n) // group_size
            keep = ~np.isin(groups, groups[failed])
        totals = np.where(keep, totals, np.nan)
        metrics.update(group_metrics(totals, keep, group_size, self.cfg.solved_threshold))
        return Scores(totals, per_fn, keep, metrics)

    # ---- start-up check --------------------------------------------------------------------
    def dry_run(self, prompt, columns: dict, completion="") -> None:
        """Call every function on one row; a signature or column mismatch stops the run here."""
        one = {k: [v] for k, v in columns.items()}
        results = self._run_all([prompt], [completion], one)
        for spec in self.cfg.functions:
            status, payload = results[spec.label]
            if status == "ok" and isinstance(payload, list) and len(payload) == 1:
                continue
            why = payload if status != "ok" else f"returned {payload!r}, expected a list of 1 value"
            raise UserError(
                f"reward {spec.label} ({spec.fn}): dry run on the first dataset row failed: {why}. "
                f"A reward is called as fn(prompts, completions, **columns) with the columns "
                f"{sorted(one)}; check its signature and the column names it reads.")


def group_metrics(totals: np.ndarray, keep: np.ndarray, group_size: int, threshold: float) -> dict:
    t = totals[keep]
    out = {"rewards/total/mean": float(t.mean()) if t.size else math.nan,
           "rewards/total/std": float(t.std()) if t.size else math.nan,
           "rewards/dropped_groups": float((~keep).sum() // max(group_size, 1))}
    if t.size and group_size > 1:
        g = t.reshape(-1, group_size)
        solved = g >= threshold
        out["groups/all_solved"] = float(solved.all(1).mean())
        out["groups/none_solved"] = float((~solved).all(1).mean())
        out["groups/zero_variance"] = float((g.std(1) == 0).mean())
    return out


class ToolPool(_Pool):
    """Tool calls of the policy in worker processes, `num_workers` at a time, each with its own
    deadline of `timeout_s`: a call that raises gives ("error", why), one that hangs (its worker
    is killed and replaced) ("timeout", why); nothing a tool does stops the batch."""

    def __init__(self, num_workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx) for _ in range(num_workers)]

    def run(self, calls: list[tuple[str, dict, dict]]) -> list[tuple[str, str]]:
        """(spec, kwargs, arguments) per call -> (status, text) per call, in order."""
        from multiprocessing.connection import wait

        results: list = [None] * len(calls)
        todo = list(range(len(calls)))[::-1]
        busy: dict[int, tuple[int, float]] = {}  # worker -> (call, deadline)
        while todo or busy:
            for w in range(len(self._workers)):
                if w not in busy and todo:
                    i = todo.pop()
                    self._workers[w].wait_ready()
                    spec, kwargs, arguments = calls[i]
                    self._workers[w].conn.send(("tool", spec, kwargs, arguments))
                    busy[w] = (i, time.monotonic() + self.timeout_s)
            nearest = min(d for _, d in busy.values())
            ready = wait([self._workers[w].conn for w in busy], max(0.0, nearest - time.monotonic()))
            for w in list(busy):
                i, deadline = busy[w]
                if self._workers[w].conn in ready:
                    try:
                        msg = self._workers[w].conn.recv()
                        results[i] = (msg[0], msg[1] if msg[0] == "ok" else str(msg[1]))
                    except (EOFError, OSError):
                        results[i] = ("error", "the tool's worker process died")
                        self._replace(w)
                    del busy[w]
                elif time.monotonic() >= deadline:
                    results[i] = ("timeout", f"no result within {self.timeout_s:g}s")
                    self._replace(w)
                    del busy[w]
        return results

