"""Where the JAX engine's decode time goes, on the reference workload of `rollout_throughput.py`.

    python -m benchmarks.rollout_profile [--shape reference|large] [--top 20]

64 prompts of 8-24 tokens, 64 new tokens each at temperature 1 (EOS ignored), the engine's own
jitted generation with unrolled layers. Prints, against the matmul peak measured in the same run:
- seconds per generation and per decode step (best of 7);
- the decode step's ops from a JAX profiler trace (`benchmarks.common.op_times`), in wall clock
  (two ops that run at once on the two cores share the interval): the weight matmuls, the
  attention dots and everything else, and the rate the weight matmuls reach inside the loop,
  against the same matmuls alone in a jitted loop of 64 steps (`matmul_floor_seconds`);
- the step time against the KV cache's length (new tokens 32 .. 192): the part of a step that
  grows with the slots attention reads, and the part that does not (the decode runs in phases
  whose caches grow to that length, `rollout.jax_engine.phase_ends`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS, NEW = 64, 64


def best_seconds(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import os

    dump = Path(tempfile.mkdtemp(prefix="rollout_profile_hlo_"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                               "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_generate.*")
    import numpy as np

    from benchmarks.common import (REFERENCE, WEIGHT_MATMULS, hlo_ops, matmul_floor_seconds,
                                   matmul_peak_gflops, op_groups, op_times)
    from benchmarks.rollout_throughput import SHAPES
    from posttrain.models import build_model
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine, bucket_mult, phase_ends

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="reference", choices=list(SHAPES))
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    s = SHAPES[args.shape]
    cfg = REFERENCE.model_copy(update=dict(
        hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
        scan_layers=False))
    engine = JaxEngine(build_model(cfg))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 400, int(rng.integers(8, 24))).tolist() for _ in range(PROMPTS)]

    def generate(new: int = NEW):
        sp = SamplingParams(temperature=1.0, max_tokens=new, seed=0, ignore_eos=True)
        return lambda: engine.generate(prompts, sp)

    peak = matmul_peak_gflops()
    wall = best_seconds(generate())
    floor = matmul_floor_seconds(cfg, PROMPTS, 0, NEW)["rollout"]
    print(f"shape {args.shape}; matmul peak measured now: {peak:.0f} GFLOP/s (f32)")
    print(f"generation {PROMPTS} x {NEW}: {wall * 1e3:.0f} ms ({PROMPTS * NEW / wall:,.0f} tokens/s), "
          f"{wall / NEW * 1e3:.2f} ms per decode step; the weight matmuls alone in a jitted loop: "
          f"{floor * 1e3:.0f} ms ({wall / floor:.2f}x)")

    # What each traced thunk computes: XLA's dump of the loop it runs (set before jax starts).
    per_module = [hlo_ops(f.read_text()) for f in dump.rglob("*jit__generate*after_optimizations.txt")]
    shutil.rmtree(dump, ignore_errors=True)
    if not per_module:
        raise SystemExit(f"XLA wrote no dump of the generation under {dump}: is XLA_FLAGS honoured?")

    ops = op_times(generate(), 3)
    # the decode loops' bodies (one per phase of `phase_ends`); the prefill's ops run once
    per_step = {n: t for n, t in ops.items() if t.count > 1}
    hlo = max(per_module, key=lambda h: sum(n in h for n in per_step))
    groups = op_groups(per_step, hlo)
    busy = sum(t.wall for t in per_step.values())
    matmul_gflop = 2 * PROMPTS * NEW * cfg.matmul_params() / 1e9
    mm = groups[WEIGHT_MATMULS]
    print(f"decode loops ({len(phase_ends(bucket_mult(NEW), engine.decode_phases))} phases): "
          f"{len(per_step)} ops, busy {busy / NEW:.2f} of the "
          f"{wall / NEW * 1e3:.2f} ms (wall clock, ops that run at once share it; the rest is the "
          f"prefill's share and the executor's gaps between thunks); the weight matmuls' {matmul_gflop:.1f} "
          f"GFLOP at {matmul_gflop / mm * 1e3:.0f} GFLOP/s (the floor loop: "
          f"{matmul_gflop / floor:.0f} GFLOP/s)")
    for group, ms in groups.items():
        print(f"  {ms / NEW:7.3f} ms/step  {100 * ms / busy:5.1f}%  {group}")
    print("largest ops, per decode step (wall ms; own duration; what it computes; an op of one "
          "phase's loop runs in that phase's steps only):")
    for name, t in sorted(per_step.items(), key=lambda kv: -kv[1].wall)[:args.top]:
        shape, op = hlo.get(name, ("?", "?"))
        print(f"  {t.wall / NEW:7.3f} ms  {t.op / NEW:7.3f} ms  {name:28s} {shape:24s} "
              f"{op.split('/')[-1]}")

    print("step time against the KV cache's length (prompt bucket 32 + new tokens; the phases'"
          " caches grow to it):")
    for new in (32, 64, 128, 192):
        t = best_seconds(generate(new), reps=4)
        print(f"  {32 + new:4d} slots at the end: {t / new * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
