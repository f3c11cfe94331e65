"""Rollout/trainer log-prob mismatch under nucleus sampling, before and after the log-prob
semantics (`grpo.logprob_semantics`), on the grpo_tiny recipe.

Contenders, each a real `posttrain run` of the recipe's GRPO stage from one shared SFT base:
- `before (top_p 0.8)`: the code at BEFORE_REV (from a git worktree), whose trainer used the full
  softmax against the engine's truncated log-probs;
- `sampled (top_p 0.8)`, `full (top_p 0.8)`: today's two semantics;
- `top_p 1.0`: no truncation, the fp32 noise floor.
Printed per contender: the mean over steps of `mismatch/mean_abs_logp_diff` and `mismatch/kl`,
the kept mass, the mean reward of the first and last quarter of the steps, and wall time.

    python -m benchmarks.logprob_semantics [--steps 16] [--engine jax|vllm] [--no-before]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BEFORE_REV = "b85a607"  # the last commit before the log-prob semantics
RECIPE = "recipes/grpo_tiny.yaml"
BASE = ["data.generated.max_operand=9", "stages.0.train.steps=150", "tracking.wandb.enabled=false"]


def posttrain_run(cwd: Path, run_dir: Path, overrides: list[str]) -> float:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(cwd)}
    env.pop("XLA_FLAGS", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", RECIPE, f"run_dir={run_dir}",
                        *overrides], cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"run failed in {cwd}:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def summary(run_dir: Path, seconds: float) -> dict:
    m = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m = [x for x in m if "reward_mean" in x]
    q = max(1, len(m) // 4)
    mean = lambda k: float(np.mean([x[k] for x in m])) if k in m[0] else float("nan")  # noqa: E731
    return {"logp_diff": mean("mismatch/mean_abs_logp_diff"), "kl": mean("mismatch/kl"),
            "kept_mass": mean("sampling/kept_mass"),
            "reward_first": float(np.mean([x["reward_mean"] for x in m[:q]])),
            "reward_last": float(np.mean([x["reward_mean"] for x in m[-q:]])), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--engine", choices=("jax", "vllm"), default="jax")
    ap.add_argument("--no-before", action="store_true", help="skip the run of BEFORE_REV")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="logprob_semantics_"))
    grpo = BASE + [f"stages.1.train.steps={args.steps}", "stages.1.eval.every=0",
                   "stages.1.eval.num_problems=20", "stages.1.optimizer.learning_rate=1e-4",
                   f"stages.1.rollout.engine={args.engine}", "stages.1.rollout.enforce_eager=true",
                   "rewards.functions=[{fn: tests/rewards_for_tests.py:says_seven}]"]
    posttrain_run(ROOT, work / "base", BASE + ["stages.1.train.steps=1"])
    contenders = {"sampled (top_p 0.8)": (ROOT, ["stages.1.grpo.top_p=0.8",
                                                 "stages.1.grpo.logprob_semantics=sampled"]),
                  "full (top_p 0.8)": (ROOT, ["stages.1.grpo.top_p=0.8",
                                              "stages.1.grpo.logprob_semantics=full"]),
                  "top_p 1.0": (ROOT, ["stages.1.grpo.top_p=1.0"])}
    if not args.no_before:
        tree = work / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), BEFORE_REV], cwd=ROOT,
                       check=True, capture_output=True)
        shutil.copy(ROOT / "tests/rewards_for_tests.py", tree / "tests/rewards_for_tests.py")
        contenders = {"before (top_p 0.8)": (tree, ["stages.1.grpo.top_p=0.8"]), **contenders}
    rows = {}
    try:
        for name, (cwd, extra) in contenders.items():
            d = work / name.split()[0].strip("(") / name.split()[-1].strip(")")
            shutil.copytree(work / "base" / "sft", d / "sft")
            rows[name] = summary(d / "grpo", posttrain_run(cwd, d, grpo + extra))
            print(name, rows[name], flush=True)
    finally:
        if not args.no_before:
            subprocess.run(["git", "worktree", "remove", "--force", str(work / "before")], cwd=ROOT,
                           capture_output=True)
    print(f"\nengine {args.engine}, {args.steps} GRPO steps of 8 x 8, fp32")
    print(f"{'':22s}{'|logp diff|':>13s}{'KL':>11s}{'kept mass':>11s}{'reward':>16s}{'time':>8s}")
    for name, r in rows.items():
        print(f"{name:22s}{r['logp_diff']:13.2e}{r['kl']:11.2e}{r['kept_mass']:11.3f}"
              f"{r['reward_first']:8.3f} ->{r['reward_last']:6.3f}{r['seconds']:7.0f}s")


if __name__ == "__main__":
    main()
