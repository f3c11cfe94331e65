"""Helpers for end-to-end runs of `posttrain run` in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from posttrain.train.checkpoint import find_checkpoint, restore_params_flat

ROOT = Path(__file__).resolve().parents[2]


def cmd(recipe: str, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "run", recipe, f"run_dir={run_dir}", *overrides]


def env(devices: int | None = None, **extra: str) -> dict:
    """One device, as on a user's laptop, unless `devices` (CPU devices of the process)."""
    e = dict(os.environ)
    e.pop("XLA_FLAGS", None)
    if devices:
        e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    e["WANDB_MODE"] = "offline"
    return {**e, **extra}


def run(recipe: str, run_dir: Path, overrides: list[str], devices: int | None = None,
        check: bool = True, **extra_env: str) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd(recipe, run_dir, overrides), cwd=ROOT, env=env(devices, **extra_env),
                       capture_output=True, text=True, timeout=900)
    if check:
        assert r.returncode == 0, r.stderr[-4000:]
    return r


@contextlib.contextmanager
def running(recipe: str, run_dir: Path, overrides: list[str], devices: int | None = None,
            **extra_env: str):
    """A run in the background while the block runs, checked when the block ends; what a run
    computes does not depend on what runs beside it. Its start-up, compiling and Ray overlap
    the block's (on 2 cores, tiny-model runs are mostly one core's Python and compiles). The
    run is killed if the block fails."""
    err = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(cmd(recipe, run_dir, overrides), cwd=ROOT,
                         env=env(devices, **extra_env), stdout=subprocess.DEVNULL, stderr=err,
                         text=True)
    try:
        yield
        p.wait(timeout=900)
        err.seek(0)
        assert p.returncode == 0, err.read()[-4000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        err.close()


def run_together(*runs: tuple) -> None:
    """Independent runs at the same time, each `(recipe, run_dir, overrides[, devices])`, all
    checked (`running`; measured: ~50 s saved over the trainer-group tests); a run that fails
    stops the others."""
    with contextlib.ExitStack() as stack:
        for recipe, run_dir, overrides, *devices in runs:
            stack.enter_context(running(recipe, run_dir, overrides, *devices))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_params(run_dir: Path) -> tuple[int, dict]:
    ckpt_dir, step = find_checkpoint(run_dir)
    return step, restore_params_flat(ckpt_dir, step)


def data_order(run_dir: Path) -> dict:
    order = {}
    for line in (run_dir / "data_order.jsonl").read_text().splitlines():
        row = json.loads(line)
        order[row["step"]] = row["rows"]  # a step replayed after resume overwrites its first try
    return order


def assert_same_final_params(a: Path, b: Path) -> None:
    step_a, pa = final_params(a)
    step_b, pb = final_params(b)
    assert step_a == step_b
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(np.asarray(pa[k]), np.asarray(pb[k]), err_msg=k)


# ---- crash safety: kill a run for real, restart it, compare (benchmarks/faults.py) ---------------
@dataclass
class Kill:
    """One SIGKILL. `at`: a fault point of `posttrain.faults` (the run kills itself the `n`-th
    time it reaches it) or "time" (killed from outside `n` seconds after it started). With
    `corrupt`, the latest checkpoint is then damaged (bytes flipped in its largest parameter
    file) before the restart, which must detect it and fall back to the one before."""

    at: str
    n: float = 1
    corrupt: bool = False

    def __str__(self) -> str:
        return f"{self.at}:{self.n:g}" + ("+corrupt" if self.corrupt else "")


def latest_step(ckpt_dir: Path) -> int:
    steps = [int(x.name) for x in ckpt_dir.iterdir() if x.name.isdigit()] if ckpt_dir.is_dir() else []
    return max(steps, default=0)


def corrupt_latest(ckpt_dir: Path) -> int:
    step = latest_step(ckpt_dir)
    f = max((p for p in (ckpt_dir / str(step) / "params").rglob("*") if p.is_file()),
            key=lambda p: p.stat().st_size)
    b = bytearray(f.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
    f.write_bytes(bytes(b))
    return step


def faulted_run(recipe: str, run_dir: Path, overrides: list[str], kills: list[Kill],
                stage: str | None = None, devices: int | None = None) -> list[dict]:
    """Start the run; deliver `kills` one per start, restarting the same command after each;
    then let it finish. `stage`: the stage whose checkpoints to watch (multi-stage recipes).
    Returns one record per kill: delivered (the process died by SIGKILL, not by finishing
    first), the checkpoint it had reached, and whether the restart warned of a fallback."""
    from posttrain.faults import POINTS

    ckpt_dir = (run_dir / stage if stage else run_dir) / "checkpoints"
    records = []
    for i, kill in enumerate(kills):
        assert kill.at in POINTS + ("time",), kill
        extra = {"POSTTRAIN_FAULT": f"{kill.at}:{int(kill.n)}"} if kill.at != "time" else {}
        log = run_dir.parent / f"{run_dir.name}.start{i}.stderr"
        run_dir.mkdir(parents=True, exist_ok=True)
        with log.open("w") as err:
            p = subprocess.Popen(cmd(recipe, run_dir, overrides), cwd=ROOT, env=env(devices, **extra),
                                 stdout=subprocess.DEVNULL, stderr=err)
            if kill.at == "time":
                try:
                    p.wait(timeout=kill.n)
                except subprocess.TimeoutExpired:
                    p.send_signal(signal.SIGKILL)
            rc = p.wait(timeout=900)
        text = log.read_text()
        assert rc in (0, -signal.SIGKILL), f"start {i} ({kill}) exited {rc}:\n{text[-4000:]}"
        rec = {"kill": str(kill), "delivered": rc == -signal.SIGKILL, "checkpoint": latest_step(ckpt_dir),
               "fell_back": "falling back to step" in text}
        if rc == 0:  # finished before the kill: nothing more to inject
            records.append(rec)
            break
        if kill.corrupt:  # only with an older checkpoint to fall back to (else: an error, by design)
            complete = [x for x in ckpt_dir.iterdir() if x.name.isdigit()] if ckpt_dir.is_dir() else []
            if len(complete) >= 2:
                rec["corrupted"] = corrupt_latest(ckpt_dir)
        records.append(rec)
    r = run(recipe, run_dir, overrides, devices=devices)
    if records and records[-1].get("corrupted"):
        assert "falling back to step" in r.stderr, r.stderr[-3000:]
        records[-1]["fell_back"] = True
    return records


def per_step(run_dir: Path, keys: tuple[str, ...]) -> dict[int, tuple]:
    """The last logged value of `keys` at every step (a step replayed after a resume is
    logged again; the replay is what the run kept)."""
    out = {}
    for row in metrics(run_dir):
        if any(k in row for k in keys):
            out[row["step"]] = tuple(row.get(k) for k in keys)
    return out


def compare_runs(ref: Path, got: Path, keys: tuple[str, ...], exact: bool = True) -> dict:
    """`exact` (synchronous runs): final parameters bitwise, the same rows at every step,
    the same per-step `keys`. Otherwise (one-step off-policy RL, whose resumed batch is
    regenerated with restored weights) the same prompts at every step: none skipped or
    repeated. Returns what held; raises AssertionError on what did not."""
    order_ref, order_got = data_order(ref), data_order(got)
    assert order_ref == order_got, "data order differs: rows skipped, repeated or reordered"
    flat_ref = sorted(r for rows in order_ref.values() for r in rows)
    assert flat_ref == sorted(r for rows in order_got.values() for r in rows)
    out = {"steps": len(order_ref), "same_data_order": True}
    if exact:
        assert_same_final_params(ref, got)
        assert per_step(ref, keys) == per_step(got, keys), "per-step metrics differ"
        out.update(bitwise_params=True, same_metrics=True)
    return out
