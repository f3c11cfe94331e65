"""Seconds per GRPO step: ours vs Tunix and TRL, side by side on the reference workload.

    python -m benchmarks.grpo_step [--steps 12] [--rounds 2] [--variants colocated,disaggregated,...]
                                   [--peers tunix,trl]

Workload (ENVIRONMENT.md): the 3.3M-parameter Qwen3-architecture model (random weights, so every
completion runs to the 64-token limit on both sides), 8 prompts x 8 completions, at most 64 new
tokens, one update per batch, beta = 0, fp32, the same arithmetic prompts and the same
correctness reward. Every contender runs as a separate process, alternating (Tunix under its own
venv: `benchmarks/peers/tunix_bench.py`); we report the median step after
warm-up and our phase split (rollout, reward, logprob, update, sync).

Variants of ours: `colocated` (the JAX engine in the trainer's process, the default),
`colocated_async` (async.off_policy_steps 1: batch k+1 generated in a thread while batch k
trains), `disaggregated` (one JAX engine as a Ray actor in its own process) and
`disaggregated_async`. On these 2 cores every variant shares the same two cores, so overlap can
only help as far as one side leaves cores idle.
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

RECIPE = """
name: bench_grpo
algorithm: grpo
run_dir: {run_dir}
model: {{path: {model}, scan_layers: false}}
data: {{source: generated, format: prompt_completion, seq_len: 128}}
optimizer: {{learning_rate: 1.0e-5, schedule: constant}}
train: {{steps: {steps}, log_every: 100}}
grpo: {{group_size: 8, prompts_per_step: 8, max_tokens: 64, temperature: 1.0, beta: 0.0, mu: 1}}
rewards:
  functions: [{{fn: math, kwargs: {{fallback_last_number: true}}}}]
  dry_run: false
