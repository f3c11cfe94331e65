"""Preference optimisation from (prompt, chosen, rejected) pairs: DPO and its variants.

For a pair, let s_c and s_r be the policy's summed log-probs of the chosen and the rejected
completion (completion tokens only, given the prompt), n_c and n_r their token counts, and
s_c^ref, s_r^ref the same under the frozen reference policy. The log-ratios are
l_c = s_c - s_c^ref, l_r = s_r - s_r^ref and d = l_c - l_r. Per pair, with beta and label
smoothing eps (`dpo.beta`, `dpo.label_smoothing`):

    sigmoid (DPO)   -(1 - eps) log sig(beta d) - eps log sig(-beta d)    (eps > 0: cDPO)
    hinge (SLiC)    max(0, 1 - beta d)
    ipo             (l_c / n_c - l_r / n_r - 1 / (2 beta))^2   (per-token, as TRL and the IPO
                    authors normalise it)
    robust          ((1 - eps)(-log sig(beta d)) + eps log sig(-beta d)) / (1 - 2 eps)
                    (unbiased under a label-flip rate eps)
    simpo           -(1 - eps) log sig(beta m) - eps log sig(-beta m),
                    m = s_c / n_c - s_r / n_r - gamma / beta   (no reference; `dpo.simpo_gamma`)
    orpo            NLL of the chosen tokens (token mean over the batch)
                    - beta log sig(log odds(p_c) - log odds(p_r)), p = exp(s / n),
                    log odds(p) = log p - log(1 - p)   (no reference; beta is ORPO's lambda)

The loss is the mean over the batch's pairs (ORPO adds its token-mean NLL), the same numbers as
TRL's `DPOTrainer` (sigmoid, hinge, ipo, robust), `CPOTrainer` (simpo) and `ORPOTrainer` on the
same log-probs (tests). The rewards TRL logs: beta l_c and beta l_r (the reference-free losses:
beta s/n), their margin and how often the chosen one is higher (`rewards/accuracies`).

The log-probs come from one pass over packed rows: a pair is two segments of one row (chosen
then rejected, each prompt + completion, never split across rows), so segment 2k+1 of a row is a
chosen completion and 2k+2 its rejected one; per-segment sums of the chunked head's token
log-probs give s (the [tokens, vocab] logits never exist whole).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.train.step import chunked_head, head_chunk, token_logprobs

LOSSES = ("sigmoid", "hinge", "ipo", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


def pair_sums(values_bt: jax.Array, segment_ids_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-pair sums of a per-position value: ([B, K] over chosen segments 2k+1, [B, K] over
    rejected segments 2k+2), K = T // 2 (a row holds at most that many pairs)."""
    b, t = segment_ids_bt.shape
    s = t + 2  # segment ids 0..t, padded to an even count
    flat = (jnp.arange(b)[:, None] * s + segment_ids_bt).reshape(-1)
    sums = jax.ops.segment_sum(values_bt.reshape(-1), flat, num_segments=b * s).reshape(b, s)
    k = t // 2
    return sums[:, 1:2 * k + 1:2], sums[:, 2:2 * k + 2:2]


def _head_stats(logits_bcv, targets_bc):
    """Token log-prob and the mean logit (TRL's `logits/chosen`) of every position."""
    return token_logprobs(logits_bcv, targets_bc), logits_bcv.astype(jnp.float32).mean(-1)


def pair_logps(model: nnx.Module, batch: dict) -> dict[str, jax.Array]:
    """The policy's per-pair log-prob sums and token counts ([B, K] each), and mean logits."""
    b, t = batch["tokens"].shape
    chunk = head_chunk(model.cfg, b, t)
    (logp, mean_logit), router = model(
        batch["tokens"], batch["positions"], batch["segment_ids"], with_router_losses=True,
        head=lambda x, lm_head: chunked_head(x, lm_head, chunk, _head_stats, batch["targets"]))
    mask = batch["loss_mask"].astype(jnp.float32)
    seg = batch["segment_ids"]
    s_c, s_r = pair_sums(logp * mask, seg)
    n_c, n_r = pair_sums(mask, seg)
    z_c, z_r = pair_sums(mean_logit * mask, seg)
    return {"chosen": s_c, "rejected": s_r, "n_chosen": n_c, "n_rejected": n_r,
            "logit_chosen": z_c, "logit_rejected": z_r, "router": router}


def reference_logps(model: nnx.Module, batch: dict) -> dict[str, jax.Array]:
    """What the reference contributes to a batch: its chosen and rejected sums, [B, K] each."""
    out = pair_logps(model, batch)
    return {"ref_chosen": out["chosen"], "ref_rejected": out["rejected"]}


