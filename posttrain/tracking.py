"""Metrics out of a run: a rich progress bar and console lines, RUN_DIR/metrics.jsonl, and W&B.

W&B runs offline when no API key is configured (`tracking.wandb.mode: auto`), so every run leaves
a `RUN_DIR/wandb/offline-run-*` directory that `wandb sync` can upload later.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from posttrain.compile_cache import CompileTally, compile_metrics
from posttrain.config import RunConfig


def _scalar(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f if math.isfinite(f) else None


class Tracker:
    def __init__(self, cfg: RunConfig, run_dir: Path, total_steps: int, start_step: int = 0):
        self.cfg, self.run_dir = cfg, run_dir
        self.console = Console(stderr=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a")
        self.log_every = cfg.train.log_every
        self.progress = None
        if cfg.tracking.console:
            self.progress = Progress(TextColumn(f"[bold]{cfg.name}[/]"), BarColumn(),
                                     MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=self.console,
                                     transient=False)
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step,
                                               info="")
            self.progress.start()
        self.wandb = self._init_wandb(start_step)
        self._t0 = time.time()
        CompileTally.install()
        self._compiles = CompileTally.snapshot()

    def _init_wandb(self, start_step: int):
        w = self.cfg.tracking.wandb
        if not w.enabled or w.mode == "disabled":
            return None
        import wandb

        mode = w.mode
        if mode == "auto":
            has_key = bool(os.environ.get("WANDB_API_KEY")) or (Path.home() / ".netrc").exists()
            mode = os.environ.get("WANDB_MODE") or ("online" if has_key else "offline")
        run = wandb.init(project=w.project, entity=w.entity, name=w.name or self.cfg.name,
                         tags=w.tags, mode=mode, dir=str(self.run_dir), resume="allow",
                         config=self.cfg.model_dump(mode="json"),
                         settings=wandb.Settings(silent=True, console="off"))
        return run

    def log_rows(self, step: int, rows: list[int]) -> None:
        """The data rows (or prompts) step `step` trained on, to RUN_DIR/data_order.jsonl; a
        step replayed after a resume appends again (the last line of a step is what it kept)."""
        with (self.run_dir / "data_order.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "rows": [int(r) for r in rows]}) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """One row of metrics; with them this process's XLA compiles since the last row
        (`compile/count`, `compile/seconds`, `compile/cache_hits`: `compile_cache.CompileTally`)."""
        compiles, self._compiles = compile_metrics(self._compiles)
        row = {"step": step, "time": round(time.time() - self._t0, 3),
               **{k: _scalar(v) for k, v in metrics.items()}, **compiles}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if v is not None}, step=step)
        if self.progress is not None:
            info = "  ".join(f"{k}={v:.4g}" for k, v in row.items()
                             if k in ("loss", "eval_loss", "reward_mean", "tokens_per_s")
                             and isinstance(v, float))
            self.progress.update(self.task, completed=step, info=info)
            if step % self.log_every == 0 or "eval_loss" in metrics:
                self.progress.console.print(f"step {step}: {info}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()
