"""Crash safety, measured: SIGKILL real runs at random moments, restart the same command until
it finishes, and compare with an uninterrupted run of the same recipe.

    python -m benchmarks.faults                         # the full count: 22 kills, 4 recipe kinds
    python -m benchmarks.faults --kinds pretrain,sft --seed 3 --kills-per-run 2
    python -m benchmarks.faults --json faults.json

Each kill is drawn at random from:
- a fault point (`posttrain/faults.py`): the run SIGKILLs itself the n-th time it reaches it:
  `checkpoint_write` (an asynchronous save's files are being written), `weight_sync` (between
  buckets of a push to the engines), `reward` (the reward workers are scoring), `eval`, `step`;
- a random time: SIGKILL from outside, uniform over 20-90% of the uninterrupted run's wall time
  (start-up and compilation included);
and a quarter of the kills also damage the latest checkpoint before the restart (bytes flipped
in its largest parameter file), which the restart must detect and fall back from.

The rules checked (tests/train/e2e.py: `compare_runs`):
- pretrain, SFT and synchronous GRPO end bitwise identical to the uninterrupted run: final
  parameters, the rows of every step, every step's loss/reward;
- one-step off-policy (async) GRPO regenerates the in-flight batch with the restored weights,
  so it is not bitwise; every step must still train on the same prompts: none skipped or
  repeated.
Runs of a few steps on the tiny recipes; GRPO starts from a short SFT of the grpo_tiny recipe.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.train.e2e import Kill, compare_runs, faulted_run, run

GRPO_RECIPE = "recipes/grpo_tiny.yaml"
GRPO_BASE = ["data.generated.max_operand=9", "stages.0.train.steps=150",
             "tracking.wandb.enabled=false"]
GRPO = GRPO_BASE + ["stages.1.train.steps=10", "stages.1.eval.every=5",
                    "stages.1.eval.num_problems=16", "stages.1.checkpoint.every=2",
                    "stages.1.grpo.prompts_per_step=4", "stages.1.grpo.group_size=4",
                    "stages.1.rollout.engine=jax", "stages.1.rollout.placement=colocated",
                    "stages.1.data.generated.num_train=8"]  # every checkpoint ends an epoch


@dataclass
class Kind:
    recipe: str
    overrides: list[str]
    points: tuple[str, ...]
    keys: tuple[str, ...]  # per-step metrics that must match
    exact: bool = True
    stage: str | None = None  # multi-stage recipe: the stage under test
    runs: int = 2
    kills: int = 3  # per run
    extra: list[str] = field(default_factory=list)


KINDS = {
    "pretrain": Kind("recipes/pretrain_tiny.yaml",
                     ["train.steps=12", "checkpoint.every=2", "train.eval_every=4",
                      "data.seq_len=64", "data.generated.num_train=3000", "train.batch_size=8",
                      "tracking.wandb.enabled=false"],
                     ("step", "checkpoint_write", "eval"), ("loss", "eval_loss")),
    "sft": Kind("recipes/sft_tiny.yaml",
                ["train.steps=12", "checkpoint.every=2", "train.eval_every=4", "data.seq_len=96",
                 "data.generated.num_train=3000", "train.batch_size=8",
                 "tracking.wandb.enabled=false"],
                ("step", "checkpoint_write", "eval"), ("loss", "eval_loss"), kills=2),
    "grpo": Kind(GRPO_RECIPE, GRPO, ("step", "checkpoint_write", "weight_sync", "reward", "eval"),
                 ("reward_mean", "loss"), stage="grpo"),
    "grpo_async": Kind(GRPO_RECIPE, GRPO + ["stages.1.async.off_policy_steps=1"],
                       ("step", "checkpoint_write", "weight_sync", "reward"), ("reward_mean",),
                       exact=False, stage="grpo", kills=3),
}


def draw_kills(kind: Kind, rng: random.Random, wall_s: float) -> list[Kill]:
    out = []
    for _ in range(kind.kills):
        at = rng.choice(kind.points + ("time",))
        n = round(rng.uniform(0.2, 0.9) * wall_s, 1) if at == "time" else rng.randint(1, 3)
        out.append(Kill(at, n, corrupt=rng.random() < 0.25))
    return out


def bench_kind(name: str, kind: Kind, root: Path, rng: random.Random, base: Path | None) -> dict:
    def fresh(d: Path) -> Path:
        if base is not None:
            shutil.copytree(base, d / "sft")
        return d

    ref = fresh(root / f"{name}-ref")
    t0 = time.time()
    run(kind.recipe, ref, kind.overrides)
    wall = time.time() - t0
    rows = []
    for i in range(kind.runs):
        d = fresh(root / f"{name}-{i}")
        kills = draw_kills(kind, rng, wall)
        rec = faulted_run(kind.recipe, d, kind.overrides, kills, stage=kind.stage)
        sub = (lambda x: x / kind.stage) if kind.stage else (lambda x: x)
        try:
            verdict = compare_runs(sub(ref), sub(d), kind.keys, exact=kind.exact)
            ok, why = True, ""
        except AssertionError as e:
            verdict, ok, why = {}, False, str(e).splitlines()[0][:200]
        rows.append({"run": i, "kills": rec, "identical": ok, "why": why, **verdict})
        print(f"  {name} run {i}: {', '.join(r['kill'] + ('' if r['delivered'] else ' (not reached)') for r in rec)}"
              f" -> {'identical' if ok else 'DIFFERENT: ' + why}", flush=True)
    delivered = sum(r["delivered"] for row in rows for r in row["kills"])
    return {"kind": name, "reference_wall_s": round(wall, 1), "runs": rows,
            "kills": sum(len(row["kills"]) for row in rows), "delivered": delivered,
            "corrupted": sum("corrupted" in r for row in rows for r in row["kills"]),
            "recovered": len(rows),  # faulted_run raises unless the final start finished
            "identical": sum(row["identical"] for row in rows),
            "rule": "bitwise" if kind.exact else "same prompts per step"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kills-per-run", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="posttrain-faults-"))
    results, t0 = [], time.time()
    try:
        base = None
        for name in args.kinds.split(","):
            kind = KINDS[name]
            if args.kills_per_run:
                kind.kills = args.kills_per_run
            if kind.stage and base is None:
                run(GRPO_RECIPE, root / "base", GRPO_BASE + ["stages.1.train.steps=1"])
                base = root / "base" / "sft"
            print(f"{name}: {kind.runs} runs x {kind.kills} kills", flush=True)
            results.append(bench_kind(name, kind, root, rng, base if kind.stage else None))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| recipe kind | runs | kills injected | delivered | + corrupt checkpoint | recovered"
          " | identical | lost | rule |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['kind']} | {len(r['runs'])} | {r['kills']} | {r['delivered']} | {r['corrupted']}"
              f" | {r['recovered']}/{len(r['runs'])} | {r['identical']}/{len(r['runs'])}"
              f" | {len(r['runs']) - r['identical']} | {r['rule']} |")
    total = sum(r["delivered"] for r in results)
    print(f"\n{total} SIGKILLs delivered in {time.time() - t0:.0f} s (seed {args.seed})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["identical"] == len(r["runs"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
