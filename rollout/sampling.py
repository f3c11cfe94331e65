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

import math

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
    return _keep(*_cuts(logits_bv, temperature, top_k, top_p))


def _cuts(logits_bv: jax.Array, temperature, top_k, top_p):
    """(raw f32 logits, 1 / the temperature (floored at 1e-6), top-k's cut, top-p's cut), each
    cut [B, 1] (-inf where inactive): what `process_logits` keeps is raw * t at or above both.
    Scaled by a multiply, not a division, because the scaled logits are formed anew in each
    fusion that reads them (never materialised) and the cuts must be exactly some of them:
    XLA divides differently in different fusions (a k-th largest computed in one, compared in
    another, lost the k-th token by an ulp), where a multiply rounds the same everywhere."""
    raw = logits_bv.astype(jnp.float32)
    t = 1.0 / jnp.maximum(temperature, 1e-6)  # a multiply: the same bits in every fusion
    b, v = raw.shape
    none = jnp.full((b, 1), -jnp.inf, jnp.float32)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    # The conds take the raw logits and return cuts [B, 1]: a [B, V] operand is materialised
    # (x / T would be, where its other readers recompute it in their own fusions), and a branch
    # that returns its [B, V] operand copies it (XLA:TPU copied the f32 [128, 151936] logits
    # twice per decode step that way)
    kth = jax.lax.cond(k < v, lambda r: kth_largest(r * t, jnp.broadcast_to(k, (b,))),
                       lambda r: none, raw)

    def nucleus(r):
        x = jnp.where(r * t >= kth, r * t, NEG)
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))  # 0 where cut
        need = top_p * e.sum(-1, keepdims=True)

        def enough(ge):
            return ((e * ge).sum(-1, keepdims=True) >= need) | ge.all(-1, keepdims=True)

        return largest_value_where(x, enough)

    cut = jax.lax.cond(top_p < 1.0, nucleus, lambda r: none, raw)
    return raw, t, kth, cut


def _keep(raw, t, kth, cut):
    """The scaled logits raw * t where they are at or above both cuts, NEG elsewhere."""
    x = raw * t
    return jnp.where((x >= kth) & (x >= cut), x, NEG)


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
    return _inverse_cdf(key, logprobs_bv, jnp.zeros(logprobs_bv.shape[:1] + (1,)), block)[0]


def _inverse_cdf(key, x_bv: jax.Array, m_b1: jax.Array, block: int = 128
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`inverse_cdf`'s draw from the weights exp(x - m) (m: the row's max, or any shift), each
    row's total weight sum(exp(x - m)) [B], which the draw forms anyway (the caller's
    logsumexp without another pass over [B, V]), and x at the drawn token [B].

    The vocabulary is split into blocks as [B / r, r, V / block, block] with r = 8 rows (the
    sublanes of a TPU tile), not [B, V / block, block]: in XLA:TPU's (8, 128)-tiled layout of a
    [B, V] array the former is the same bytes, the latter is not, and XLA laid the logits out
    column-major to make it so (a transposing copy of the f32 [128, 151936] logits per decode
    step, 240 us on a v5e, and one more for the gather of the drawn block). The drawn block is
    picked out as a one-hot sum over the blocks, not a gather, for the same reason: one more
    fused read."""
    b, v = x_bv.shape
    if v <= 2 * block:  # one level: the row's own cumulative sum bounds the draw
        cdf = jnp.cumsum(jnp.exp(x_bv - m_b1), axis=-1)
        tok = jnp.sum(cdf <= _draw(key, cdf[:, -1:]), axis=-1).astype(jnp.int32)
        return tok, cdf[:, -1], jnp.take_along_axis(x_bv, tok[:, None], -1)[:, 0]
    nb = -(-v // block)
    r = math.gcd(b, 8)
    x4 = jnp.pad(x_bv, ((0, 0), (0, nb * block - v)), constant_values=-jnp.inf)
    x4 = x4.reshape(b // r, r, nb, block)
    sums = jnp.exp(x4 - m_b1.reshape(b // r, r, 1, 1)).sum(-1).reshape(b, nb)
    csum = jnp.cumsum(sums, axis=-1)
    u = _draw(key, csum[:, -1:])
    blk = jnp.minimum(jnp.sum(csum <= u, axis=-1), nb - 1)  # csum[blk - 1] <= u < csum[blk]
    before = jnp.where(blk > 0, jnp.take_along_axis(csum, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
    hit = jax.lax.broadcasted_iota(jnp.int32, (b // r, r, nb, 1), 2) == blk.reshape(b // r, r, 1, 1)
    x_blk = jnp.sum(jnp.where(hit, x4, 0.0), axis=2).reshape(b, block)  # exactly the block's x
    j = _first_above(jnp.exp(x_blk - m_b1), u - before[:, None])
    return blk * block + j, csum[:, -1], jnp.take_along_axis(x_blk, j[:, None], -1)[:, 0]


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

    def greedy(x):  # the argmax's logit is the max: no gather over [B, V]
        tok = argmax_first(x)
        lp = jnp.max(x, axis=-1) - jax.nn.logsumexp(x, axis=-1)
        return tok, lp, jnp.full(tok.shape, v, jnp.int32)

    def sampled(x):
        raw, t, kth, cut = _cuts(x, temperature, top_k, top_p)
        processed = _keep(raw, t, kth, cut)  # = x / T (as x * (1 / T)) when nothing cuts
        m = jnp.max(processed, axis=-1, keepdims=True)
        tok, total, at = _inverse_cdf(key, processed, m)  # from unnormalised weights
        lse = m[:, 0] + jnp.log(total)
        # Passes of their own only where something cuts; their conds take the raw logits (a
        # [B, V] operand is materialised: x / T then would be, where every other reader
        # recomputes it in its own fusion) and return [B] only
        lse_full = jax.lax.cond(jnp.asarray(full) & filtering,
                                lambda r: jax.nn.logsumexp(r * t, axis=-1), lambda r: lse, raw)
        kept = jax.lax.cond(filtering, lambda r: (_keep(r, t, kth, cut) > NEG / 2).sum(
            -1, dtype=jnp.int32), lambda r: jnp.full(r.shape[:1], v, jnp.int32), raw)
        # the drawn token was kept, so its processed logit `at` is its scaled one
        return tok, at - jnp.where(full, lse_full, lse), kept

    return jax.lax.cond(temperature <= 0, greedy, sampled, x)
