"""Tokens/s and MFU of our jitted train step on the reference model (batch 16 x 256, fp32, AdamW).

    python -m benchmarks.train_step [--steps 20] [--profile]

`--profile` traces the unrolled step (the recipes' SFT layout) with the JAX profiler and splits
its wall clock into the weight matmuls (forward and both gradients), attention's dots and
everything else (`benchmarks.common.op_groups`), with the rate the weight matmuls reach.

MFU is against the matmul peak measured in this same script (these 2 cores are shared and noisy;
absolute numbers move, the ratio is what to read).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from benchmarks.common import REFERENCE, matmul_peak_gflops, train_flops_per_token
from posttrain.data.packing import pack_rows
from posttrain.models import build_model
from posttrain.train.step import TrainState, make_train_step, next_token_loss


def make_batch(batch=16, seq=256, seed=0, vocab=REFERENCE.vocab_size):
    rng = np.random.default_rng(seed)
    examples = []
    while sum(len(e[0]) for e in examples) < batch * seq * 1.2:
        n = int(rng.integers(16, 40))
        ids = rng.integers(3, vocab, n).tolist()
        examples.append((ids, [1] * n))
    b, _ = pack_rows(examples, batch, seq)
    return jax.tree.map(jnp.asarray, b)


def build(remat: str = "none", scan: bool = True):
    """(cfg, jitted step, state, batch) of the reference model."""
    cfg = REFERENCE.model_copy(update=dict(remat=remat, scan_layers=scan))
    graphdef, params, rest = nnx.split(build_model(cfg), nnx.Param, ...)
    opt = optax.adamw(1e-3)
    step = jax.jit(make_train_step(graphdef, opt, next_token_loss), donate_argnums=0)
    state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    return cfg, step, state, make_batch()


def profile(peak: float) -> None:
    from benchmarks.common import (WEIGHT_MATMULS, donating_calls, hlo_ops,
                                   op_groups, op_times)

    cfg, step, state, batch = build(scan=False)
    hlo = hlo_ops(step.lower(state, batch).compile().as_text())
    for _ in range(3):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    ops = op_times(donating_calls(step, state, batch), 3)
    groups = op_groups(ops, hlo)
    busy = sum(groups.values())
    tokens = batch["tokens"].size
    mm_gflop = 6 * cfg.matmul_params() * tokens / 1e9
    print(f"unrolled step, traced: busy {busy:.0f} ms (wall clock; ops that run at once on the two "
          f"cores share it), {len(ops)} ops; the weight matmuls' {mm_gflop:.1f} GFLOP at "
          f"{mm_gflop / groups[WEIGHT_MATMULS] * 1e3:.0f} GFLOP/s (peak {peak:.0f})")
    for group, ms in groups.items():
        print(f"  {ms:7.1f} ms  {100 * ms / busy:5.1f}%  {group}")


def bench_ours(steps: int, remat: str = "none", scan: bool = True) -> dict:
    cfg, step, state, batch = build(remat, scan)
    for _ in range(3):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / steps
    tokens = 16 * 256
    return {"tokens_per_s": tokens / dt, "step_s": dt,
            "gflops": tokens * train_flops_per_token(cfg, 256) / dt / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from posttrain import host_memory

    host_memory.keep_freed_memory()  # as `posttrain run` does, before JAX runs
    peak = matmul_peak_gflops()
    rows = []
    for name, kw in [("scan, no remat", {}), ("unrolled, no remat", {"scan": False}),
                     ("scan, remat=full", {"remat": "full"})]:
        r = bench_ours(args.steps, **kw)
        rows.append((name, r))
    peak2 = matmul_peak_gflops()
    peak = max(peak, peak2)
    print(f"matmul peak (f32, this machine, now): {peak:.0f} GFLOP/s")
    print(f"{'variant':<22} {'tokens/s':>10} {'step s':>8} {'GFLOP/s':>8} {'MFU':>6}")
    for name, r in rows:
        print(f"{name:<22} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['gflops']:>8.0f} "
              f"{r['gflops'] / peak:>6.1%}")
    print("reference (ENVIRONMENT.md, measured alone): Tunix PeftTrainer 6,570 tokens/s; "
          "TRL SFTTrainer 1,785 tokens/s")
    print(f"ratio ours (scan) / Tunix figure: {rows[0][1]['tokens_per_s'] / 6570:.2f}x")
    if args.profile:
        profile(peak)


if __name__ == "__main__":
    main()
