"""The one interface every rollout engine implements, and the records it returns.

An engine turns prompt token ids into `Rollout`s: completion token ids, the per-token logprobs of
the distribution actually sampled from (after temperature / top-k / top-p), the text, why it
stopped, and the policy version whose weights produced it. `update_weights(weights, version)`
installs new weights; the engine then reports that version on every rollout it makes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False  # generate max_tokens regardless of EOS (benchmarks, length probes)

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")


@dataclass
class Rollout:
    prompt_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    version: int
    extra: dict[str, Any] = field(default_factory=dict)


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """n rollouts per prompt, grouped: rollouts[i * n + j] is sample j of prompt i."""

    def update_weights(self, weights: Any, version: int) -> dict[str, float]:
        """Install new weights; returns sync metrics (bytes, seconds)."""


def apply_stop_strings(text_of, token_ids: list[int], logprobs: list[float], stop: Sequence[str],
                       finish: str) -> tuple[list[int], list[float], str, str]:
    """Cut a completion at the first stop string (the string itself excluded from the text, as
    vLLM does; the tokens that produced it are kept so the trainer sees what was sampled)."""
    text = text_of(token_ids)
    if not stop:
        return token_ids, logprobs, text, finish
    hits = [(text.find(s), s) for s in stop if s and text.find(s) >= 0]
    if not hits:
        return token_ids, logprobs, text, finish
    cut = min(h[0] for h in hits)
    # smallest token prefix whose text reaches the stop string's end
    end = cut + min(len(s) for pos, s in hits if pos == cut)
    for k in range(1, len(token_ids) + 1):
        if len(text_of(token_ids[:k])) >= end:
            return token_ids[:k], logprobs[:k], text[:cut], "stop"
    return token_ids, logprobs, text[:cut], "stop"
