"""SFT of the 0.6B shape on one accelerator chip through `posttrain run`, and its first losses
against the same run on the host's CPU.

    python -m benchmarks.tpu.sft_run [--steps 12] [--compare-steps 4] [--out DIR] [--dry-run]

The shipped one-chip recipe (`recipes/sft_qwen3_0_6b_v5e.yaml`: full fine-tune, f32 master
weights and Adam, bf16 compute, remat full, 8 x 2048 tokens per step, the defaults on a TPU:
splash attention, the fused LM-head loss) run by `posttrain run` itself, each run a process of
its own, with what this machine lacks replaced: a random model of the Qwen3-0.6B shape (the full
151,936-token vocabulary, f32 weights) written as an HF checkpoint next to a BPE tokenizer
trained on the generated task, whose question/answer chats (loss on the answers) replace
UltraChat, packed to 2048 tokens. Three runs:

1. the recipe as shipped, `--steps` steps on the accelerator: tokens/s (median of the steps
   after the first two), the programs compiled, the losses;
2. and 3. the comparison: the same recipe at 2 rows x 512 tokens for `--compare-steps` steps,
   on the accelerator and then on this host's CPU (`JAX_PLATFORMS=cpu`: XLA's attention and the
   CPU's bf16 matmuls), the same data in the same order from the same initial weights. Their
   per-step losses must agree within LOSS_RTOL: both compute in bf16, whose unit roundoff is
   2^-9 ~ 2e-3 per rounding; the loss of a random 0.6B model (~ln 151936 = 11.9) is a sum over
   28 layers and a 151,936-way softmax of such roundings, in different orders and kernels on the
   two platforms, so a few 1e-3 relative is expected and 1e-2 leaves room for the updates'
   (lr 1e-5, warm-up) drift over a few steps; a wrong kernel, mask or loss shows up as whole
   units.

On the TPU machine (../shared/TPU.md), after `source .whl-tpu/setup.sh`, with `--out $OUT`; this
process never opens the chip (the model is made on the CPU). `--dry-run`: a tiny shape on CPU
for every run (the test suite runs it so the command stays working); there the first run, on
the CPU at the comparison's shape, serves as the comparison's first half.
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

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "sft_qwen3_0_6b_v5e.yaml"
WARMUP = 2
LOSS_RTOL = 1e-2


def make_model(out: Path, tiny: bool) -> None:
    """A random model of the shape (f32 weights: the recipe's master weights) and a BPE tokenizer."""
    from flax import nnx

    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe
    from posttrain.models import CausalLM
    from posttrain.models.config import ModelConfig
    from posttrain.models.export import save_hf

    cfg = ModelConfig(vocab_size=4096) if tiny else ModelConfig.preset("qwen3_0_6b")
    save_hf(CausalLM(cfg, nnx.Rngs(0)), out, dtype="float32")
    train_bpe(generated.corpus_for_tokenizer(99), 512, out)


def recipe(model_dir: Path, run_dir: Path, steps: int, rows: int, seq: int) -> dict:
    """The shipped recipe with this machine's model and data, at `rows` x `seq` tokens."""
    import yaml

    r = yaml.safe_load(RECIPE.read_text())
    r.update(run_dir=str(run_dir), name="bench_sft_0_6b")
    r["model"]["path"] = str(model_dir)
    r["data"] = {"source": "generated", "format": "messages", "loss_on": "assistant",
                 "seq_len": seq, "generated": {"num_train": 20000, "num_eval": 64}}
    r["train"].update(steps=steps, batch_size=rows, eval_every=0, log_every=1)
    r["optimizer"]["warmup_steps"] = 2
    r["checkpoint"] = {"every": 0}
    r["tracking"] = {"console": False, "wandb": {"enabled": False}}
    return r


def run(model_dir: Path, work: Path, name: str, steps: int, rows: int, seq: int,
        cpu: bool) -> dict:
    """One `posttrain run` in a process of its own; its per-step metrics."""
    import yaml

    run_dir = work / name
    (work / f"{name}.yaml").write_text(yaml.safe_dump(recipe(model_dir, run_dir, steps, rows, seq),
                                                      sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", str(work / f"{name}.yaml")],
                       cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    out = {"rows": rows, "seq": seq, "steps": steps, "platform": "cpu" if cpu else "default",
           "returncode": p.returncode}
    metrics = run_dir / "metrics.jsonl"
    rows_m = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    steps_m = [m for m in rows_m if "loss" in m and "step" in m]
    out["losses"] = [m["loss"] for m in steps_m]
    timed = steps_m[WARMUP:] or steps_m[-1:]
    if timed and "tokens_per_s" in timed[0]:
        out["tokens_per_s"] = statistics.median(m["tokens_per_s"] for m in timed)
    out["compiles_per_step"] = [m.get("compile/count", 0) for m in rows_m if "step" in m]
    if p.returncode:
        out["error"] = p.stderr[-1500:]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--compare-steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    args = ap.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process makes the model; the runs hold the chip
    work = Path(tempfile.mkdtemp(prefix="sft06_"))
    make_model(work / "model", args.dry_run)
    full = (2, 128) if args.dry_run else (8, 2048)
    small = (2, 128) if args.dry_run else (2, 512)
    res = {"recipe": str(RECIPE.relative_to(ROOT)), "loss_rtol": LOSS_RTOL,
           "shipped": run(work / "model", work, "shipped", args.steps, *full, cpu=args.dry_run)}
    shipped = res["shipped"]
    if full == small and args.steps >= args.compare_steps and args.dry_run:
        acc = {**shipped, "losses": shipped["losses"][:args.compare_steps]}  # the same run
    else:
        acc = run(work / "model", work, "compare_accel", args.compare_steps, *small,
                  cpu=args.dry_run)
    cpu = run(work / "model", work, "compare_cpu", args.compare_steps, *small, cpu=True)
    res["compare"] = {"accelerator": acc, "cpu": cpu}
    pairs = list(zip(acc["losses"], cpu["losses"]))
    if pairs and len(pairs) == args.compare_steps:
        res["compare"]["max_rel_diff"] = max(abs(a - c) / abs(c) for a, c in pairs)
        res["compare"]["agree"] = res["compare"]["max_rel_diff"] <= LOSS_RTOL
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sft_run.json").write_text(json.dumps(res, indent=1))
    ok = all(r["returncode"] == 0 for r in (shipped, acc, cpu))
    sys.exit(0 if ok and res["compare"].get("agree") else 1)


if __name__ == "__main__":
    main()
