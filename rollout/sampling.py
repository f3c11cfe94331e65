"""Token sampling from logits: temperature, top-k, top-p (nucleus), greedy; jit-friendly.

All parameters may be traced scalars, so one compiled decode loop serves every setting.
`process_logits` returns the logits of the distribution actually sampled from. `sample` reports,
per sampled token, its log-prob under the run's semantics (`full=False`: the truncated,
renormalised distribution it was drawn from, vLLM's `processed_logprobs`; `full=True`: the
temperature-scaled full softmax) and the kept count: how many tokens survived top-k / top-p at
that position, which the trainer replays to rebuild the same kept set
(`posttrain.algorithms.grpo.kept_set_logprobs`).

Tie rule: both cuts compare values, so every token tied with the last one kept is kept too (the
kept set never depends on the order of a sort). vLLM cuts top-p by sorted position instead and may
keep only some of the tied tokens; replaying the kept count makes the trainer exact for either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.algorithms.grpo import kth_largest, largest_value_where

NEG = -1e30


def process_logits(logits_bv: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """The temperature-scaled logits with every token outside top-k, then top-p, set to NEG.

    Both cuts are values found without sorting the vocabulary (a sort of [B, 152k] per decode
    step is the sampler's whole cost on a CPU and a log-squared-depth network on a TPU, and the
    most expensive part of the decode program to compile): top-k keeps the logits >= the k-th
    largest (`kth_largest`); top-p then keeps the logits >= the largest value t whose tokens
    at or above t hold at least `top_p` of what top-k kept, which is the smallest kept value
    whose strictly larger tokens hold less than `top_p`: the cut of the smallest sorted prefix
    with mass >= top_p (`largest_value_where`). Each is 32 passes over [B, V], and each runs
    only when its parameter is active."""
    x = logits_bv.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    b, v = x.shape
    none = jnp.full((b, 1), -jnp.inf, jnp.float32)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jax.lax.cond(k < v, lambda x: kth_largest(x, jnp.broadcast_to(k, (b,))),
                       lambda x: none, x)
    x = jnp.where(x >= kth, x, NEG)
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # 0 where cut
    need = top_p * e.sum(-1, keepdims=True)

    def enough(ge):
        return ((e * ge).sum(-1, keepdims=True) >= need) | ge.all(-1, keepdims=True)

    cut = jax.lax.cond(top_p < 1.0, lambda x: largest_value_where(x, enough), lambda x: none, x)
    return jnp.where(x >= cut, x, NEG)


def argmax_first(x_bv: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis (the first index of the maximum) as two plain reductions,
    a max and a min over the indices that hold it: XLA:CPU runs argmax's (value, index) reduce
    as a scalar loop, 45 us for [64, 512] per call, the two reductions vectorised (a row of
    NaNs gives its last index)."""
    v = x_bv.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x_bv.shape, x_bv.ndim - 1)
    hit = x_bv == jnp.max(x_bv, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, iota, v), axis=-1), v - 1)


def inverse_cdf(key, logprobs_bv: jax.Array, block: int = 128) -> jax.Array:
    """One draw per row from softmax(logprobs): the first token whose cumulative probability
    exceeds a uniform draw scaled to the row's total. One random number per row where
    `jax.random.categorical` (Gumbel-max) needs one per vocabulary entry: on CPU the threefry
    draws of a [64, 512] Gumbel made a jitted 200-step sampling loop 1.6-3x slower (AVX-512:
    0.62 vs 0.38 ms per step; AVX2: 1.30 vs 0.42). The same distribution: the chi-square tests
    of tests/rollout/test_sampling.py.

    A vocabulary of more than two `block`s (128: a TPU vector's lanes, and a divisor of padded
    vocabularies such as Qwen3's 151,936, so no pad) is searched in two levels: the blocks'
    sums and their cumulative sum find the block the draw falls in, then a cumulative sum
    inside that block alone finds the token. One pass over [B, V] (exp and block sums) instead
    of a cumulative sum over the whole vocabulary, which XLA:TPU runs as a log-depth scan of
    passes (8% of a decode step at batch 64 on a v5e, BENCHMARKS.md).

    Tokens with zero probability add nothing to the cumulative sums, so they are never drawn:
    the draw stays below the total (u * total may round up to it), the block found is one whose
    sum is positive, and a draw past the block's own rounded total lands on its last token with
    mass."""
    return _inverse_cdf(key, logprobs_bv, block)[0]


