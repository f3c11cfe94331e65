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

Rollout/trainer mismatch: the engine samples from pi_rollout, which differs slightly from
pi_old computed by the trainer (kernels, precision). Truncated importance sampling weights the
loss by w = min(pi_old / pi_rollout, C), per token or per sequence (product over tokens).

    posttrain run recipes/grpo_tiny.yaml
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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

# ---- policy losses (per token [B, T]) --------------------------------------------------------


def token_clip_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None):
    ratio = jnp.exp(logp - logp_old)
    a = adv[:, None]
    unclipped = -a * ratio
    clipped = -a * jnp.clip(ratio, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(a < 0, jnp.minimum(loss, -a * dual_clip), loss)
    clipped_frac = ((clipped > unclipped) & (mask > 0)).sum() / jnp.maximum(mask.sum(), 1)
    return loss, {"clip_fraction": clipped_frac}


def _seq_mean(x, mask):
    return (x * mask).sum(-1) / jnp.maximum(mask.sum(-1), 1)


def gspo_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None):
    s = jnp.exp(_seq_mean(logp - logp_old, mask))  # [B]
    unclipped = -adv * s
    clipped = -adv * jnp.clip(s, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    frac = (clipped > unclipped).mean()
    return jnp.broadcast_to(loss[:, None], logp.shape), {"clip_fraction": frac}


def gspo_token_loss(logp, logp_old, adv, mask, clip_low, clip_high, dual_clip=None):
    s = jax.lax.stop_gradient(jnp.exp(_seq_mean(logp - logp_old, mask)))
    s_t = s[:, None] * jnp.exp(logp - jax.lax.stop_gradient(logp))
    a = adv[:, None]
    unclipped = -a * s_t
    clipped = -a * jnp.clip(s_t, 1 - clip_low, 1 + clip_high)
    loss = jnp.maximum(unclipped, clipped)
    frac = ((clipped > unclipped).any(-1)).mean()
    return loss, {"clip_fraction": frac}


POLICY_LOSSES = {"token_clip": token_clip_loss, "gspo": gspo_loss, "gspo_token": gspo_token_loss}

# ---- aggregation: (sum, count) -----------------------------------------------------------------


def token_mean(loss, mask, max_len=None):
    return (loss * mask).sum(), mask.sum()


def seq_mean_token_mean(loss, mask, max_len=None):
    return _seq_mean(loss, mask).sum(), jnp.float32(loss.shape[0])


def seq_mean_token_sum(loss, mask, max_len=None):
    return (loss * mask).sum(), jnp.float32(loss.shape[0])


def seq_mean_token_sum_norm(loss, mask, max_len=None):
    return (loss * mask).sum() / max_len, jnp.float32(loss.shape[0])


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

# ---- rollout/trainer mismatch -------------------------------------------------------------------


def truncated_is_weights(logp_old, logp_rollout, mask, level: str, cap: float):
    """Detached importance weights min(pi_old / pi_rollout, C), per token or per sequence."""
    d = (logp_old - logp_rollout) * mask
    if level == "token":
        w = jnp.minimum(jnp.exp(d), cap)
    elif level == "sequence":
        w = jnp.broadcast_to(jnp.minimum(jnp.exp(d.sum(-1)), cap)[:, None], d.shape)
    else:
        w = jnp.ones_like(d)
    return jax.lax.stop_gradient(w)


def mismatch_metrics(logp_old: np.ndarray, logp_rollout: np.ndarray, mask: np.ndarray) -> dict:
    m = mask > 0
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
