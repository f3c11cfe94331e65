"""GRPO and its variants (GSPO, DAPO, Dr.GRPO, RLOO) as small pure functions.

Notation: a batch holds B = P x G completions (G per prompt, grouped contiguously); per token
t of completion i, logp = log pi_theta(y_it | x_i, y_i<t) under the policy being trained, logp_old
the same under the policy that generated the batch (the trainer's recomputation), logp_rollout
what the rollout engine reported, m_it the completion mask.

Advantages (per completion, from rewards r_i of its group g):
  GRPO     A_i = (r_i - mean_g r) / (std_g r + eps)
  Dr.GRPO  A_i = r_i - mean_g r                           (no std: no difficulty bias)
  RLOO     A_i = r_i - mean_{j != i in g} r_j = G/(G-1) (r_i - mean_g r)

Policy losses (per token, to be minimised), ratio rho_it = exp(logp - logp_old):
  token clip (PPO/GRPO; DAPO clip-higher with eps_low != eps_high):
      l_it = max(-A_i rho_it, -A_i clip(rho_it, 1 - eps_low, 1 + eps_high))
      dual clip (A_i < 0): l_it = min(l_it, -A_i c)
  GSPO (sequence ratio): s_i = exp(sum_t m_it (logp - logp_old) / sum_t m_it)
      l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)), every token of i carries l_i
  GSPO-token: s_it = sg[s_i] * exp(logp - sg[logp]) (value s_i, gradient of each token), same clip

Aggregation returns (sum, count) so that the step divides once by the global count and gradient
accumulation over micro-batches equals the full batch:
  token-mean                sum_it m l / sum_it m
  seq-mean-token-mean       sum_i (sum_t m l / sum_t m) / B
  seq-mean-token-sum        sum_i sum_t m l / B
  seq-mean-token-sum-norm   sum_i sum_t m l / (B * L)          (Dr.GRPO, L a constant)

KL to the reference policy (d = logp_ref - logp), added as beta * KL per token:
  k1 = -d     k2 = d^2 / 2     k3 = exp(d) - d - 1   (Schulman's estimators; k3 unbiased, >= 0)

Log-prob semantics under top-k / top-p (`grpo.logprob_semantics`). The engine samples y_t from
the truncated policy pi^S(y) = pi(y) / pi(S_t) for y in S_t, the kept set that top-k and top-p
leave at position t (pi with temperature applied). Two consistent choices:
  sampled (default)  every log-prob is log pi^S: logp = z_y - logsumexp_{S_t} z (z = logits / T),
      in the trainer, the engine, the ratio, TIS and the mismatch metrics. On-policy this is
      exactly REINFORCE on the truncated policy that generated the batch; the gradient reaches
      the kept tokens only. S_t is not recomputed from the trainer's logits (a token at the cut
      could fall on the other side): the engine reports |S_t| (the kept count K) per token and
      the trainer keeps its own K largest logits, the sampled token always among them
      (`kept_set_logprobs`).
  full  every log-prob is log pi under the whole softmax (engines report it too); the gradient
      is that of the untruncated policy, estimated from samples of the truncated one: a biased
      estimator whose bias grows as the kept mass falls. `sampling/kept_mass` (the mean pi(S_t)
      under the trainer's policy) says how far the two are apart.
With top_p = 1 and top_k = 0 both coincide (S_t is the whole vocabulary).

Rollout/trainer mismatch: the engine samples from pi_rollout, which differs slightly from
pi_old computed by the trainer (kernels, precision). Truncated importance sampling weights the
loss by w = min(pi_old / pi_rollout, C), per token or per sequence (product over tokens).

    posttrain run recipes/grpo_tiny.yaml
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.train.step import token_logprobs

# ---- advantages (host side, numpy: rewards arrive from the reward pool) ----------------------


def grpo_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    r = rewards.reshape(-1, group_size)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1)


def drgrpo_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = rewards.reshape(-1, group_size)
    return (r - r.mean(1, keepdims=True)).reshape(-1)


def rloo_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = rewards.reshape(-1, group_size)
    others = (r.sum(1, keepdims=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


ADVANTAGES = {"grpo": grpo_advantages, "drgrpo": drgrpo_advantages, "rloo": rloo_advantages}

# ---- where the sequences lie ---------------------------------------------------------------


class Seqs:
    """The layout of a batch's sequences: one per row (`seg` None; the sums below are over a
    row), or packed several to a row (`posttrain.rollouts.build_batch` with `row_unit`), numbered
    1, 2, ... within each row by `seg` [R, T] (0: padding). Per-sequence values have shape [R]
    in the first layout and [R, T + 1] (one slot per segment id, slot 0 the padding) in the
    second; every loss below is written once over these four operations."""

    def __init__(self, rows: int, seg=None):
        self.rows, self.seg = rows, seg

    @classmethod
    def of(cls, batch: dict) -> "Seqs":
        """Packed when the batch's advantages are per token (a packed batch carries them so)."""
        packed = batch["advantages"].ndim == 2
        return cls(batch["tokens"].shape[0], batch["segment_ids"] if packed else None)

    def sum(self, x):
        """[R, T] -> the per-sequence sums of x."""
        if self.seg is None:
            return x.sum(-1)
        n = x.shape[1] + 1
        return jax.vmap(lambda xr, sr: jax.ops.segment_sum(xr, sr, num_segments=n))(x, self.seg)

    def tokens(self, v, shape):
        """Per-sequence values -> every token of each sequence ([R, T])."""
        if self.seg is None:
            return jnp.broadcast_to(v[:, None], shape)
        return jnp.take_along_axis(v, self.seg, axis=1)

    def real(self):
        """1 on the slots that hold a sequence (not padding, not past a row's last one)."""
        if self.seg is None:
            return jnp.ones((self.rows,), jnp.float32)
        slot = jnp.arange(self.seg.shape[1] + 1)
        return ((slot >= 1) & (slot <= self.seg.max(-1, keepdims=True))).astype(jnp.float32)

    def count(self):
        """How many sequences the batch holds."""
        return jnp.float32(self.rows) if self.seg is None else self.real().sum()

    def mean(self, v):
        """The mean over sequences of per-sequence values."""
        return (v * self.real()).sum() / jnp.maximum(self.count(), 1)


