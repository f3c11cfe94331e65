"""A GRPO step of the 0.6B shape on one accelerator chip, split by phase.

    python -m benchmarks.tpu.grpo_step [--steps 5] [--out DIR] [--set KEY=VALUE ...] [--dry-run]
                                       [--peer tunix]

The shipped one-chip recipe (`recipes/grpo_qwen3_0_6b_v5e.yaml`: LoRA 16, 64 prompts x 8
samples, up to 256 new tokens, the colocated JAX engine with an int8 KV cache of at most 64
sequences per decode program) run by `posttrain run` itself in a process of its own, with what
this machine lacks replaced: a random model of the Qwen3-0.6B shape (the full 151,936-token
vocabulary) written as an HF checkpoint, next to a BPE tokenizer trained on the generated
arithmetic task, whose prompts (~20 tokens, at most 32) replace GSM8K's; rows are padded to
`data.seq_len` 288 = 32 + 256, as Tunix's are (splash pads to its 384-tile inside attention
alone; the rows were 384 before 2026-12-07). A random policy never
samples its end token, so every completion runs to the 256-token limit (the worst case) and the
reward is ~0 (the step's cost does not depend on it). `--set` passes overrides to the recipe
(e.g. `--set model.lora.rank=0`).

Reported from the run's own metrics.jsonl: the median step over the steady steps (past the
first, none compiling or loading a program; else those after the first two) and its phases
(rollout, reward, logprob, update, sync), the tokens generated per second, and the programs
compiled per step (`compile/count`). On the TPU machine (../shared/TPU.md), after
`source .whl-tpu/setup.sh`, with `--out $OUT`; this process never opens the chip (the model is
made on the CPU), the run's process does. `--dry-run`: a tiny shape and workload on CPU (the
test suite runs it so the command stays working). `--peer tunix`: then Tunix's GRPO on the same
workload in a process of its own (`benchmarks.tpu.tunix_grpo`; needs $TUNIX_PATH, see
../shared/TPU.md), and the ratio of its median step to ours (`--peer-only`: the peer alone).
Each run is bounded by `--timeout` seconds (a run cut short reports the steps it logged,
`timed_out`), and the results are written after each run, so a device call that runs out of
time still brings back ours. At the 0.6B shape ours and Tunix's do not fit one 10-minute call
together: run them as two. A cold run of ours compiles for ~6 minutes (20 programs, 337 s on
2026-12-07) and logs one step in a 10-minute call; run the same command again while the machine
is warm (it keeps /tmp and the home directory ~100 s after a call): posttrain's persistent
compile cache (`~/.cache/posttrain/jax`) then loads every program, and the steady steps follow
~40 s after the start.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_qwen3_0_6b_v5e.yaml"
WARMUP = 2
PHASES = ("time/rollout", "time/reward", "time/logprob", "time/update", "time/sync")


def make_model(out: Path, tiny: bool) -> None:
    """A random model of the shape (bf16 weights) and a BPE tokenizer, as an HF directory."""
    from flax import nnx

    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe
    from posttrain.models import CausalLM
    from posttrain.models.config import ModelConfig
    from posttrain.models.export import save_hf

    cfg = ModelConfig(vocab_size=4096) if tiny else ModelConfig.preset("qwen3_0_6b")
    save_hf(CausalLM(cfg, nnx.Rngs(0)), out, dtype="bfloat16")
    train_bpe(generated.corpus_for_tokenizer(99), 512, out)


def recipe(model_dir: Path, run_dir: Path, steps: int, tiny: bool) -> dict:
    """The shipped recipe with this machine's model and data."""
    import yaml

    r = yaml.safe_load(RECIPE.read_text())
    r.update(run_dir=str(run_dir), name="bench_grpo_0_6b")
    r["model"]["path"] = str(model_dir)
    r["data"] = {"source": "generated", "format": "prompt_completion",
                 "seq_len": 128 if tiny else 288}
    r["train"]["steps"] = steps
    r["rewards"] = {"functions": [{"fn": "math", "kwargs": {"fallback_last_number": True}}],
                    "num_workers": 2, "dry_run": False}
    r["eval"] = {"every": 100000, "num_problems": 8}
    r["checkpoint"] = {"every": 0}
    r["tracking"] = {"console": False, "wandb": {"enabled": False}}
    if tiny:
        r["grpo"].update(prompts_per_step=4, group_size=4, max_tokens=16, mini_batches=2)
        r["train"]["grad_accum"] = 1
        r["rollout"]["max_rows"] = 8
    return r


