"""How much a GRPO update teaches, against supervised updates on the ground truth, from one checkpoint.

    python -m benchmarks.grpo_signal --model runs/quickstart/sft/hf [--steps 60] [--prompts 16]
                                     [--lr 5e-5] [--modes grpo,sft]

A diagnostic for the quickstart's GRPO stage (issue 8), on the generated arithmetic task:

1. Gradient directions on one batch of training prompts: two independent GRPO gradients (the
   pipeline's loss, on rollouts from the JAX engine, rewarded by `math`), and the supervised
   gradient on the reference answers of the same prompts. Cosines between them say whether the
   GRPO gradient is noise (cos(grpo1, grpo2) ~ 0) or the supervised direction (cos(grpo, sft)).
2. `--steps` updates with the recipe's optimizer (Adam, b2 0.95, clip 1) for each mode, on the
   same sequence of training prompts: `grpo` (sample, reward, the pipeline's loss) and `sft`
   (cross-entropy on the reference answers). Every 15 steps, the mean probability of the exact
   reference answer ("The answer is X.<|im_end|>", teacher-forced) on 256 held-out and 256
   training problems: a smooth measure of what greedy accuracy can follow.
Before both, the checkpoint's greedy answers on the held-out problems, by how far off the wrong
ones are.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain.algorithms import grpo as G
from posttrain.config import OptimizerSection, resolve_stages
from posttrain.data import generated
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models import from_pretrained
from posttrain.rollouts import build_batch, encode_prompt
from posttrain.algorithms.grpo import make_loss_fn
from posttrain.train.optimizer import make_optimizer
from posttrain.train.step import next_token_loss, token_logprobs
from rewards.builtins import math_reward
from rollout.engine import Rollout, SamplingParams
from rollout.jax_engine import JaxEngine

GROUP, MAX_TOKENS, MAX_OPERAND, EVAL_FRACTION = 8, 12, 30, 0.15


def reference_rollouts(rows, tok) -> list[Rollout]:
    """The reference completion of each row, ended as the chat template ends an assistant turn
    (what SFT trains on)."""
    out = []
    for i, r in enumerate(rows):
        ids = tok(r["completion"].strip(), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append(Rollout(i, encode_prompt(r, tok, True, i), ids, [0.0] * len(ids), "", "stop", 0))
    return out


def to_device(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an HF directory (e.g. runs/quickstart/sft/hf)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (x 8 completions)")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--modes", default="grpo,sft")
    args = ap.parse_args()

    cfg = resolve_stages({"algorithm": "grpo", "model": {"path": args.model},
                          "grpo": {"group_size": GROUP, "max_tokens": MAX_TOKENS}})[0]
    tok = load_tokenizer(args.model)
    model = from_pretrained(args.model, scan_layers=False)
    engine = JaxEngine(model, tok, copy_weights=True)
    graphdef, params0, frozen = nnx.split(model, nnx.Param, ...)
    grpo_loss = make_loss_fn(cfg)
    train_rows = generated.prompt_completion_rows("train", 30000, MAX_OPERAND, 0, EVAL_FRACTION)
    probe = {split: to_device(build_batch(reference_rollouts(
        generated.prompt_completion_rows(split, 256, MAX_OPERAND, 7, EVAL_FRACTION), tok),
        np.zeros(256), 64)) for split in ("eval", "train")}

    @jax.jit
    def p_reference(p, b):
        m = nnx.merge(graphdef, p, frozen)
        lp = token_logprobs(m(b["tokens"], b["positions"], b["segment_ids"]), b["targets"])
        return jnp.exp((lp * b["loss_mask"]).sum(1)).mean()

    def grad_fn(loss_fn):
        def f(p, b):
            s, n, _ = loss_fn(nnx.merge(graphdef, p, frozen), b)
            return s / n
        return jax.jit(jax.grad(f))

    grads = {"grpo": grad_fn(grpo_loss), "sft": grad_fn(next_token_loss)}

    def batch_for(mode, params, rows, seed):
        if mode == "sft":
            return to_device(build_batch(reference_rollouts(rows, tok), np.zeros(len(rows)), 64)), None
        engine.update_weights(params, seed)
        ids = [encode_prompt(r, tok, True, i) for i, r in enumerate(rows)]
        outs = engine.generate(ids, SamplingParams(n=GROUP, temperature=1.0, max_tokens=MAX_TOKENS,
                                                   seed=seed))
        reward = np.array(math_reward(None, [o.text for o in outs], fallback_last_number=True,
                                      answer=[r["answer"] for r in rows for _ in range(GROUP)]))
        return to_device(build_batch(outs, G.grpo_advantages(reward, GROUP), 64)), reward.mean()

    def flat(g):
        return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(g)])

    def cos(a, b):
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

    # 0. What the checkpoint gets wrong (greedy, held out): how far off the wrong answers are.
    held = generated.prompt_completion_rows("eval", 300, MAX_OPERAND, 0, EVAL_FRACTION)
    outs = engine.generate([encode_prompt(r, tok, True, i) for i, r in enumerate(held)],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    off = []
    for r, o in zip(held, outs):
        nums = re.findall(r"-?\d+", o.text)
        off.append(None if not nums else abs(int(nums[-1]) - int(r["answer"])))
    wrong = [d for d in off if d != 0]
    print(json.dumps({"held-out greedy accuracy": round(off.count(0) / len(off), 3),
                      "wrong answers": len(wrong),
                      "off by 1-9": sum(1 for d in wrong if d is not None and d < 10),
                      "off by 10 or more": sum(1 for d in wrong if d is not None and d >= 10),
                      "no number": wrong.count(None)}))

    rows = train_rows[: 64]
    g1 = flat(grads["grpo"](params0, batch_for("grpo", params0, rows, 1)[0]))
    g2 = flat(grads["grpo"](params0, batch_for("grpo", params0, rows, 2)[0]))
    gs = flat(grads["sft"](params0, batch_for("sft", params0, rows, 0)[0]))
    print(json.dumps({"cos(grpo1, grpo2)": round(cos(g1, g2), 3), "cos(grpo1, sft)": round(cos(g1, gs), 3),
                      "cos(grpo2, sft)": round(cos(g2, gs), 3),
                      "sign agreement grpo1/grpo2": round(float((np.sign(g1) == np.sign(g2)).mean()), 3)}))

    opt = make_optimizer(OptimizerSection(learning_rate=args.lr, schedule="constant"), args.steps)

    @jax.jit
    def apply(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    for mode in args.modes.split(","):
        params, state = params0, opt.init(params0)
        curve, rewards = [], []
        for step in range(args.steps + 1):
            if step % 15 == 0 or step == args.steps:
                curve.append({"step": step, "held_out": round(float(p_reference(params, probe["eval"])), 4),
                              "train": round(float(p_reference(params, probe["train"])), 4)})
            if step == args.steps:
                break
            rows = train_rows[step * args.prompts:(step + 1) * args.prompts]
            batch, reward = batch_for(mode, params, rows, 100 + step)
            if reward is not None:
                rewards.append(float(reward))
            params, state = apply(params, state, grads[mode](params, batch))
        print(json.dumps({"mode": mode, "lr": args.lr, "prompts": args.prompts,
                          "p(reference answer)": curve,
                          "sampled reward by quarter": [round(float(np.mean(q)), 3) for q in
                                                        np.array_split(rewards, 4)] if rewards else None}))


if __name__ == "__main__":
    main()
