"""Rewards: plain functions `fn(prompts, completions, **columns) -> list[float | None]`.

`rewards.registry.resolve` turns a recipe spec into a function, `rewards.builtins` holds math,
format, exact_match, length and code, `posttrain.sandbox` contains executed code, and
`rewards.pool.RewardPool` scores batches in worker processes with timeouts and fallbacks.
"""