def _per_token(adv, shape):
    return jnp.broadcast_to(adv[:, None], shape) if adv.ndim == 1 else adv


# ---- policy losses (per token [B, T]) --------------------------------------------------------


def token_clip_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None, seqs=None):
    ratio = jnp.exp(logp - logp_old)
    a = _per_token(adv, logp.shape)
    unclipped = -a * ratio
    clipped = -a * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -a * dual_clip), loss)
    clipped_frac = ((clipped > unclipped) & (mask > 0)).sum() / jnp.maximum(mask.sum(), 1)
    return loss, {"clip_fraction": clipped_frac}


def _seq_mean(x, mask, seqs):
    return seqs.sum(x * mask) / jnp.maximum(seqs.sum(mask), 1)


def _seqs(seqs, x):
    return seqs if seqs is not None else Seqs(x.shape[0])


def gspo_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None, seqs=None):
    seqs = _seqs(seqs, logp)
    s = seqs.tokens(jnp.exp(_seq_mean(logp - logp_old, mask, seqs)), logp.shape)
    a = _per_token(adv, logp.shape)  # every token of sequence i carries s_i and A_i
    unclipped = -a * s
    clipped = -a * jnp.clip(s, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    frac = seqs.mean(seqs.sum((clipped > unclipped).astype(jnp.float32)) > 0)
    return loss, {"clip_fraction": frac}


def gspo_token_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None, seqs=None):
    seqs = _seqs(seqs, logp)
    s = jax.lax.stop_gradient(jnp.exp(_seq_mean(logp - logp_old, mask, seqs)))
    s_t = seqs.tokens(s, logp.shape) * jnp.exp(logp - jax.lax.stop_gradient(logp))
    a = _per_token(adv, logp.shape)
    unclipped = -a * s_t
    clipped = -a * jnp.clip(s_t, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    frac = seqs.mean(seqs.sum((clipped > unclipped).astype(jnp.float32)) > 0)
    return loss, {"clip_fraction": frac}


POLICY_LOSSES = {"token_clip": token_clip_loss, "gspo": gspo_loss, "gspo_token": gspo_token_loss}

# ---- aggregation: (sum, count) -----------------------------------------------------------------


def token_mean(loss, mask, max_len=None, seqs=None):
    return (loss * mask).sum(), mask.sum()


def seq_mean_token_mean(loss, mask, max_len=None, seqs=None):
    seqs = _seqs(seqs, loss)
    return (_seq_mean(loss, mask, seqs) * seqs.real()).sum(), seqs.count()


def seq_mean_token_sum(loss, mask, max_len=None, seqs=None):
    return (loss * mask).sum(), _seqs(seqs, loss).count()


def seq_mean_token_sum_norm(loss, mask, max_len=None, seqs=None):
    return (loss * mask).sum() / max_len, _seqs(seqs, loss).count()


AGGREGATIONS = {"token_mean": token_mean, "seq_mean_token_mean": seq_mean_token_mean,
                "seq_mean_token_sum": seq_mean_token_sum,
                "seq_mean_token_sum_norm": seq_mean_token_sum_norm}

# ---- KL estimators ----------------------------------------------------------------------------


def kl_k1(logp, logp_ref):
    return logp - logp_ref


def kl_k2(logp, logp_ref):
    return 0.5 * (logp - logp_ref) ** 2


def kl_k3(logp, logp_ref):
    d = logp_ref - logp
    return jnp.exp(d) - d - 1


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

# ---- log-prob semantics under top-k / top-p ---------------------------------------------------


def kth_largest(x, k):
    """The k-th largest value along the last axis of `x` (`k` per leading position, 1-based,
    1 <= k <= n), without a sort (`largest_value_where`): exactly an element of x, the one a
    descending sort puts at k - 1. A `lax.top_k` over a 152k vocabulary (top-p keeps an
    unbounded set) sorts every position; this is 32 linear passes."""
    k = k[..., None].astype(jnp.int32)
    return largest_value_where(x, lambda ge: ge.sum(-1, keepdims=True, dtype=jnp.int32) >= k)


def largest_value_where(x, enough):
    """The largest t along the last axis of `x` (per leading position) for which
    `enough(x >= t)` holds, `enough` mapping a [..., n] mask to [..., 1] booleans and monotone
    (true for every t below some value, false above); it must hold for the all-true mask. A
    bisection over the floats' bit patterns, mapped to unsigned integers in the floats' order,
    that fixes one bit of the answer per pass (32 passes of a compare and `enough`); the answer
    is an element of x, as `enough`'s value only changes at x's values."""
    i = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    key = jnp.where(i >> 31 == 1, ~i, i | jnp.uint32(1 << 31))  # monotone in the float's value

    def bit(j, ans):
        cand = ans | (jnp.uint32(1) << (31 - j).astype(jnp.uint32))
        return jnp.where(enough(key >= cand), cand, ans)

    ans = jax.lax.fori_loop(0, 32, bit, jnp.zeros(x.shape[:-1] + (1,), jnp.uint32))
    back = jnp.where(ans >> 31 == 1, ans & jnp.uint32(0x7FFFFFFF), ~ans)
    return jax.lax.bitcast_convert_type(back, jnp.float32)


def kept_set_logprobs(logits_btv, targets_bt, kept_bt, kmax: int):
    """log pi^S(target) over the kept set S of `kept_bt` tokens at each position, and
    log pi(S), the kept set's mass under the full softmax. `logits_btv` is temperature-scaled.

    S is the K largest logits (K = kept_bt; K <= 0 or K >= V: the whole vocabulary) with the
    target forced in: if the trainer ranks the sampled token just outside its top K (its logit
    is within noise of the engine's cut), S is the top K-1 plus the target, the engine's set.
    Tokens tied at the cut share its remaining places (weight (K - above) / tied each): the
    normaliser is the same whichever of them an engine kept, as each weighs the same. `kmax` is
    a static bound on K (V when top-p is on, top_k otherwise; ties past it keep the bound's
    value as the cut). The cut is found without sorting the vocabulary (`kth_largest`). The
    kept set is chosen without gradient; the gradient flows through every kept logit."""
    z = logits_btv.astype(jnp.float32)
    v = z.shape[-1]
    is_target = jnp.arange(v) == targets_bt[..., None]
    z_target = jnp.take_along_axis(z, targets_bt[..., None], axis=-1)[..., 0]
    k = jnp.where((kept_bt <= 0) | (kept_bt >= v), v, kept_bt)
    sel = jax.lax.stop_gradient(jnp.where(is_target, jnp.inf, z))
    cut = kth_largest(sel, jnp.minimum(k, min(kmax, v)))
    above, tied = sel > cut, sel == cut
    n_above, n_tied = above.sum(-1, keepdims=True), tied.sum(-1, keepdims=True)
    share = jnp.clip(k[..., None] - n_above, 0, n_tied) / jnp.maximum(n_tied, 1)
    w = jnp.where(above, 1.0, jnp.where(tied, share, 0.0))
    w = jnp.where(k[..., None] >= v, 1.0, w)  # whole vocabulary (also when kmax < V)
    m = jax.lax.stop_gradient(z.max(-1, keepdims=True))
    e = jnp.exp(z - m)
    lse_kept = jnp.log((w * e).sum(-1)) + m[..., 0]
    lse_full = jnp.log(e.sum(-1)) + m[..., 0]
    return z_target - lse_kept, lse_kept - lse_full


def policy_logprobs(logits_btv, targets_bt, kept_bt, semantics: str, top_k: int, top_p: float):
    """The trainer's log-probs of the sampled tokens under the run's semantics, and the log of
    the kept mass pi(S_t) (None when nothing is truncated). Every trainer pass (the update, the
    old and the reference policy) goes through here, so all compare the same distribution."""
    if top_k <= 0 and top_p >= 1.0:
        return token_logprobs(logits_btv, targets_bt), None
    kmax = logits_btv.shape[-1] if top_p < 1.0 else top_k
    kept, log_mass = kept_set_logprobs(logits_btv, targets_bt, kept_bt, kmax)
    # log pi(y) = log pi^S(y) + log pi(S): the full softmax without a second normaliser
    logp = kept if semantics == "sampled" else kept + log_mass
    return logp, jax.lax.stop_gradient(log_mass)


# ---- rollout/trainer mismatch -------------------------------------------------------------------


def truncated_is_weights(logp_old, logp_rollout, mask, level: str, cap: float, seqs=None):
    """Detached importance weights min(pi_old / pi_rollout, C), per token or per sequence."""
    d = (logp_old - logp_rollout) * mask
    if level == "token":
        w = jnp.minimum(jnp.exp(d), cap)
    elif level == "sequence":
        seqs = _seqs(seqs, d)
        w = seqs.tokens(jnp.minimum(jnp.exp(seqs.sum(d)), cap), d.shape)
    else:
        w = jnp.ones_like(d)
    return jax.lax.stop_gradient(w)


def mismatch_metrics(logp_old: np.ndarray, logp_rollout: np.ndarray, mask: np.ndarray) -> dict:
    """The trainer's pi_old against the engine's log-probs over the completion tokens
    (positions the trainer did not score, NaN, are left out)."""
    m = (mask > 0) & np.isfinite(logp_old)
    if not m.any():
        return {}
    diff = np.abs(logp_old - logp_rollout)[m]
    d = (logp_rollout - logp_old)[m]  # k3 estimate of KL(pi_old || pi_rollout)
    return {"mismatch/mean_abs_logp_diff": float(diff.mean()),
            "mismatch/max_abs_logp_diff": float(diff.max()),
            "mismatch/kl": float(np.mean(np.exp(d) - d - 1))}


# ---- DAPO dynamic sampling -----------------------------------------------------------------------


def informative_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[P] bool: groups whose rewards are not all equal (they carry a learning signal)."""
    return rewards.reshape(-1, group_size).std(1) > 0


# ---- the objective over a model (the trainer jits these) -----------------------------------------
def make_loss_fn(cfg):
    """The policy loss of the recipe (`cfg`: a RunConfig) as a `loss_fn(model, batch)` for
    `train.step.make_train_step`."""
    from posttrain.models.qwen3_moe import add_router_loss

    g = cfg.grpo
    policy, agg, kl = POLICY_LOSSES[g.loss], AGGREGATIONS[g.aggregation], KL_ESTIMATORS[g.kl_estimator]
    clip_low, clip_high = g.clip

    def loss_fn(model, batch):
        """Without `logp_old` in the batch, pi_old is the engine's log-probs (`grpo.logp_old`
        rollout) or, with one update per batch, the current policy itself
        (stop_gradient(pi): the separate log-prob pass folded into this forward); either way
        the trainer's log-probs come back per row (`rows/logp`) for the mismatch metrics."""
        out, router = policy_pass(model, batch, g, entropy=True)
        logp, log_mass = out["logp"], out.get("log_mass")
        if "logp_old" in batch:
            logp_old = batch["logp_old"]
        elif g.logp_old == "rollout":
            logp_old = batch["logp_rollout"]
        else:
            logp_old = jax.lax.stop_gradient(logp)
        mask = batch["loss_mask"]
        seqs = Seqs.of(batch)
        per_tok, aux = policy(logp, logp_old, batch["advantages"], mask, clip_low, clip_high,
                              g.dual_clip, seqs)
        per_tok = per_tok * truncated_is_weights(logp_old, batch["logp_rollout"], mask,
                                                 g.tis.level, g.tis.cap, seqs)
        if "logp_old" not in batch:
            aux["rows/logp"] = jax.lax.stop_gradient(logp)
        n_tok = jnp.maximum(mask.sum(), 1)
        if log_mass is not None:  # how much of the policy top-k / top-p leaves to sample from
            aux["sampling/kept_mass"] = (jnp.exp(log_mass) * mask).sum() / n_tok
        if g.beta > 0:
            k = kl(logp, batch["logp_ref"])
            per_tok = per_tok + g.beta * k
            aux["kl"] = (k * mask).sum() / n_tok
        s, n = agg(per_tok, mask, float(g.max_tokens), seqs)
        aux["entropy"] = jax.lax.stop_gradient((out["entropy"] * mask).sum() / n_tok)
        return add_router_loss(model.cfg, s, n, router, aux)

    return loss_fn


