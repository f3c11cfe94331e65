"""`posttrain eval MODEL --dataset D --reward R --n K`: pass@1, pass@k and maj@k.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c are correct,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over problems. maj@k takes the most frequent final
answer (last \\boxed{} or, failing that, last number) among k samples and scores it.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from math import comb

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def final_answer(text: str) -> str | None:
    from rewards.builtins import extract_answer

    ans = extract_answer(text)
    if ans is None:
        nums = re.findall(r"-?\d+(?:\.\d+)?(?:/\d+)?", text)
        ans = nums[-1] if nums else None
    return ans


def generated_task_of(model_dir):
    """The generated task a model was trained on: `data.generated` of the run's config.yaml in
    the model's directory or up to two levels above (a stage dir, its hf/ or checkpoints/STEP),
    so that `--dataset generated` holds out the same problems; the defaults when there is none.
    Only that section is read, so a config.yaml from another version still serves."""
    from pathlib import Path

    from pydantic import ValidationError

    from posttrain.config import GeneratedData, format_validation_error, read_yaml
    from posttrain.errors import UserError

    p = Path(model_dir).resolve()
    for path in (p / "config.yaml", p.parent / "config.yaml", p.parent.parent / "config.yaml"):
        if path.is_file():
            section = (read_yaml(path).get("data") or {}).get("generated") or {}
            try:
                task = GeneratedData.model_validate(section)
            except ValidationError as e:
                raise UserError(f"{path}: {format_validation_error(e, 'data.generated.')}") from None
            sys.stderr.write(f"generated task from {path}: max_operand {task.max_operand}, "
                             f"eval_fraction {task.eval_fraction}, seed {task.seed}\n")
            return task
    return GeneratedData()


def run_eval(args) -> int:
    from posttrain.models.loading import resolve_model_path
    from posttrain.config import (
        DataSection,
        RewardFunctionSpec,
        RewardsSection,
        RunConfig,
    )
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models import from_pretrained
    from posttrain.rollouts import encode_prompt, prompt_rows, reward_columns
    from rewards.pool import RewardPool
    from rollout.cli_generate import find_tokenizer_dir
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine

    model_dir = resolve_model_path(args.model)
    data = DataSection(source=args.dataset, eval_source=args.dataset, eval_split=args.split)
    if args.dataset == "generated":
        data = data.model_copy(update={"generated": generated_task_of(model_dir)})
    cfg = RunConfig(data=data,
                    rewards=RewardsSection(functions=[RewardFunctionSpec(fn=args.reward,
                                                                         kwargs=json.loads(args.reward_kwargs))]))
    rows = prompt_rows(cfg, "eval", args.limit)
    tok = load_tokenizer(find_tokenizer_dir(model_dir))
    engine = JaxEngine(from_pretrained(model_dir), tok)
    ids = [encode_prompt(r, tok, not args.no_chat, i) for i, r in enumerate(rows)]
    sp = SamplingParams(n=args.n, temperature=args.temperature if args.n > 1 else 0.0,
                        max_tokens=args.max_tokens, seed=args.seed)
    outs = engine.generate(ids, sp)
    with RewardPool(cfg.rewards) as pool:
        scores = pool.score([r["prompt"] for r in rows for _ in range(args.n)], [o.text for o in outs],
                            reward_columns(rows, args.n, outs), args.n)
    label = cfg.rewards.functions[0].label
    correct = (np.nan_to_num(scores.per_function[label]) >= 1.0).reshape(len(rows), args.n)
    k = args.k or args.n
    res = {"problems": len(rows), "n": args.n,
           "pass@1": float(np.mean([pass_at_k(args.n, int(c.sum()), 1) for c in correct])),
           f"pass@{k}": float(np.mean([pass_at_k(args.n, int(c.sum()), k) for c in correct]))}
    maj = []
    for i in range(len(rows)):
        group = outs[i * args.n:(i + 1) * args.n][:k]
        answers = [final_answer(o.text) for o in group]
        votes = Counter(a for a in answers if a is not None)
        if not votes:
            maj.append(0.0)
            continue
        top = votes.most_common(1)[0][0]
        maj.append(float(correct[i][answers.index(top)]))
    res[f"maj@{k}"] = float(np.mean(maj))
    sys.stdout.write(json.dumps(res) + "\n")
    return 0


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="pass@1, pass@k and maj@k of a model on a dataset")
    e.add_argument("model")
    e.add_argument("--dataset", required=True, help="'generated', a file, or a cached hub dataset")
    e.add_argument("--split", default="test")
    e.add_argument("--reward", default="math")
    e.add_argument("--reward-kwargs", default='{"fallback_last_number": true}')
    e.add_argument("--n", type=int, default=1)
    e.add_argument("--k", type=int, default=None)
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--max-tokens", type=int, default=64)
    e.add_argument("--limit", type=int, default=200)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-chat", action="store_true")
    e.set_defaults(fn=run_eval)
