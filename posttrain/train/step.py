"""The pure jitted train step: `step(state, batch) -> (state, metrics)`.

State is a plain pytree (`TrainState`): trainable params, frozen variables (a LoRA base, or
nothing), optimizer state, step and RNG. The model's structure (an NNX graphdef) is static and
closed over. Losses return `(sum, count)` so that gradient accumulation over micro-batches divides
by the *global* count once: the accumulated gradient equals the full-batch gradient exactly, for
every aggregation (the torchtune lesson). Every algorithm plugs a `loss_fn(model, batch) ->
(loss_sum, count, aux)` into the same step. Scalar aux values are averaged over micro-batches;
`rows/*` entries are per-row outputs, concatenated back to the batch's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LossFn = Callable[[nnx.Module, dict], tuple[jax.Array, jax.Array, dict]]


class TrainState(NamedTuple):
    params: Any  # nnx.State of trainable variables
    frozen: Any  # nnx.State of everything else (LoRA base, ...)
    opt_state: Any
    step: jax.Array
    rng: jax.Array


def token_logprobs(logits_btv: jax.Array, targets_bt: jax.Array) -> jax.Array:
    """log p(target) per position, in f32."""
    logp = jax.nn.log_softmax(logits_btv.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets_bt[..., None], axis=-1)[..., 0]


HEAD_CHUNK_BYTES = 1 << 30  # one chunk's f32 logits, by default


def head_chunk(cfg, batch: int, seq: int) -> int:
    """Positions of each row whose logits are computed at once (the chunk spans every row, so
    a batch sharded over devices keeps every device busy): `cfg.head_chunk_tokens` tokens, or
    by default as many as keep one chunk's f32 logits within `HEAD_CHUNK_BYTES` (Qwen3's 152k
    vocabulary: ~1,770 tokens; a tiny model's 512: the whole batch in one chunk). On a TPU v5e, a
    0.6B model's 16k-token step ran 3.7% faster with 2,048-token chunks than with 440, at the same
    peak memory; 8,192 ran out of memory (BENCHMARKS.md). The sequence is split into as many
    chunks as that needs, of equal length rounded up to a multiple of 8 (a sublane tile), so the
    last chunk is not mostly padding: 2,048 positions under a 220-position budget run 10 chunks
    of 208 (1.6% padding), not of 220 (7.4% of the head's matmuls on padding)."""
    tokens = cfg.head_chunk_tokens or HEAD_CHUNK_BYTES // (4 * cfg.vocab_size)
    cap = max(1, min(seq, tokens // batch))
    even = -(-seq // -(-seq // cap))  # ceil(seq / the number of chunks the budget needs)
    return even if even <= 8 else min(seq, -(-even // 8) * 8)


def chunked_head(x_bte: jax.Array, lm_head, chunk: int, fn, *per_position):
    """`fn(lm_head(x_bte), *per_position)` without the [B, T, V] logits: `fn(logits_bcv, *[B,
    C] inputs)` returns a pytree of per-position [B, C] outputs, and positions go through the
    head `chunk` at a time (a `lax.map` over slices of the sequence, each under `jax.checkpoint`),
    so the forward keeps only each chunk's outputs and the backward recomputes a chunk's logits
    to differentiate them (MaxText's vocabulary tiling, Tunix's chunked log-probs). Peak memory
    of the head: [B, chunk, V] in f32, twice (logits and their gradient), instead of [B, T, V].
    The same values and gradients as the whole head up to fp32 summation order (tests). The
    next-token loss, the RL log-probs, entropy and kept-set replay all go through here."""
    b, t, e = x_bte.shape
    if chunk >= t:
        return fn(lm_head(x_bte), *per_position)
    pad = -t % chunk
    n = (t + pad) // chunk

    def slices(a):  # [B, T, ...] -> [N, B, C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)

    @partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(x_bce, *inputs):
        return fn(lm_head(x_bce), *inputs)

    out = jax.lax.map(lambda a: one(*a), (slices(x_bte), *map(slices, per_position)))
    return jax.tree.map(lambda y: y.swapaxes(0, 1).reshape(b, n * chunk, *y.shape[3:])[:, :t], out)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def fused_head_nll(x_bte, w_ve, targets_bt, weights_bt, chunk: int) -> jax.Array:
    """sum_t weights_t * -log softmax(x_t @ w_ve^T)[target_t] (the LM head and the weighted
    next-token loss, `w_ve` [V, E] in the parameter dtype, matmuls in x's dtype), with both
    gradients formed in the forward, chunk by chunk, while each chunk's logits exist: the
    weights of the loss are known there (a mask), so d logits = weights (softmax - onehot) and
    the backward only scales them by the loss's cotangent. The chunked head under remat
    (`chunked_head`) computes a chunk's logits twice, forward and backward: 8 N_head FLOPs per
    token where this takes 6, and one pass of exponentials over the vocabulary instead of two
    (the same values and gradients up to fp32 order: tests). For losses whose per-token weights
    only the backward knows (the RL ratios) it does not apply."""
    return _fused_head(x_bte, w_ve, targets_bt, weights_bt, chunk, grads=False)[0]


def _fused_head(x_bte, w_ve, targets_bt, weights_bt, chunk: int, grads: bool):
    """(loss, dx, dW) over the chunks; without `grads` (a forward alone: evaluation) only the
    loss, so no gradient work is left for XLA to prune."""
    b, t, e = x_bte.shape
    chunk = min(chunk, t)
    pad = -t % chunk
    n = (t + pad) // chunk
    w = w_ve.astype(x_bte.dtype)

    def slices(a):  # [B, T, ...] -> [N, B*C, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1).reshape(n, b * chunk, *a.shape[2:])

    def one(dw, xs):
        x, tgt, wt = xs  # [B*C, E], [B*C], [B*C]
        logits = jnp.dot(x, w.T).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, -1)
        loss = (wt * (lse - jnp.take_along_axis(logits, tgt[:, None], -1)[:, 0])).sum()
        if not grads:
            return dw, (loss, None)
        p = jnp.exp(logits - lse[:, None])
        d = (wt[:, None] * (p - jax.nn.one_hot(tgt, p.shape[-1], dtype=p.dtype))).astype(x.dtype)
        dw = dw + jnp.dot(d.T, x, preferred_element_type=jnp.float32)
        return dw, (loss, jnp.dot(d, w))

    dw0 = jnp.zeros(w_ve.shape, jnp.float32) if grads else None
    dw, (loss, dx) = jax.lax.scan(one, dw0, (slices(x_bte), slices(targets_bt), slices(weights_bt)))
    if not grads:
        return loss.sum(), None, None
    dx = dx.reshape(n, b, chunk, e).swapaxes(0, 1).reshape(b, n * chunk, e)[:, :t]
    return loss.sum(), dx, dw.astype(w_ve.dtype)


def _fused_head_fwd(x_bte, w_ve, targets_bt, weights_bt, chunk: int):
    loss, dx, dw = _fused_head(x_bte, w_ve, targets_bt, weights_bt, chunk, grads=True)
    return loss, (dx, dw)


def _fused_head_bwd(chunk, res, g):
    dx, dw = res
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None


fused_head_nll.defvjp(_fused_head_fwd, _fused_head_bwd)


def chunked_token_logprobs(x_bte: jax.Array, targets_bt: jax.Array, lm_head, chunk: int) -> jax.Array:
    """`token_logprobs(lm_head(x_bte), targets_bt)`, the head in chunks (`chunked_head`)."""
    return chunked_head(x_bte, lm_head, chunk, token_logprobs, targets_bt)


def next_token_loss(model: nnx.Module, batch: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Cross-entropy of `targets` under `loss_mask`; returns (sum, token count, aux). The LM
    head runs chunk by chunk inside the model's call (`chunked_token_logprobs`)."""
    from posttrain.models.qwen3_moe import add_router_loss

    b, t = batch["tokens"].shape
    chunk = head_chunk(model.cfg, b, t)
    mask = batch["loss_mask"].astype(jnp.float32)
    if model.cfg.fused_head_loss:
        nll, router = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                            with_router_losses=True, head=lambda x, _: fused_head_nll(
                                x, model.head_weight(), batch["targets"], mask, chunk))
        return add_router_loss(model.cfg, nll, mask.sum(), router, {})
    logp, router = model(batch["tokens"], batch["positions"], batch["segment_ids"],
                         with_router_losses=True, head=lambda x, lm_head: chunked_token_logprobs(
                             x, batch["targets"], lm_head, chunk))
    return add_router_loss(model.cfg, -(logp * mask).sum(), mask.sum(), router, {})


def _reseed_dropout(model: nnx.Module, rng: jax.Array) -> None:
    """Fresh dropout randomness every (micro-)step from the state's RNG (LoRA dropout)."""
    if any(isinstance(v, nnx.RngState) for _, v in nnx.to_flat_state(nnx.state(model, nnx.RngState))):
        nnx.reseed(model, dropout=jax.random.wrap_key_data(rng) if rng.dtype == jnp.uint32 else rng)


def _split_micro(batch: dict, n: int) -> dict:
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), batch)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    loss_fn: LossFn, grad_accum: int = 1,
                    schedule: optax.Schedule | None = None) -> Callable:
    """Build the (un-jitted) pure step; callers jit it with shardings and donation."""

    def loss_sum(params, frozen, micro, rng):
        model = nnx.merge(graphdef, params, frozen)
        _reseed_dropout(model, rng)
        s, n, aux = loss_fn(model, micro)
        return s, (n, aux)

    grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

    def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        if grad_accum == 1:
            (s, (n, aux)), g = grad_fn(state.params, state.frozen, batch, state.rng)
        else:
            micro = _split_micro(batch, grad_accum)

            def body(carry, xs):
                s_acc, n_acc, g_acc = carry
                mb, i = xs
                rng = jax.random.fold_in(state.rng, i)
                (s, (n, aux)), g = grad_fn(state.params, state.frozen, mb, rng)
                return (s_acc + s, n_acc + n, jax.tree.map(jnp.add, g_acc, g)), aux

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (s, n, g), aux = jax.lax.scan(body, (0.0, 0.0, zeros), (micro, jnp.arange(grad_accum)))
            aux = {k: a.reshape(-1, *a.shape[2:]) if k.startswith("rows/") else a.mean(0)
                   for k, a in aux.items()}
        denom = jnp.maximum(n, 1.0)
        grads = jax.tree.map(lambda x: x / denom, g)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": s / denom, "tokens": n, "grad_norm": optax.global_norm(grads), **aux}
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        new = TrainState(params, state.frozen, opt_state, state.step + 1,
                         jax.random.fold_in(state.rng, state.step))
        return new, metrics

    return step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn) -> Callable:
    def eval_step(params, frozen, batch):
        s, n, _ = loss_fn(nnx.merge(graphdef, params, frozen), batch)
        return s, n

    return eval_step