def make_reference_fn(graphdef: nnx.GraphDef):
    """(params, frozen, batch) -> `reference_logps`, without gradients; jit it."""

    def fn(params, frozen, batch):
        out = reference_logps(nnx.merge(graphdef, params, frozen), batch)
        return jax.lax.stop_gradient(out)

    return fn


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's split, as TRL's)."""
    return jnp.where(x > -np.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def smoothed_sigmoid(z: jax.Array, eps: float) -> jax.Array:
    return -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def preference_losses(loss: str, s_c, s_r, n_c, n_r, ref_c=None, ref_r=None, *, beta: float,
                      label_smoothing: float = 0.0, simpo_gamma: float = 0.5) -> dict:
    """Per-pair loss, the rewards TRL logs and (ORPO) its log odds, from per-pair sums and
    counts (any shape; see the module docstring). ORPO's NLL term is the caller's (it is a
    token mean, not a per-pair value)."""
    eps = label_smoothing
    if loss in REFERENCE_FREE:
        a_c, a_r = s_c / jnp.maximum(n_c, 1.0), s_r / jnp.maximum(n_r, 1.0)
        r_c, r_r = beta * a_c, beta * a_r
        if loss == "simpo":
            per = smoothed_sigmoid(beta * (a_c - a_r - simpo_gamma / beta), eps)
            return {"loss": per, "reward_chosen": r_c, "reward_rejected": r_r}
        log_odds = (a_c - a_r) - (log1mexp(a_c) - log1mexp(a_r))
        ratio = jax.nn.log_sigmoid(log_odds)
        return {"loss": -beta * ratio, "reward_chosen": r_c, "reward_rejected": r_r,
                "log_odds": log_odds, "log_odds_ratio": ratio}
    l_c, l_r = s_c - ref_c, s_r - ref_r
    d = l_c - l_r
    if loss == "sigmoid":
        per = smoothed_sigmoid(beta * d, eps)
    elif loss == "hinge":
        per = jax.nn.relu(1.0 - beta * d)
    elif loss == "ipo":
        per = (l_c / jnp.maximum(n_c, 1.0) - l_r / jnp.maximum(n_r, 1.0) - 1.0 / (2 * beta)) ** 2
    elif loss == "robust":
        per = (-(1 - eps) * jax.nn.log_sigmoid(beta * d)
               + eps * jax.nn.log_sigmoid(-beta * d)) / (1 - 2 * eps)
    else:
        raise ValueError(f"unknown preference loss {loss!r}: one of {LOSSES}")
    return {"loss": per, "reward_chosen": beta * l_c, "reward_rejected": beta * l_r}


def make_loss_fn(dpo) -> callable:
    """The step's `loss_fn(model, batch) -> (sum, count, aux)` for `dpo` (the recipe's section):
    the sum of per-pair losses over the batch's pairs and their count, so micro-batches
    accumulate to the batch mean; ORPO adds count x its token-mean NLL. The batch carries
    `ref_chosen` / `ref_rejected` ([B, K]) unless the loss is reference-free."""
    from posttrain.models.qwen3_moe import add_router_loss

    def loss_fn(model, batch):
        out = pair_logps(model, batch)
        n_c, n_r = out["n_chosen"], out["n_rejected"]
        valid = ((n_c > 0) & (n_r > 0)).astype(jnp.float32)
        pairs = valid.sum()
        ok = valid > 0  # empty pair slots get harmless values (ORPO's log odds at p = 1 is inf)
        s_c, s_r = jnp.where(ok, out["chosen"], -1.0), jnp.where(ok, out["rejected"], -1.0)
        n_c, n_r = jnp.where(ok, n_c, 1.0), jnp.where(ok, n_r, 1.0)
        ref = ((None, None) if dpo.loss in REFERENCE_FREE
               else (jnp.where(ok, batch["ref_chosen"], 0.0), jnp.where(ok, batch["ref_rejected"], 0.0)))
        per = preference_losses(dpo.loss, s_c, s_r, n_c, n_r, *ref,
                                beta=dpo.beta, label_smoothing=dpo.label_smoothing,
                                simpo_gamma=dpo.simpo_gamma)
        total = (per["loss"] * valid).sum()

        def mean(x):
            return (x * valid).sum() / jnp.maximum(pairs, 1.0)

        r_c, r_r = per["reward_chosen"], per["reward_rejected"]
        aux = {"rewards/chosen": mean(r_c), "rewards/rejected": mean(r_r),
               "rewards/margins": mean(r_c - r_r),
               "rewards/accuracies": mean((r_c > r_r).astype(jnp.float32)),
               "logps/chosen": mean(out["chosen"]), "logps/rejected": mean(out["rejected"]),
               "logits/chosen": out["logit_chosen"].sum() / jnp.maximum(out["n_chosen"].sum(), 1.0),
               "logits/rejected": out["logit_rejected"].sum() / jnp.maximum(out["n_rejected"].sum(), 1.0),
               "pairs": pairs}
        if dpo.loss == "orpo":
            nll = -(out["chosen"] * valid).sum() / jnp.maximum((out["n_chosen"] * valid).sum(), 1.0)
            total = total + pairs * nll
            aux.update({"nll_loss": nll, "log_odds_ratio": mean(per["log_odds_ratio"]),
                        "log_odds_chosen": mean(per["log_odds"])})
        return add_router_loss(model.cfg, total, pairs, out["router"], aux)

    return loss_fn
