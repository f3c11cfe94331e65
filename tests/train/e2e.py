"""Helpers for end-to-end runs of `posttrain run` in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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


def run_killed_then_resumed(recipe: str, run_dir: Path, overrides: list[str], kill_after: int,
                            total: int) -> int:
    """Start the run, SIGKILL it once checkpoint `kill_after` is committed, start it again."""
    p = subprocess.Popen(cmd(recipe, run_dir, overrides), cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (run_dir / "checkpoints" / str(kill_after)).is_dir() and time.time() < deadline \
            and p.poll() is None:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = max(int(x.name) for x in (run_dir / "checkpoints").iterdir() if x.name.isdigit())
    assert killed_at < total, "the run finished before it could be killed"
    run(recipe, run_dir, overrides)
    return killed_at


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