eval: {{every: 100000, num_problems: 8}}
checkpoint: {{every: 0}}
tracking: {{console: false, wandb: {{enabled: false}}}}
{extra}
"""

VARIANTS = {
    "colocated": "",
    "colocated_async": "async: {off_policy_steps: 1}",
    "disaggregated": "rollout: {placement: disaggregated, num_workers: 1}",
    "disaggregated_async": "rollout: {placement: disaggregated, num_workers: 1}\n"
                           "async: {off_policy_steps: 1}",
}

TRL = r'''
import json, sys, time, torch
torch.set_num_threads(2)
sys.path.insert(0, ".")
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from posttrain.data import generated
from rewards.builtins import math_reward
model_dir, steps = sys.argv[1], int(sys.argv[2])
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).float()
rows = generated.prompt_completion_rows("train", 2000, 99, 0)
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows])
def reward(prompts, completions, answer, **kw):
    return math_reward(prompts, completions, answer=answer, fallback_last_number=True)
class T(TrainerCallback):
    def __init__(self): self.t = []
    def on_step_end(self, *a, **k): self.t.append(time.perf_counter())
t = T()
cfg = GRPOConfig(output_dir="/tmp/trl_grpo_bench", per_device_train_batch_size=64, num_generations=8,
                 max_completion_length=64, max_steps=steps, learning_rate=1e-5, beta=0.0,
                 logging_steps=1000, report_to=[], save_strategy="no", use_cpu=True,
                 temperature=1.0, num_iterations=1, dataloader_num_workers=0,
                 # fp32 without remat, like every other contender (TRL defaults to bf16 + remat)
                 bf16=False, gradient_checkpointing=False)
tr = GRPOTrainer(model=model, args=cfg, train_dataset=ds, reward_funcs=[reward], processing_class=tok,
                 callbacks=[t])
t0 = time.perf_counter(); tr.train()
steps_t = [b - a for a, b in zip([t0] + t.t[:-1], t.t)]
print("@@" + json.dumps({"step_s": steps_t}))
'''


def ours(model_dir: Path, steps: int, work: Path, variant: str = "colocated") -> dict:
    run_dir = work / f"ours_{os.getpid()}_{len(list(work.iterdir()))}"
    recipe = work / "bench_grpo.yaml"
    recipe.write_text(RECIPE.format(run_dir=run_dir, model=model_dir, steps=steps,
                                    extra=VARIANTS[variant]))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    subprocess.run([sys.executable, "-m", "posttrain.cli", "run", str(recipe)], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("time/step") is not None][WARMUP:]
    phases = ["time/rollout", "time/reward", "time/logprob", "time/update", "time/sync",
              "time/rollout_wait"]
    return {"step_s": statistics.median(r["time/step"] for r in rows),
            **{p: statistics.median(r[p] for r in rows if p in r) for p in phases if p in rows[0]}}


def trl(model_dir: Path, steps: int, keep_freed_memory: bool = False) -> dict:
    from benchmarks.common import peer_environ

    r = subprocess.run([sys.executable, "-c", TRL, str(model_dir), str(steps)], cwd=ROOT, check=False,
                       capture_output=True, text=True, env=peer_environ(keep_freed_memory))
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    s = json.loads(r.stdout.split("@@")[-1])["step_s"][WARMUP:]
    return {"step_s": statistics.median(s)}


def tunix(model_dir: Path, steps: int, keep_freed_memory: bool = False) -> dict:
    from benchmarks.common import run_tunix

    r = run_tunix(ROOT, "grpo", model_dir, steps, keep_freed_memory)
    return {"step_s": r["median_step_s"], "rollout": r["median"]["rollout_s"],
            "update": r["median"]["train_s"]}


PEERS = {"tunix": tunix, "trl": trl}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="colocated", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--peers", default="tunix,trl",
                    help="comma-separated peers run in the same script, alternating with ours: "
                         "tunix (its own venv, benchmarks/peers/setup_tunix.sh), trl")
    ap.add_argument("--peers-keep-freed-memory", action="store_true",
                    help="run the peers with the glibc malloc settings posttrain gives itself "
                         "(posttrain/host_memory.py) instead of as they ship")
    args = ap.parse_args()
    variants = args.variants.split(",")
    peers = [p for p in args.peers.split(",") if p]
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import (REFERENCE, matmul_floor_seconds, matmul_peak_gflops, tunix_python,
                                   steal_report, with_steal)
    from tests.helpers import save_tiny_model_with_tokenizer

    if "tunix" in peers:
        tunix_python(ROOT)  # fail before the first run, not after it
    work = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    model_dir = work / "model"
    save_tiny_model_with_tokenizer(model_dir, "qwen3", hidden=256, inter=768, layers=4, heads=4,
                                   kv=2, head_dim=64)
    peak = matmul_peak_gflops()
    # The prompts are ~20 tokens; the update's rows are padded to a multiple of 32 (96 here).
    floor = matmul_floor_seconds(REFERENCE, batch=64, prompt_len=32, new_tokens=64)
    res = {v: [] for v in variants + peers}
    stolen = {v: [] for v in variants + peers}
    for _ in range(args.rounds):
        for k in variants + peers:
            run = (lambda k=k: ours(model_dir, args.steps, work, k)) if k in variants \
                else (lambda k=k: PEERS[k](model_dir, args.steps, args.peers_keep_freed_memory))
            r, st = with_steal(run)
            res[k].append(r)
            stolen[k].append(st)
    best = {k: min(v, key=lambda r: r["step_s"]) for k, v in res.items()}
    # FLOPs of one step: 64 sequences x (<= ~20 prompt + 64 new) tokens; the rollout's forward
    # (2 N per token) and the update (6 N; its forward also gives logp_old at mu = 1),
    # N = matmul params.
    n_params = 3.28e6
    tokens = 64 * (20 + 64)
    flops = tokens * n_params * (2 + 6)
    print(f"matmul peak measured now: {peak:.0f} GFLOP/s (f32); peers' host malloc: "
          + ("posttrain's settings" if args.peers_keep_freed_memory
             else "glibc's defaults, as they ship"))
    print(f"{'':<30}{'s / step':>10}" + "".join(f"{'vs ' + p:>12}" for p in peers))
    for k in peers + variants:
        o = best[k]
        name = {"tunix": "Tunix 0.1.7 GRPO", "trl": "TRL GRPOTrainer"}.get(k, "posttrain " + k)
        print(f"{name:<30}{o['step_s']:>10.3f}"
              + "".join(f"{best[p]['step_s'] / o['step_s']:>11.2f}x" for p in peers))
    for k in variants + [p for p in peers if "rollout" in best[p]]:
        o = best[k]
        print(f"{k} phases (median s): " + ", ".join(
            f"{n.split('/')[-1]} {x:.3f}" for n, x in o.items() if n != "step_s"))
        print(f"  step FLOPs ~{flops / 1e9:.1f} GFLOP -> {flops / o['step_s'] / 1e9:.0f} GFLOP/s "
              f"= {flops / o['step_s'] / 1e9 / peak:.1%} of the measured peak")
    print(f"matmul floor at this workload's shapes (weight matmuls alone, jit): rollout "
          f"{floor['rollout']:.3f} s + update {floor['update']:.3f} s = {floor['step']:.3f} s per step")
    print("all rounds: " + json.dumps({k: [round(r['step_s'], 3) for r in v] for k, v in res.items()}))
    print(steal_report(stolen))


if __name__ == "__main__":
    main()
