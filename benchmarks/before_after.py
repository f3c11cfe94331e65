"""The same workloads on two commits, alternating in one script: is this change slower?

    python -m benchmarks.before_after --ref 6296d95 [--rounds 2] [--workloads grpo,sft]

`--ref` is checked out into a temporary git worktree; each round runs every workload once on
the ref and once on the working tree (alternating, so machine noise falls on both). Workloads,
each through `posttrain run` (the whole in-process path: loop, trainer, checkpoints, metrics):
  grpo  `benchmarks/grpo_step.py`'s reference GRPO step (colocated JAX engine, 8 x 8, <= 64
        tokens): median seconds per step after warm-up, and its phases;
  sft   `recipes/sft_tiny.yaml`, batch 16 x 256, 40 steps: median tokens/s after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3
SFT = ["train.steps=40", "train.batch_size=16", "data.seq_len=256", "checkpoint.every=0",
       "train.eval_every=0", "tracking.wandb.enabled=false", "tracking.console=false",
       "data.generated.num_train=4000"]


def env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def grpo(tree: Path, model_dir: Path, work: Path, steps: int) -> dict:
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
            "from benchmarks.grpo_step import ours; "
            "print('@@' + json.dumps(ours(Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))))")
    r = subprocess.run([sys.executable, "-c", code, str(tree), str(model_dir), str(steps),
                        str(work)], cwd=tree, env=env(), capture_output=True, text=True, check=True)
    return json.loads(r.stdout.split("@@")[-1])


def sft(tree: Path, work: Path) -> dict:
    run_dir = work / f"sft_{len(list(work.iterdir()))}"
    subprocess.run([sys.executable, "-m", "posttrain.cli", "run", "recipes/sft_tiny.yaml",
                    f"run_dir={run_dir}", *SFT], cwd=tree, env=env(), capture_output=True,
                   check=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows[WARMUP:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", required=True, help="the commit to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps per run")
    ap.add_argument("--workloads", default="grpo,sft")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import matmul_peak_gflops
    from tests.helpers import save_tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="before_after_"))
    before = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(before), args.ref], cwd=ROOT,
                   check=True, capture_output=True)
    try:
        model_dir = work / "model"
        save_tiny_model_with_tokenizer(model_dir, "qwen3", hidden=256, inter=768, layers=4,
                                       heads=4, kv=2, head_dim=64)
        peak = matmul_peak_gflops()
        (work / "runs").mkdir()
        res: dict = {}
        for _ in range(args.rounds):
            for name, tree in (("before", before), ("after", ROOT)):
                for w in args.workloads.split(","):
                    out = (grpo(tree, model_dir, work / "runs", args.steps) if w == "grpo"
                           else sft(tree, work / "runs"))
                    res.setdefault(w, {}).setdefault(name, []).append(out)
        print(f"matmul peak measured now: {peak:.0f} GFLOP/s (f32); before = {args.ref}, "
              f"after = the working tree; best of {args.rounds} rounds, alternating")
        for w, sides in res.items():
            key, better = ("step_s", min) if w == "grpo" else ("tokens_per_s", max)
            b, a = (better(sides[s], key=lambda r: r[key]) for s in ("before", "after"))
            ratio = b[key] / a[key] if key == "step_s" else a[key] / b[key]
            print(f"{w:<5} {key}: before {b[key]:.3f}  after {a[key]:.3f}  -> after is "
                  f"{ratio:.3f}x before (>1: faster)")
            if w == "grpo":
                for side, r in (("before", b), ("after", a)):
                    print(f"      {side} phases: " + ", ".join(
                        f"{k.split('/')[1]} {v:.3f}" for k, v in r.items() if k.startswith("time/")))
        print("all rounds: " + json.dumps(res))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT,
                       capture_output=True)


if __name__ == "__main__":
    main()
