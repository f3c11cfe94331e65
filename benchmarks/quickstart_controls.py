"""What the quickstart's GRPO stage changes, and the SFT controls it is measured against.

    python -m benchmarks.quickstart_controls [--run runs/quickstart] [--skip-controls]

After `make quickstart` (issue 8):

1. For each stage's checkpoint, on the same 200 held-out problems in chat mode: greedy accuracy
   and, at temperature 1 with 8 samples each, the share of completions that work the sum out
   column by column before "The answer is N." and the accuracy of worked vs straight answers.
   This is what GRPO had to find: worked answers right far more often than straight ones, and
   the SFT model giving them only now and then.
2. Controls from the same pretrained checkpoint, with the recipe's SFT settings except for one
   change each (a temporary run directory; the pretrain stage is copied, not retrained):
   `all_worked` (the SFT chats all worked out: the habit taught by demonstration instead of
   found by reward) and `sft_4x` (the recipe's chats, 4x the steps: is GRPO's gain just more
   training?). Greedy held-out accuracy of each, with the report's evaluation.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.config import read_yaml, resolve_stages


def straight(text: str) -> bool:
    return text.strip().startswith("The answer is")


def habits(model_dir: Path, rows: list[dict], samples: int = 8) -> dict:
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models import from_pretrained
    from posttrain.rollouts import encode_prompt
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine

    tok = load_tokenizer(model_dir / "tokenizer")
    engine = JaxEngine(from_pretrained(model_dir), tok)
    ids = [encode_prompt(r, tok, True, i) for i, r in enumerate(rows)]
    out = {}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        texts = [o.text for o in engine.generate(ids, SamplingParams(
            n=n, temperature=temperature, max_tokens=64, seed=1))]
        worked = np.array([not straight(t) for t in texts])
        right = np.array([bool(re.search(rf"The answer is {rows[i // n]['answer']}\.$", t.strip()))
                          for i, t in enumerate(texts)])
        out[name] = {"accuracy": float(right.mean()), "worked_share": float(worked.mean()),
                     "accuracy_worked": float(right[worked].mean()) if worked.any() else None,
                     "accuracy_straight": float(right[~worked].mean()) if (~worked).any() else None}
    return out


def control(recipe: Path, run: Path, name: str, change: dict) -> float:
    """The recipe's pretrain + SFT stages with `change` merged into the SFT stage; the pretrained
    checkpoint is copied from `run`. Returns the SFT stage's held-out greedy accuracy."""
    from posttrain.config import deep_merge
    from posttrain.runner import run_stages

    tree = read_yaml(recipe)
    tmp = Path(tempfile.mkdtemp(prefix=f"qs_{name}_"))
    tree["run_dir"] = str(tmp)
    tree["tracking"] = {"wandb": {"mode": "disabled"}}
    tree["stages"] = [tree["stages"][0], deep_merge(tree["stages"][1], change)]
    shutil.copytree(run / "pretrain", tmp / "pretrain")
    run_stages(resolve_stages(tree))
    rows = [json.loads(x) for x in (tmp / "stage_accuracy.jsonl").read_text().splitlines()]
    shutil.rmtree(tmp, ignore_errors=True)
    return next(r["accuracy"] for r in rows if r["stage"] == "sft")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="runs/quickstart")
    ap.add_argument("--recipe", default="recipes/quickstart.yaml")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--skip-controls", action="store_true")
    args = ap.parse_args()
    run, recipe = Path(args.run), Path(args.recipe)
    from posttrain.rollouts import prompt_rows

    stages = resolve_stages(read_yaml(recipe))
    rows = prompt_rows(stages[-1], "eval", args.problems)
    print(f"{len(rows)} held-out problems, chat mode; sampled: temperature 1, 8 per problem")
    print(f"{'checkpoint':10s} {'greedy':>7s} {'worked':>7s} | {'sampled':>7s} {'worked':>7s} "
          f"{'acc|worked':>10s} {'acc|straight':>12s}")
    fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    for cfg in stages:
        h = habits(run / cfg.name, rows)
        g, s = h["greedy"], h["sampled"]
        print(f"{cfg.name:10s} {fmt(g['accuracy']):>7s} {fmt(g['worked_share']):>7s} | "
              f"{fmt(s['accuracy']):>7s} {fmt(s['worked_share']):>7s} {fmt(s['accuracy_worked']):>10s} "
              f"{fmt(s['accuracy_straight']):>12s}", flush=True)
    if args.skip_controls:
        return
    sft = stages[1]
    for name, change in (("all_worked", {"data": {"generated": {"worked": 1.0}}}),
                         ("sft_4x", {"train": {"steps": 4 * sft.train.steps}})):
        acc = control(recipe, run, name, change)
        print(f"control {name}: SFT held-out greedy accuracy {100 * acc:.1f}%", flush=True)


if __name__ == "__main__":
    main()
