"""Held-out accuracy after each stage, and the run's summary table and plot.

`stage_accuracy` runs greedy decoding with the JAX engine on the held-out problems (generated
eval split: never seen in any stage) and scores them with the recipe's correctness reward. A
pretrained model is prompted with plain text ("What is a + b? The answer is"), later stages with
the chat template. `write_report` leaves RUN_DIR/summary.md (a table) and RUN_DIR/progress.png
(GRPO reward, held-out accuracy and completion length over steps).
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.config import RunConfig


def stage_accuracy(cfg: RunConfig, root: Path) -> dict:
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.models import from_pretrained
    from posttrain.rollouts import encode_prompt, greedy_accuracy, make_environment, prompt_rows
    from rewards.pool import RewardPool
    from rollout.jax_engine import JaxEngine

    run_dir = Path(cfg.run_dir)
    tok = load_tokenizer(run_dir / "tokenizer")
    engine = JaxEngine(from_pretrained(run_dir), tok)
    rows = prompt_rows(cfg, "eval", cfg.eval.num_problems)
    if cfg.algorithm != "pretrain":
        ids, probe = [encode_prompt(r, tok, True, i) for i, r in enumerate(rows)], {}
    else:  # a pretrained model continues plain text: stop where the next document would start
        ids = [tok(r["prompt"] + " The answer is", add_special_tokens=False)["input_ids"] for r in rows]
        probe = {"stop": ("\n", "What"), "prefix": "The answer is"}
    env = make_environment(cfg) if cfg.algorithm != "pretrain" else None  # tools at eval too
    try:
        with RewardPool(cfg.rewards.model_copy(update={"dry_run": False})) as pool:
            metrics, texts = greedy_accuracy(cfg.model_copy(update={"eval": cfg.eval.model_copy(
                update={"max_tokens": cfg.eval.max_tokens or 12})}), engine, pool, rows, ids,
                env=env, tokenizer=tok, **probe)
    finally:
        if env is not None:
            env.close()
    result = {"stage": cfg.name, "algorithm": cfg.algorithm, "accuracy": metrics["eval/accuracy"],
              "problems": len(rows), **({"tool_call_rate": metrics["eval/with_tool_call"]}
                                        if "eval/with_tool_call" in metrics else {}),
              "examples": [{"prompt": r["prompt"], "completion": t} for r, t in zip(rows[:3], texts)]}
    with (root / "stage_accuracy.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")
    return result


def write_report(stages: list[RunConfig], root: Path, seconds: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = {}
    path = root / "stage_accuracy.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            acc[row["stage"]] = row
    tools = any("tool_call_rate" in r for r in acc.values())  # a multi-turn recipe
    lines = ["| stage | algorithm | steps | final train loss / reward | held-out accuracy (greedy) | "
             + ("tool-call rate | " if tools else "") + "minutes |",
             "| --- | --- | --- | --- | --- | " + ("--- | " if tools else "") + "--- |"]
    for cfg in stages:
        m = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
        last = m[-1] if m else {}
        val = f"reward {last.get('reward_mean', float('nan')):.3f}" if cfg.algorithm == "grpo" \
            else f"loss {last.get('loss', float('nan')):.3f}"
        a = acc.get(cfg.name, {}).get("accuracy")
        rate = acc.get(cfg.name, {}).get("tool_call_rate")
        lines.append(f"| {cfg.name} | {cfg.algorithm} | {cfg.train.steps} | {val} | "
                     f"{'' if a is None else f'{100 * a:.1f}%'} | "
                     + (f"{'' if rate is None else f'{100 * rate:.1f}%'} | " if tools else "")
                     + f"{seconds.get(cfg.name, 0) / 60:.1f} |")
    (root / "summary.md").write_text("\n".join(lines) + "\n")

    rl = [c for c in stages if c.algorithm == "grpo"]
    dpo = [c for c in stages if c.algorithm == "dpo"]
    if dpo and not rl:
        plot_dpo(dpo[-1], acc, root, plt)
    if not rl:
        return
    m = [json.loads(x) for x in (Path(rl[-1].run_dir) / "metrics.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.6))
    steps = [r["step"] for r in m if r.get("reward_mean") is not None]
    ax[0].plot(steps, [r["reward_mean"] for r in m if r.get("reward_mean") is not None], lw=1)
    ax[0].set(title="GRPO: mean reward per step", xlabel="step", ylabel="reward")
    ev = [(r["step"], r["eval/accuracy"]) for r in m if r.get("eval/accuracy") is not None]
    ax[1].plot([s for s, _ in ev], [100 * a for _, a in ev], marker="o", label="GRPO (held-out)")
    for name, style in (("pretrain", ":"), ("sft", "--")):
        if name in acc:
            ax[1].axhline(100 * acc[name]["accuracy"], ls=style, c="gray", label=f"after {name}")
    ax[1].set(title="held-out accuracy (greedy)", xlabel="GRPO step", ylabel="%")
    ax[1].legend(fontsize=8)
    calls = [(r["step"], r["episodes/with_tool_call"]) for r in m if "episodes/with_tool_call" in r]
    if calls:  # a multi-turn recipe: how often the policy calls a tool
        ax[2].plot([s for s, _ in calls], [100 * c for _, c in calls], lw=1, label="sampled episodes")
        ev = [(r["step"], r["eval/with_tool_call"]) for r in m if "eval/with_tool_call" in r]
        ax[2].plot([s for s, _ in ev], [100 * c for _, c in ev], marker="o", label="held-out (greedy)")
        ax[2].set(title="GRPO: episodes that call a tool", xlabel="step", ylabel="%")
        ax[2].legend(fontsize=8)
    else:
        lens = [(r["step"], r["completion_len/mean"]) for r in m if r.get("completion_len/mean") is not None]
        ax[2].plot([s for s, _ in lens], [n for _, n in lens], lw=1)
        ax[2].set(title="GRPO: mean completion length", xlabel="step", ylabel="tokens")
    fig.tight_layout()
    fig.savefig(root / "progress.png", dpi=110)


def plot_dpo(cfg: RunConfig, acc: dict, root: Path, plt) -> None:
    """RUN_DIR/progress.png of a DPO recipe: the loss, TRL's reward accuracy and margin over
    steps, and held-out accuracy after each evaluated stage."""
    m = [json.loads(x) for x in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in m if "rewards/accuracies" in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(14, 3.6))
    ax[0].plot(steps, [r["loss"] for r in rows], lw=1)
    ax[0].set(title=f"DPO ({cfg.dpo.loss}): loss", xlabel="step")
    ax[1].plot(steps, [100 * r["rewards/accuracies"] for r in rows], lw=1, label="accuracy (%)")
    ax2 = ax[1].twinx()
    ax2.plot(steps, [r["rewards/margins"] for r in rows], lw=1, c="tab:orange", label="margin")
    ax[1].set(title="chosen reward > rejected (%), and the margin", xlabel="step")
    ax[1].legend(loc="lower left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    names = [n for n in acc if n in ("pretrain", "sft") or n == cfg.name]
    ax[2].bar(names, [100 * acc[n]["accuracy"] for n in names])
    for i, n in enumerate(names):
        ax[2].text(i, 100 * acc[n]["accuracy"], f"{100 * acc[n]['accuracy']:.1f}%", ha="center",
                   va="bottom", fontsize=9)
    ax[2].set(title="held-out accuracy (greedy)", ylabel="%")
    fig.tight_layout()
    fig.savefig(root / "progress.png", dpi=110)
