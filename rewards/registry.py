"""Resolving a reward spec to a callable `fn(prompts, completions, **columns) -> list[float | None]`.

A spec is one of:
- a built-in name (`math`, `format`, `exact_match`, `length`, `code`);
- `package.module:function`;
- `path/to/file.py:function` (loaded by path, no package needed);
- a name registered by an installed package under the entry-point group `posttrain.rewards`.

`adapter: verl` wraps a verl-style `compute_score(data_source, solution_str, ground_truth,
extra_info)` (called once per completion) into the batch signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from importlib.metadata import entry_points

from posttrain.errors import UserError
from posttrain.plugins import load_object

ENTRY_POINT_GROUP = "posttrain.rewards"
RewardFn = Callable[..., list]


def builtin_functions() -> dict[str, RewardFn]:
    from rewards import builtins

    return {"math": builtins.math_reward, "format": builtins.format_reward,
            "exact_match": builtins.exact_match_reward, "length": builtins.length_reward,
            "code": builtins.code_reward}


def _load_entry_point(name: str) -> RewardFn | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    return None


@functools.lru_cache(maxsize=None)
def resolve(fn: str, adapter: str = "none") -> RewardFn:
    builtins = builtin_functions()
    if fn in builtins:
        f = builtins[fn]
    elif ":" in fn:
        f = load_object(fn)
    else:
        f = _load_entry_point(fn)
        if f is None:
            known = ", ".join(sorted(builtins))
            raise UserError(f"reward {fn!r}: not a built-in ({known}), not module:function or "
                            f"file.py:function, and no installed package registers it under the "
                            f"entry-point group {ENTRY_POINT_GROUP}")
    if not callable(f):
        raise UserError(f"reward {fn!r}: resolves to a non-callable {type(f).__name__}")
    return verl_adapter(f) if adapter == "verl" else f


def verl_adapter(compute_score: Callable) -> RewardFn:
    """verl's per-sample `compute_score(data_source, solution_str, ground_truth, extra_info)`."""

    def batch_fn(prompts, completions, **columns):
        n = len(completions)
        sources = columns.get("data_source", [None] * n)
        truths = columns.get("ground_truth", columns.get("answer", [None] * n))
        extras = columns.get("extra_info", [None] * n)
        out = []
        for i, c in enumerate(completions):
            text = c if isinstance(c, str) else c[-1]["content"]
            r = compute_score(sources[i], text, truths[i], extras[i])
            out.append(r["score"] if isinstance(r, dict) else r)
        return out

    batch_fn.__name__ = getattr(compute_score, "__name__", "compute_score")
    return batch_fn


def call(f: RewardFn, prompts: list, completions: list, kwargs: dict, columns: dict) -> list:
    """Call a reward function (sync or async) with the TRL-style signature."""
    out = f(prompts, completions, **columns, **kwargs)
    if inspect.isawaitable(out):
        import asyncio

        async def _await(a):
            return await a

        out = asyncio.run(_await(out))
    return list(out)
