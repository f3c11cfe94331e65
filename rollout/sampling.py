"""Token sampling from logits: temperature, top-k, top-p (nucleus), greedy; jit-friendly.

All parameters may be traced scalars, so one compiled decode loop serves every setting.
`process_logits` returns the logits of the distribution actually sampled from; the logprob of the
sampled token under it is what the engine reports (vLLM's `processed_logprobs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30


def process_logits(logits_bv: jax.Array, temperature, top_k, top_p) -> jax.Array:
    x = logits_bv.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    v = x.shape[-1]
    sorted_desc = jnp.sort(x, axis=-1)[:, ::-1]
    # top-k: keep logits >= the k-th largest (k = 0 means all)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, jnp.broadcast_to(k - 1, (x.shape[0], 1)), axis=-1)
    x = jnp.where(x >= kth, x, NEG)
    # top-p over what top-k kept: keep the smallest prefix of sorted tokens with mass >= p
    sorted_kept = jnp.where(sorted_desc >= kth, sorted_desc, NEG)
    probs = jax.nn.softmax(sorted_kept, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < top_p  # the first token is always kept
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_kept, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x >= cutoff, x, NEG)


def sample(key, logits_bv: jax.Array, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
    """(tokens [B], logprobs [B]) — greedy when temperature == 0 (logprob of the raw softmax).
    The sort behind top-k / top-p only runs when one of them is active."""
    filtering = (top_k > 0) | (top_p < 1.0)
    processed = jax.lax.cond(
        filtering, lambda x: process_logits(x, temperature, top_k, top_p),
        lambda x: x.astype(jnp.float32) / jnp.maximum(temperature, 1e-6), logits_bv)
    sampled = jax.random.categorical(key, processed, axis=-1)
    greedy = jnp.argmax(logits_bv, axis=-1)
    is_greedy = temperature <= 0
    tok = jnp.where(is_greedy, greedy, sampled)
    lp_proc = jax.nn.log_softmax(processed, axis=-1)
    lp_raw = jax.nn.log_softmax(logits_bv.astype(jnp.float32), axis=-1)
    lp = jnp.where(is_greedy, lp_raw, lp_proc)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
