"""Runs a recipe's stages in order. Each stage writes RUN_DIR/config.yaml (its resolved recipe)
first, and starts from the previous stage's final checkpoint (and tokenizer)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from posttrain.config import RunConfig
from posttrain.errors import UserError

console = Console(stderr=True)


def algorithm_fn(name: str):
    if name in ("pretrain", "sft"):
        from posttrain.algorithms import sft

        return sft.run
    if name == "dpo":  # the same loop; the trainer takes DPO's loss and reference
        from posttrain.train.loop import train_language_model

        return train_language_model
    from posttrain.pipeline import run_grpo

    return run_grpo


def run_stages(stages: list[RunConfig], only: list[str] | None = None) -> list[dict]:
    """Every stage in order, or those named in `only` (`posttrain run --stages`): a stage
    left out still links the next one to its run directory (checkpoint and tokenizer), so a
    later stage can run again over an earlier one's result."""
    import time

    if only:
        names = [c.name for c in stages]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise UserError(f"--stages: no stage named {', '.join(unknown)} in the recipe "
                            f"(its stages: {', '.join(names)})")

    results = []
    prev: RunConfig | None = None
    # the recipe's directory: the last stage's parent (an earlier stage may live elsewhere, e.g.
    # a stage shared with another recipe's run)
    root = Path(stages[-1].run_dir).parent if len(stages) > 1 else Path(stages[0].run_dir)
    root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    done: list[RunConfig] = []
    for i, cfg in enumerate(stages):
        if prev is not None and cfg.model.path is None:
            update = {"model": cfg.model.model_copy(update={"path": str(Path(prev.run_dir) / "checkpoints")})}
            if cfg.tokenizer.path is None:
                update["tokenizer"] = cfg.tokenizer.model_copy(
                    update={"path": str(Path(prev.run_dir) / "tokenizer")})
            cfg = cfg.model_copy(update=update)
        if only and cfg.name not in only:
            prev = cfg
            continue
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        if len(stages) > 1:
            console.rule(f"stage {i + 1}/{len(stages)}: {cfg.name} ({cfg.algorithm})")
        t0 = time.time()
        results.append(algorithm_fn(cfg.algorithm)(cfg, run_dir))
        seconds[cfg.name] = time.time() - t0
        if cfg.eval.after_stage:
            from posttrain.report import stage_accuracy

            acc = stage_accuracy(cfg, root)
            console.print(f"[bold]{cfg.name}[/]: held-out accuracy {100 * acc['accuracy']:.1f}% "
                          f"on {acc['problems']} problems")
        prev = cfg
        done.append(cfg)
    if any(c.eval.after_stage for c in done):
        from posttrain.report import write_report

        write_report(done, root, seconds)
        console.print((root / "summary.md").read_text())
    return results
