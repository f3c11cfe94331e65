"""The one interface every rollout engine implements, and the records it returns.

An engine turns prompt token ids into `Rollout`s: completion token ids, the per-token logprobs
under the semantics the call asks for (`SamplingParams.logprobs`: "sampled", the truncated and
renormalised distribution actually sampled from after temperature / top-k / top-p; "full", the
temperature-scaled softmax over the whole vocabulary), the kept count per token (how many tokens
top-k / top-p left at that position, so that the trainer can rebuild the same kept set), the
text, why it stopped, and the policy version whose weights produced it. `update_weights(weights, version)`
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
    logprobs: str = "sampled"  # "sampled" (truncated, renormalised) | "full" (whole softmax)

    def __post_init__(self):
        if self.n < 1 or self.max_tokens < 1:
            raise ValueError("n and max_tokens must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        if self.logprobs not in ("sampled", "full"):
            raise ValueError(f"logprobs must be 'sampled' or 'full', not {self.logprobs!r}")

    @property
    def truncates(self) -> bool:
        """Whether top-k / top-p can drop tokens (otherwise both semantics coincide)."""
        return self.top_k > 0 or self.top_p < 1.0


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
    # per completion token: tokens kept by top-k / top-p there (empty: the whole vocabulary)
    kept_counts: list[int] = field(default_factory=list)
    # per completion token: 1 where the engine sampled it, 0 on tokens an environment wrote in a
    # multi-turn episode (context, not trained on); empty: every token is sampled
    loss_mask: list[int] = field(default_factory=list)


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Rollout]:
        """n rollouts per prompt, grouped: rollouts[i * n + j] is sample j of prompt i."""

    def update_weights(self, weights: Any, version: int) -> dict[str, float]:
        """Install new weights; returns sync metrics (bytes, seconds)."""

    probe_tolerance: float  # largest probe gap to the trainer that still means "same weights"

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log p(token_t | tokens_<t), t >= 1, full softmax at temperature 1: the
        probe every sync ends with (`rollout.weight_sync.check_probe`)."""


# The weight-sync probe (`rollout.weight_sync.check_probe`), answered by every engine in its own
# process. The sampling probe: prefixes of the probe sequences, generated from at temperature 1 with the
# full-softmax log-probs (what the trainer's re-score computes). The JAX engine has two
# prefills, so syncs alternate between two requests (each path is checked at least every
# second sync, at half the cost of both every time): at even versions a few prompts sampled
# twice each (the plain prefill, its cache repeated per sample; 32 new tokens decode in two
# phases over a cache grown in between, `rollout.jax_engine.phase_ends`), at odd versions many
# short prompts once each (packed several to a row).
PROBE_NEW_TOKENS = 32


def sampling_request(sequences: list[list[int]], version: int) -> tuple[list[list[int]], SamplingParams]:
    sp = dict(temperature=1.0, ignore_eos=True, logprobs="full", seed=0x9E0BE + version)
    if version % 2 == 0:
        return ([s[:8 + 2 * i] for i, s in enumerate(sequences)],
                SamplingParams(n=2, max_tokens=PROBE_NEW_TOKENS, **sp))
    return ([s[:k] for s in sequences for k in (3, 5, 7, 9)],
            SamplingParams(n=1, max_tokens=PROBE_NEW_TOKENS // 2, **sp))


def engine_probe(eng, sequences: list[list[int]], version: int, sampling: bool = True) -> dict:
    """One engine's answer to the probe of `version`, in the engine's process: its tolerance,
    its teacher-forced scores, and (with `sampling`) what its sampling path generated."""
    out = {"tolerance": eng.probe_tolerance, "scores": eng.score(sequences), "sampled": []}
    if sampling:
        out["sampled"] = eng.generate(*sampling_request(sequences, version))
    return out


def stop_string_cut(text_of, token_ids: list[int], stop: Sequence[str]) -> tuple[int, str] | None:
    """Where a completion ends at its first stop string: (number of tokens kept, text), or None
    when no stop string occurs. The string itself is left out of the text, as vLLM does; the
    tokens that produced it are kept so the trainer sees what was sampled."""
    text = text_of(token_ids)
    hits = [(text.find(s), s) for s in stop if s and text.find(s) >= 0]
    if not hits:
        return None
    cut = min(h[0] for h in hits)
    # smallest token prefix whose text reaches the stop string's end
    end = cut + min(len(s) for pos, s in hits if pos == cut)
    for k in range(1, len(token_ids) + 1):
        if len(text_of(token_ids[:k])) >= end:
            return k, text[:cut]
    return len(token_ids), text[:cut]
