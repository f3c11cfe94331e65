"""Seconds per GRPO update: completions packed several to a row vs padded one to a row (with the
group's shared prompt prefix), side by side in one process.

    python -m benchmarks.grpo_packing [--reps 5]

The pipeline's own jitted update (`benchmarks.grpo_update_profile.build`: the 3.3M reference
model, `make_train_step` with the GRPO loss) on batches that `posttrain.rollouts.build_batch`
makes from synthetic rollouts shaped like the quickstart's: 16 prompts x 8 completions after
20-token prompts, a share `worked` of completions worked out (40-50 tokens), the rest straight
answers (6-10 tokens); the quickstart's GRPO stage goes from ~10% worked (mean completion 12
tokens) to ~70% (33 tokens). `all_64` is the reference workload's shape (random weights: every
completion runs to the 64-token limit), where packing saves nothing and the batch stays padded.
Each layout's best of `--reps` steps after warm-up, alternating; positions = rows x row length.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

P, G, PROMPT = 16, 8, 20
SHAPES = {"early (10% worked)": 0.1, "mid (40% worked)": 0.4, "late (70% worked)": 0.7,
          "all_64": None}


def rollouts(worked: float | None, seed: int = 0):
    from rollout.engine import Rollout

    rng = np.random.default_rng(seed)
    out = []
    for p in range(P):
        prompt = rng.integers(3, 300, PROMPT).tolist()
        for _ in range(G):
            if worked is None:
                n = 64
            else:
                n = int(rng.integers(40, 51)) if rng.random() < worked else int(rng.integers(6, 11))
            out.append(Rollout(p, prompt, rng.integers(3, 300, n).tolist(), [0.0] * n, "",
                               "stop", 0))
    return out


def main() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.common import matmul_peak_gflops
    from benchmarks.grpo_update_profile import build
    from posttrain.rollouts import build_batch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    step, state, _ = build(Path(tempfile.mkdtemp(prefix="grpo_packing_")))
    print(f"matmul peak {matmul_peak_gflops():.0f} GFLOP/s f32 (2 cores)")
    print(f"{'batch':22s} {'layout':7s} {'rows x len':>11s} {'positions':>9s} {'real':>6s} "
          f"{'update s':>9s}  packed/padded")
    for name, worked in SHAPES.items():
        rs = rollouts(worked)
        real = sum(len(r.prompt_token_ids) + len(r.token_ids) for r in rs)
        adv = np.random.default_rng(1).standard_normal(len(rs)).astype(np.float32)
        layouts = {"padded": build_batch(rs, adv, 96, G),
                   "packed": build_batch(rs, adv, 96, G, row_unit=1)}
        dev = {k: {n: jnp.asarray(v) for n, v in b.items()} for k, b in layouts.items()}
        best = {k: float("inf") for k in dev}
        for k in dev:  # compile + warm-up
            for _ in range(2):
                state, m = step(state, dev[k])
                jax.block_until_ready(m)
        for _ in range(args.reps):
            for k in dev:
                t0 = time.perf_counter()
                state, m = step(state, dev[k])
                jax.block_until_ready(m)
                best[k] = min(best[k], time.perf_counter() - t0)
        for k, b in layouts.items():
            rows, length = b["tokens"].shape
            chosen = "packed" if b["advantages"].ndim == 2 else "padded"
            ratio = f"{best['padded'] / best['packed']:.2f}x faster" if k == "packed" else ""
            print(f"{name:22s} {chosen if k == 'packed' else k:7s} {rows:4d} x {length:<4d} "
                  f"{rows * length:9d} {real:6d} {best[k]:9.3f}  {ratio}")


if __name__ == "__main__":
    main()
