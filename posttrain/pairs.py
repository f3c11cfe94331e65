"""Preference pairs made from the task itself, for a DPO stage whose data is `generated`.

The starting model samples `dpo.pairs.samples` completions for each of `dpo.pairs.prompts`
training prompts (the chat template, the JAX engine); the recipe's rewards score them, and a
prompt whose best and worst completions are at least `min_margin` apart gives one pair: the
best chosen, the worst rejected (on the quickstart's task, a correct answer over a wrong one the
model itself wrote). The pairs are TRL's conversational preference rows, written once to
RUN_DIR/pairs.jsonl (a resumed stage reads them back) and trained on like any preference file.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.models import from_pretrained
from posttrain.rollouts import encode_prompt, prompt_rows, reward_columns
from rewards.pool import RewardPool
from rollout.engine import SamplingParams
from rollout.jax_engine import JaxEngine

BATCH = 128  # prompts per engine call


def best_and_worst(totals: np.ndarray, min_margin: float) -> tuple[int, int] | None:
    """(chosen, rejected) indices of one prompt's completions, or None without a clear gap
    (NaN, a failed reward, counts as no score)."""
    t = np.where(np.isnan(totals), -np.inf, totals)
    best, worst = int(np.argmax(t)), int(np.argmin(np.where(np.isnan(totals), np.inf, totals)))
    if not np.isfinite(t[best]) or not np.isfinite(totals[worst]) or t[best] - totals[worst] < min_margin:
        return None
    return best, worst


def sampled_pairs(cfg: RunConfig, run_dir: Path, tokenizer) -> Path:
    out = run_dir / "pairs.jsonl"
    if out.is_file():
        return out
    p = cfg.dpo.pairs
    rows = prompt_rows(cfg, "train", p.prompts)
    engine = JaxEngine(from_pretrained(cfg.model.path), tokenizer, seed=cfg.seed)
    sp = SamplingParams(n=p.samples, temperature=p.temperature, max_tokens=p.max_tokens, seed=cfg.seed)
    lines = []
    with RewardPool(cfg.rewards) as pool:
        for lo in range(0, len(rows), BATCH):
            part = rows[lo:lo + BATCH]
            ids = [encode_prompt(r, tokenizer, True, lo + i) for i, r in enumerate(part)]
            outs = engine.generate(ids, sp)
            scores = pool.score([r["prompt"] for r in part for _ in range(p.samples)],
                                [o.text for o in outs], reward_columns(part, p.samples, outs), p.samples)
            totals = scores.totals.reshape(len(part), p.samples)
            for i, r in enumerate(part):
                picked = best_and_worst(totals[i], p.min_margin)
                if picked is None:
                    continue
                c, w = (outs[i * p.samples + j].text for j in picked)
                lines.append({"prompt": [{"role": "user", "content": r["prompt"]}],
                              "chosen": [{"role": "assistant", "content": c}],
                              "rejected": [{"role": "assistant", "content": w}]})
    if not lines:
        raise UserError(f"dpo.pairs: no prompt of {len(rows)} had completions {p.min_margin} "
                        "reward apart; sample more (dpo.pairs.samples) or lower min_margin")
    tmp = out.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    tmp.replace(out)
    return out