def summary(run_dir: Path, prompts: int, group: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("time/step") is not None]
    compiles = {"compiles_per_step": [r.get("compile/count", 0) for r in rows],
                "compile_seconds": round(sum(r.get("compile/seconds", 0) for r in rows), 1)}
    if not steps:
        return {"steps_timed": 0, **compiles}
    # steady steps: past the first, nothing compiled or loaded from the compile cache
    steady = [r for r in steps[1:] if not r.get("compile/count") and not r.get("compile/cache_hits")]
    timed = steady or steps[WARMUP:] or steps[-1:]
    step_s = statistics.median(r["time/step"] for r in timed)
    gen = statistics.median(r.get("completion_len/mean", r.get("rollout/completion_len", 0))
                            for r in timed)
    return {"steps_timed": len(timed), "step_s": step_s,
            **{p.split("/")[1] + "_s": statistics.median(r[p] for r in timed if p in r)
               for p in PHASES if any(p in r for r in timed)},
            "completion_tokens_mean": gen,
            # the trainer's pi_old against the engine's log-probs (the first mini-batch's rows
            # when pi_old is the engine's: `grpo.logp_old`)
            "mismatch_kl": statistics.median(r.get("mismatch/kl", float("nan")) for r in timed),
            "generated_tokens_per_s": prompts * group * gen / step_s if gen else None,
            **compiles}


def bounded(cmd: list[str], env: dict, timeout: float | None) -> tuple[int | None, str, str]:
    """Run `cmd` for at most `timeout` seconds: (returncode, or None when cut short; stdout;
    stderr)."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                           timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, text(e.stdout), text(e.stderr)


def save(res: dict, out: str | None) -> None:
    print(json.dumps(res), flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "grpo_step.json").write_text(json.dumps(res, indent=1))


def tunix_peer(args, env: dict) -> dict:
    """`benchmarks.tpu.tunix_grpo` in a process of its own, Tunix on its path alone."""
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("TUNIX_PATH"), env.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.tpu.tunix_grpo", "--steps", str(args.steps),
           *(["--tiny"] if args.dry_run else [])]
    rc, out, err = bounded(cmd, env, args.timeout)
    line = next((x for x in out.splitlines() if x.startswith("@@")), None)
    return json.loads(line[2:]) if line else {"peer": "tunix", "timed_out": rc is None,
                                              "error": err[-1500:]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", action="append", default=[], help="recipe override KEY=VALUE")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    ap.add_argument("--peer", default="", choices=["", "tunix"])
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run (ours, the peer's)")
    ap.add_argument("--peer-only", action="store_true",
                    help="the peer's run alone (ours in another device call)")
    args = ap.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process makes the model; the run holds the chip
    import yaml

    work = Path(tempfile.mkdtemp(prefix="grpo06_"))
    make_model(work / "model", args.dry_run)
    run_dir = work / "run"
    r = recipe(work / "model", run_dir, args.steps, args.dry_run)
    (work / "recipe.yaml").write_text(yaml.safe_dump(r, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if args.dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    rc, err = 0, ""
    if not args.peer_only:
        rc, _, err = bounded([sys.executable, "-m", "posttrain.cli", "run",
                              str(work / "recipe.yaml"), *args.set], env, args.timeout)
    g = r["grpo"]
    res = {"workload": {"prompts": g["prompts_per_step"], "group": g["group_size"],
                        "max_tokens": g["max_tokens"], "seq_len": r["data"]["seq_len"],
                        "lora_rank": r["model"].get("lora", {}).get("rank", 0),
                        "rollout": r["rollout"], "overrides": args.set},
           "returncode": rc, "timed_out": rc is None}
    if (run_dir / "metrics.jsonl").exists():
        res.update(summary(run_dir, g["prompts_per_step"], g["group_size"]))
        if args.out:  # every logged row, for a run cut short
            Path(args.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(run_dir / "metrics.jsonl", Path(args.out) / "grpo_step_metrics.jsonl")
    if rc != 0:
        res["error"] = err[-1500:]
        if args.out:
            (Path(args.out) / "grpo_step_stderr.txt").write_text(err[-200_000:])
    save(res, args.out)
    if args.peer == "tunix":
        res["tunix"] = tunix_peer(args, env)
        if "median_step_s" in res["tunix"] and "step_s" in res:
            res["ours_over_tunix"] = res["tunix"]["median_step_s"] / res["step_s"]
        save(res, args.out)
    sys.exit(1 if rc != 0 else 0)


if __name__ == "__main__":
    main()