def _inverse_cdf(key, logprobs_bv: jax.Array, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """`inverse_cdf`'s draw and each row's total weight sum(exp(logprobs)) [B], which the
    draw forms anyway (the caller's logsumexp without another pass over [B, V])."""
    b, v = logprobs_bv.shape
    p = jnp.exp(logprobs_bv)
    if v <= 2 * block:  # one level: the row's own cumulative sum bounds the draw
        cdf = jnp.cumsum(p, axis=-1)
        return jnp.sum(cdf <= _draw(key, cdf[:, -1:]), axis=-1).astype(jnp.int32), cdf[:, -1]
    nb = -(-v // block)
    p3 = jnp.pad(p, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    sums = p3.sum(-1)  # [B, nb]
    csum = jnp.cumsum(sums, axis=-1)
    u = _draw(key, csum[:, -1:])
    blk = jnp.minimum(jnp.sum(csum <= u, axis=-1), nb - 1)  # csum[blk - 1] <= u < csum[blk]
    before = jnp.where(blk > 0, jnp.take_along_axis(csum, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner = jnp.take_along_axis(p3, blk[:, None, None], axis=1)[:, 0]  # [B, block]
    return blk * block + _first_above(inner, u - before[:, None]), csum[:, -1]


def _draw(key, total_b1: jax.Array) -> jax.Array:
    """A uniform draw in [0, total) per row, kept below the total when it rounds up to it."""
    u = jax.random.uniform(key, total_b1.shape, total_b1.dtype) * total_b1
    return jnp.minimum(u, jnp.nextafter(total_b1, jnp.zeros_like(total_b1)))


def _first_above(p_bv: jax.Array, u_b1: jax.Array) -> jax.Array:
    """The first index whose cumulative probability exceeds u, or the last index with mass when
    rounding leaves u at or above the block's cumulative total (its sum in the block sums may
    have rounded above its own cumulative sum)."""
    v = p_bv.shape[-1]
    idx = jnp.sum(jnp.cumsum(p_bv, axis=-1) <= u_b1, axis=-1)
    iota = jax.lax.broadcasted_iota(jnp.int32, p_bv.shape, 1)
    last = jnp.max(jnp.where(p_bv > 0, iota, 0), axis=-1)
    return jnp.where(idx >= v, last, jnp.minimum(idx, last)).astype(jnp.int32)


def sample(key, logits_bv: jax.Array, temperature, top_k, top_p, full=False
           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens [B], logprobs [B], kept counts [B]). Greedy when temperature == 0 (log-prob of
    the raw softmax, the whole vocabulary kept). The cuts of top-k / top-p only run when one of
    them is active, and greedy and sampled decoding are the two branches of a `lax.cond`: a
    sampled step's passes over [B, V] are the max and the draw's exponentials and block sums,
    whose row totals give the log-prob's normaliser (log-sum-exp = max + log total); the full
    softmax's normaliser is a pass of its own only when a cut made the two differ."""
    v = logits_bv.shape[-1]
    x = logits_bv.astype(jnp.float32)
    filtering = (jnp.asarray(top_k) > 0) | (jnp.asarray(top_p) < 1.0)  # arrays: `~` is logical

    def greedy(x):
        tok = argmax_first(x)
        lp = jnp.take_along_axis(x, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(x, axis=-1)
        return tok, lp, jnp.full(tok.shape, v, jnp.int32)

    def sampled(x):
        scaled = x / jnp.maximum(temperature, 1e-6)
        processed = jax.lax.cond(filtering, lambda z: process_logits(z, temperature, top_k, top_p),
                                 lambda z: scaled, x)
        m = jnp.max(processed, axis=-1, keepdims=True)
        tok, total = _inverse_cdf(key, processed - m)  # from unnormalised weights
        lse = m[:, 0] + jnp.log(total)
        lse_full = jax.lax.cond(jnp.asarray(full) & filtering,
                                lambda z: jax.nn.logsumexp(z, axis=-1), lambda z: lse, scaled)
        # the drawn token was kept, so its processed logit is its scaled one
        at = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0]
        lp = at - jnp.where(full, lse_full, lse)
        kept = jnp.where(filtering, (processed > NEG / 2).sum(-1), v)
        return tok, lp, kept.astype(jnp.int32)

    return jax.lax.cond(temperature <= 0, greedy, sampled, x)
