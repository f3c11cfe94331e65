"""What keeping freed host memory (`posttrain.host_memory`) saves, and costs: the reference SFT
step and the JAX engine's reference generation, each in a fresh process with glibc's defaults
(`POSTTRAIN_HOST_MALLOC=default`) and with the settings `posttrain run` gives itself (`keep`),
alternating, round by round. (Processes that only generate keep glibc's defaults: the one arena
costs their decode loop more than it saves there, which the generation column shows.)

    python -m benchmarks.host_memory [--rounds 3] [--steps 8]

Prints per process: seconds per SFT step (best of `--steps`, after 3 warm-up steps) and per
generation of 64 prompts x 64 tokens (best of 5), the minor page faults per step / generation
(`getrusage`), and the CPU seconds the host took from this VM meanwhile (/proc/stat steal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import steal_report, with_steal

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, resource, sys, time
sys.path.insert(0, ".")
from posttrain import host_memory
steps = int(sys.argv[1])
applied = host_memory.keep_freed_memory()
import jax
import numpy as np
from benchmarks.common import REFERENCE, matmul_peak_gflops
from benchmarks.train_step import build

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def best(fn, reps):
    out, f0 = [], faults()
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); out.append(time.perf_counter() - t0)
    return min(out), (faults() - f0) / reps

cfg, step, state, batch = build(scan=False)  # unrolled: the recipes' layout
carry = [state]
def sft():
    carry[0], m = step(carry[0], batch); jax.block_until_ready(m)
for _ in range(3):
    sft()
sft_s, sft_faults = best(sft, steps)

from posttrain.models import build_model
from rollout.engine import SamplingParams
from rollout.jax_engine import JaxEngine
eng = JaxEngine(build_model(REFERENCE.model_copy(update=dict(scan_layers=False))))
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 400, int(rng.integers(8, 24))).tolist() for _ in range(64)]
sp = SamplingParams(temperature=1.0, max_tokens=64, seed=0, ignore_eos=True)
gen = lambda: eng.generate(prompts, sp)
gen()
gen_s, gen_faults = best(gen, 5)
print("@@" + json.dumps(dict(applied=applied, sft_s=sft_s, sft_faults=sft_faults, gen_s=gen_s,
                             gen_faults=gen_faults, peak=matmul_peak_gflops())))
'''


def run_child(setting: str, steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "XLA_FLAGS"}
    env |= {"JAX_PLATFORMS": "cpu", "POSTTRAIN_HOST_MALLOC": setting}
    r = subprocess.run([sys.executable, "-c", CHILD, str(steps)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.split("@@")[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"default": [], "keep": []}
    stolen: dict[str, list] = {k: [] for k in runs}
    for r in range(args.rounds):
        for setting in runs:
            out, steal = with_steal(lambda: run_child(setting, args.steps))
            runs[setting].append(out)
            stolen[setting].append(steal)
            print(f"round {r + 1} {setting:7s} (glibc took the settings: {out['applied']}): "
                  f"SFT step {out['sft_s'] * 1e3:6.0f} ms, {out['sft_faults']:8.0f} faults/step; "
                  f"generation {out['gen_s'] * 1e3:6.0f} ms, {out['gen_faults']:7.0f} faults; "
                  f"peak {out['peak']:.0f} GFLOP/s", flush=True)
    rate = {"sft_s": 16 * 256, "gen_s": 64 * 64}
    for m, what in (("sft_s", "SFT step"), ("gen_s", "generation")):
        best = {k: min(o[m] for o in v) for k, v in runs.items()}
        med = {k: statistics.median(o[m] for o in v) for k, v in runs.items()}
        print(f"{what}: default {rate[m] / best['default']:,.0f} tokens/s best, "
              f"{rate[m] / med['default']:,.0f} median; keep {rate[m] / best['keep']:,.0f} best, "
              f"{rate[m] / med['keep']:,.0f} median: {best['default'] / best['keep']:.2f}x best "
              f"against best, {med['default'] / med['keep']:.2f}x median against median")
    print(steal_report(stolen))


if __name__ == "__main__":
    main()