def head_outputs(g, logits_btv, targets_bt, kept_bt, entropy: bool = False) -> dict:
    """Per position, from the LM head's logits (one chunk of them, `train.step.chunked_head`):
    `logp`, the log-prob of the target under `grpo.logprob_semantics` at the run's temperature
    (replaying the kept counts the engine reported; see the module docstring), `log_mass` (the
    log of the kept set's mass; only when top-k / top-p truncate) and, with `entropy`, the
    policy's entropy (no gradient)."""
    z = logits_btv.astype(jnp.float32) / g.temperature
    logp, log_mass = policy_logprobs(z, targets_bt, kept_bt, g.logprob_semantics, g.top_k, g.top_p)
    out = {"logp": logp}
    if log_mass is not None:
        out["log_mass"] = log_mass
    if entropy:
        p = jax.nn.softmax(jax.lax.stop_gradient(z), axis=-1)
        out["entropy"] = jax.nn.logsumexp(jax.lax.stop_gradient(z), axis=-1) - (p * z).sum(-1)
        out["entropy"] = jax.lax.stop_gradient(out["entropy"])
    return out


def policy_pass(model, batch, g, entropy: bool = False):
    """(`head_outputs` [B, T] each, router losses) of the batch's rows under the policy `model`;
    the LM head runs in chunks of positions inside the model's call (`train.step.chunked_head`:
    the [B, T, V] logits never exist). With `shared_prefix` [B, S] in the batch
    (`posttrain.rollouts.build_batch`: the S tokens each group of `group_size` rows shares) the
    prefix runs once per group into a KV cache, which is repeated for the group's rows, and the
    rows run from position S on over it: the same outputs and gradients as the plain pass (each
    row's prefix states are the group's), with G - 1 of every G prefix passes left out (8 x 8
    completions after ~20-token prompts: 15% of the update's tokens). The plain pass when the
    (mini-/micro-)batch does not hold whole groups, or for MoE models (their router losses are
    means over one pass's tokens). With `head_index` [B, W] in the batch (`build_batch`) the
    head runs on those W positions of each row alone; its outputs are 0 elsewhere."""
    from posttrain.train.step import chunked_head, head_chunk

    tokens, pos, seg = batch["tokens"], batch["positions"], batch["segment_ids"]
    b, t = tokens.shape
    window = batch.get("head_index")  # [B, W]: the positions that hold the rows' loss
    fn = partial(head_outputs, g, entropy=entropy)

    def head(x_bte, lm_head):
        per_position = (batch["targets"], batch["kept_counts"])
        if window is None:
            return chunked_head(x_bte, lm_head, head_chunk(model.cfg, b, t), fn, *per_position)
        w = window.shape[1]
        out = chunked_head(jnp.take_along_axis(x_bte, window[..., None], axis=1), lm_head,
                           head_chunk(model.cfg, b, w), fn,
                           *(jnp.take_along_axis(a, window, axis=1) for a in per_position))
        rows = jnp.arange(b)[:, None]  # outside the window: 0 (no loss there)
        return jax.tree.map(lambda y: jnp.zeros((b, t), y.dtype).at[rows, window].set(y), out)

    shared = batch.get("shared_prefix")
    group_size = g.group_size
    if shared is None or group_size <= 1 or b % group_size or model.cfg.is_moe:
        return model(tokens, pos, seg, with_router_losses=True, head=head)
    from posttrain.models.transformer import KVCache

    n = shared.shape[1]
    prefix = shared[::group_size]  # [B / G, S]: one row per group
    cache = KVCache.init(model.cfg, prefix.shape[0], t)
    # both passes through the model's call: LoRA / int8 apply only there (`CausalLM.__call__`)
    x_pre, cache = model(prefix, pos[::group_size, :n], seg[::group_size, :n], cache,
                         head=lambda x, _: x)
    out, _ = model(tokens[:, n:], pos[:, n:], seg[:, n:], cache.repeat(group_size, model.cfg),
                   head=lambda x_rows, lm_head: head(jnp.concatenate(
                       [jnp.repeat(x_pre, group_size, axis=0), x_rows], axis=1), lm_head))
    return out, {}


def make_logprob_fn(graphdef, g):
    """Jitted (params, frozen, batch) -> per-token log-probs of the policy `params` (the old or
    the reference policy) under the run's semantics; `g` is the run's `grpo` section."""
    def f(params, frozen, batch):
        return policy_pass(nnx.merge(graphdef, params, frozen), batch, g)[0]["logp"]

    return jax.jit(f)
