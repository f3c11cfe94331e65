"""Continuous batching against calls one after another: the JAX engine decoding a GRPO step's
rows through a cache of `max_rows` rows, side by side in one process.

    python -m benchmarks.continuous_batching [--shape reference] [--prompts 64] [--n 8]
        [--max-rows 64] [--prompt-len 48] [--max-tokens 128] [--mean 0.25] [--reps 3]
        [--out DIR]

The reference model (random weights, unrolled layers; `--shape 0.6b` and the other shapes of
`benchmarks.tpu.train_step`: that model in bf16, for an accelerator), PROMPTS prompts of
PROMPT_LEN / 3 to PROMPT_LEN tokens, N
samples each at temperature 1, MAX_ROWS rows per decode program (`rollout.max_rows`). Two
workloads:
- `uneven`: a set of stop tokens sized so that a completion ends after ~MEAN x MAX_TOKENS
  tokens on average (geometric lengths: most rows short, a few to the limit, as GRPO's
  completions spread), capped at MAX_TOKENS;
- `even`: as many stop ids as `uneven` has, none a token of the vocabulary (the same decode
  programs): every row to MAX_TOKENS, nothing to refill, what the ring's longer attention
  costs when it cannot gain.
Each runs with `rollout.continuous_batching` off (calls of MAX_ROWS rows, each as long as its
longest row; the decode in phases over a growing cache) and on (one program, finished rows
refilled), a warm-up each (the compile), then REPS rounds alternating, the median counted.
Reported: generated tokens, decode steps (`JaxEngine.last_decode_steps`), seconds, tokens/s and
the ratio, beside the machine's measured matmul peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="reference")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mean", type=float, default=0.25,
                    help="uneven: the mean completion length as a fraction of max-tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    from benchmarks.common import REFERENCE, matmul_peak_gflops
    from posttrain.models.transformer import CausalLM
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine

    if args.shape == "reference":
        cfg = REFERENCE.model_copy(update={"scan_layers": False})
        model = CausalLM(cfg, nnx.Rngs(0))
    else:
        from benchmarks.tpu.train_step import shape_config

        cfg = shape_config(args.shape, scan_layers=False, compute_dtype="bfloat16",
                           param_dtype="bfloat16")
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
        model = nnx.merge(graphdef, jax.jit(lambda: nnx.state(CausalLM(cfg, nnx.Rngs(0))))())
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size,
                            int(rng.integers(args.prompt_len // 3, args.prompt_len + 1))).tolist()
               for _ in range(args.prompts)]
    # a random model samples near-uniformly: |stops| / V per step ends a completion
    n_stops = max(1, round(cfg.vocab_size / (args.mean * args.max_tokens)))
    stops = rng.choice(np.arange(3, cfg.vocab_size), n_stops, replace=False).tolist()
    workloads = {
        "uneven": SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n,
                                 ignore_eos=True, stop_token_ids=stops),
        "even": SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.n,
                               ignore_eos=True,
                               stop_token_ids=[cfg.vocab_size + i for i in range(n_stops)])}
    peak = matmul_peak_gflops()
    results = {"matmul_peak_gflops": peak, "shape": args.shape, "device":
               jax.devices()[0].device_kind, "prompts": args.prompts, "n": args.n,
               "max_rows": args.max_rows, "max_tokens": args.max_tokens, "workloads": {}}
    print(f"{jax.devices()[0].device_kind}: matmul peak {peak:.0f} GFLOP/s; {args.shape}, {args.prompts} prompts x {args.n}, max_rows "
          f"{args.max_rows}, up to {args.max_tokens} new tokens", flush=True)
    engines = {mode: JaxEngine(model, None, max_rows=args.max_rows,
                               continuous_batching=mode == "continuous")
               for mode in ("calls", "continuous")}
    for name, sp in workloads.items():
        seconds = {mode: [] for mode in engines}
        stats = {}
        for rep in range(args.reps + 1):  # rep 0: the compile
            for mode, eng in engines.items():
                t0 = time.perf_counter()
                out = eng.generate(prompts, sp)
                dt = time.perf_counter() - t0
                lens = [len(r.token_ids) for r in out]
                stats[mode] = {"tokens": sum(lens), "steps": eng.last_decode_steps,
                               "mean_len": float(np.mean(lens)), "max_len": max(lens)}
                if rep:
                    seconds[mode].append(dt)
        row = {}
        for mode in engines:
            s = statistics.median(seconds[mode])
            row[mode] = {**stats[mode], "seconds": s, "tokens_per_s": stats[mode]["tokens"] / s,
                         "rounds": seconds[mode]}
        row["continuous_over_calls"] = (row["continuous"]["tokens_per_s"]
                                        / row["calls"]["tokens_per_s"])
        results["workloads"][name] = row
        print(f"{name}: mean length {row['calls']['mean_len']:.1f} of {args.max_tokens}", flush=True)
        for mode in engines:
            r = row[mode]
            print(f"  {mode:10s} {r['tokens']:6d} tokens  {r['steps']:5d} decode steps  "
                  f"{r['seconds']:6.2f} s  {r['tokens_per_s']:8.0f} tokens/s", flush=True)
        print(f"  continuous / calls: {row['continuous_over_calls']:.2f}x", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "continuous_batching.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
