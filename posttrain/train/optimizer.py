"""optax optimizer and learning-rate schedule from the recipe's `optimizer` section."""

from __future__ import annotations

import jax
import optax

from posttrain.config import OptimizerSection


def lr_schedule(opt: OptimizerSection, total_steps: int) -> optax.Schedule:
    peak, end = opt.learning_rate, opt.learning_rate * opt.min_lr_ratio
    warmup = min(opt.warmup_steps, max(total_steps - 1, 0))
    if opt.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0 if warmup else peak, peak, warmup,
                                                  max(total_steps, warmup + 1), end)
    decay = (optax.linear_schedule(peak, end, max(total_steps - warmup, 1))
             if opt.schedule == "linear" else optax.constant_schedule(peak))
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def _decay_mask(params):
    """Decay matrices and embeddings, not norm scales. Decided by name, not rank: with scanned
    layers a norm scale is stacked to [layers, dim] and would look like a matrix."""

    def decays(path, p) -> bool:
        return p.ndim >= 2 and "norm" not in jax.tree_util.keystr(path)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(opt: OptimizerSection, total_steps: int) -> optax.GradientTransformation:
    schedule = lr_schedule(opt, total_steps)
    parts = []
    if opt.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(opt.grad_clip))
    parts.append(optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                             weight_decay=opt.weight_decay, mask=_decay_mask))
    return optax.chain(*parts)
