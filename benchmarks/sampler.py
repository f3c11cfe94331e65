"""The sampler alone, this checkout against another commit's, in one process.

    python -m benchmarks.sampler [--ref ffbe4ad] [--rows 64,256] [--vocab 151936]

Times the jitted `rollout.sampling.sample` (temperature 1; the whole vocabulary, then top_p
0.9) on random logits of [rows, vocab] f32, medians of 7 calls after a compile, the ref's
`rollout/sampling.py` (from `git show REF:...`, imported as a module of its own) beside this
checkout's; prints the ratio, the share of equal tokens drawn and the largest log-prob gap.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ref_module(ref: str):
    src = subprocess.run(["git", "show", f"{ref}:rollout/sampling.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampling_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampling_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(f, *args, reps: int = 7) -> tuple[float, tuple]:
    import jax
    import numpy as np

    out = jax.block_until_ready(f(jax.random.key(0), *args))
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(jax.random.key(i), *args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), out


def main():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.common import matmul_peak_gflops
    from rollout import sampling

    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="ffbe4ad")
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    old = ref_module(args.ref)
    print(f"matmul peak {matmul_peak_gflops():.0f} GFLOP/s")
    for b in map(int, args.rows.split(",")):
        x = jnp.asarray(np.random.default_rng(0).normal(size=(b, args.vocab)).astype(np.float32))
        for top_p in (1.0, 0.9):
            extra = (x, jnp.float32(1.0), jnp.int32(0), jnp.float32(top_p), jnp.bool_(False))
            t_ref, r_ref = timed(jax.jit(old.sample), *extra)
            t_now, r_now = timed(jax.jit(sampling.sample), *extra)
            same = np.asarray(r_ref[0]) == np.asarray(r_now[0])
            gap = float(np.max(np.abs(np.asarray(r_ref[1]) - np.asarray(r_now[1]))[same]))
            print(f"[{b}, {args.vocab}] top_p {top_p}: {args.ref} {t_ref * 1e3:.1f} ms, this "
                  f"checkout {t_now * 1e3:.1f} ms ({t_ref / t_now:.2f}x); equal tokens "
                  f"{same.mean():.3f}, largest log-prob gap on them {gap:.1e}", flush=True)


if __name__ == "__main__":
    main()
