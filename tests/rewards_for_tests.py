"""Reward plugins used by the end-to-end tests (loaded as `tests/rewards_for_tests.py:NAME`)."""


def says_seven(prompts, completions, **columns) -> list[float]:
    """1 when the completion contains the digit 7. A behaviour the policy can shift on every
    prompt at once, so a short GRPO run measurably raises it (the arithmetic reward of
    grpo_tiny moves within its noise in 16 steps of a 3M-parameter model)."""
    return [1.0 if "7" in c else 0.0 for c in completions]
