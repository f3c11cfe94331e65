"""Reward plugins used by the end-to-end tests (loaded as `tests/rewards_for_tests.py:NAME`)."""


def says_seven(prompts, completions, **columns) -> list[float]:
    """1 when the completion contains the digit 7. A behaviour the policy can shift on every
    prompt at once, so a short GRPO run measurably raises it (the arithmetic reward of
    grpo_tiny moves within its noise in 16 steps of a 3M-parameter model)."""
    return [1.0 if "7" in c else 0.0 for c in completions]


def first_token_parity(prompts, completions, completion_ids, **columns) -> list[float]:
    """1 when the first sampled token id is odd: a reward that varies within every group even
    for an untrained model, so the first update always moves the weights."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


def never_returns_sometimes(prompts, completions, **columns) -> list[float]:
    """Never returns on about a third of the batches (chosen by the batch's first prompt, so
    the same batches hang in every run); otherwise 0. The pool's timeout must bound the step."""
    import threading
    import zlib

    if len(completions) > 1 and zlib.crc32(str(prompts[0]).encode()) % 3 == 0:
        threading.Event().wait()
    return [0.0] * len(completions)
