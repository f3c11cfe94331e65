"""JAX's persistent compilation cache, on by default for every posttrain command.

A run compiles the same train step, log-prob pass and decode buckets as the run before it (a
resume, the next recipe tweak, the next stage of a sweep); XLA's compiles of those are most of a
small run's start-up (measured: a 3-step GRPO run on the tiny model, 45 s cold and 31 s with
the cache warm). JAX keys each entry on the program, its shardings, the backend and the flags,
so a changed model or mesh compiles afresh, and an unreadable entry is compiled again (JAX
warns). Only compiles of at least `jax_persistent_cache_min_compile_time_secs` (JAX's default,
1 s) are written.

`POSTTRAIN_COMPILE_CACHE`: a directory, or `off`. Unset: JAX's own `JAX_COMPILATION_CACHE_DIR`
where set, else `$XDG_CACHE_HOME/posttrain/jax` (`~/.cache/posttrain/jax`). The choice is put in
the environment so that every process the run starts (Ray workers, trainer-group hosts, the
reward pool) shares it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OFF = ("off", "0", "false", "none", "")


def cache_dir(environ: dict | None = None) -> Path | None:
    """Where compiled programs are kept, or None when the cache is off."""
    e = os.environ if environ is None else environ
    chosen = e.get("POSTTRAIN_COMPILE_CACHE")
    if chosen is not None:
        return None if chosen.strip().lower() in OFF else Path(chosen).expanduser()
    if e.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(e["JAX_COMPILATION_CACHE_DIR"]).expanduser()
    base = e.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "posttrain" / "jax"


def enable() -> Path | None:
    """Point this process's JAX (and, through the environment, its children's) at the cache."""
    path = cache_dir()
    if path is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        if "jax" in sys.modules:
            sys.modules["jax"].config.update("jax_compilation_cache_dir", None)
        return None
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    if "jax" in sys.modules:  # JAX reads the variable when it is imported
        sys.modules["jax"].config.update("jax_compilation_cache_dir", str(path))
    return path


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's event
CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileTally:
    """This process's XLA compiles so far, from `jax.monitoring`'s events: `count` programs
    compiled or loaded from the persistent cache (JAX records one backend-compile duration for
    either), `seconds` spent on them, `cache_hits` of them loaded. A recompiling loop (a new
    shape every step) shows as a count that keeps rising after the first steps. Compiles in
    other processes (Ray engine workers, trainer-group hosts) are theirs, not counted here."""

    count = 0
    seconds = 0.0
    cache_hits = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import jax.monitoring

        def on_duration(event: str, duration_secs: float, **_) -> None:
            if event == BACKEND_COMPILE:
                cls.count += 1
                cls.seconds += duration_secs

        def on_event(event: str, **_) -> None:
            if event == CACHE_HIT:
                cls.cache_hits += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        cls._installed = True

    @classmethod
    def snapshot(cls) -> tuple[int, float, int]:
        return cls.count, cls.seconds, cls.cache_hits


def compile_metrics(before: tuple[int, float, int]) -> tuple[dict, tuple[int, float, int]]:
    """(`compile/count`, `compile/seconds`, `compile/cache_hits` since `before`, the tally now)."""
    now = CompileTally.snapshot()
    return ({"compile/count": now[0] - before[0], "compile/seconds": round(now[1] - before[1], 3),
             "compile/cache_hits": now[2] - before[2]}, now)


SMALL_MODEL = 50_000_000  # matmul parameters: below this a step is milliseconds on a TPU


def resolve_effort(setting, platform: str, matmul_params: int) -> float:
    """`train.compile_effort` as a number: auto is -1 on a TPU for a small model (libtpu's
    backend passes are most of a small run: the quickstart's 3M-model GRPO update compiles for
    ~50 s at full effort and ~7 s at -1, measured with `posttrain plan --topology v5e-4`), else
    XLA's default 0 (a real model's step is worth the compiler's time)."""
    if setting != "auto":
        return float(setting)
    return -1.0 if platform == "tpu" and matmul_params < SMALL_MODEL else 0.0


def set_effort(setting, model_cfg) -> float:
    """Applies `train.compile_effort` to every later compile in this process (and, through the
    environment, in the processes it starts); returns the number applied."""
    import jax

    effort = resolve_effort(setting, jax.default_backend(), model_cfg.matmul_params())
    os.environ["JAX_EXEC_TIME_OPTIMIZATION_EFFORT"] = str(effort)
    jax.config.update("jax_exec_time_optimization_effort", effort)
    return effort
