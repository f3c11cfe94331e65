"""optax optimizer and learning-rate schedule from the recipe's `optimizer` section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
    adam = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                       weight_decay=opt.weight_decay, mask=_decay_mask)
    parts.append(adam if opt.moments_dtype == "float32" else
                 state_in_dtype(adam, jnp.dtype(opt.moments_dtype)))
    return optax.chain(*parts)


def state_in_dtype(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state (Adam's moments) stored in `dtype` between steps.
    Each update computes in what its inputs promote to (f32, from the step's f32 gradients) and
    casts the new state back, so the state's dtypes never change (a change would recompile the
    step and break its donation)."""

    def cast(tree):
        return jax.tree.map(lambda x: x.astype(dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(inner.init(params))

    def update(updates, state, params=None):
        updates, state = inner.update(updates, state, params)
        return updates, cast(state)

    return optax.GradientTransformation(init, update)


def opt_state_shardings(opt_abstract, params):
    """Each optimizer-state leaf laid out like the parameter it mirrors (Adam's mu and nu are
    trees of the parameters' paths and shapes), anything else replicated. Left to itself,
    `jit(optimizer.init)` puts the zeros it creates on one device: FSDP would then hold the full
    moments on device 0."""
    from jax.sharding import NamedSharding, PartitionSpec

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = {tuple(p): (x.sharding, tuple(x.shape)) for p, x in leaves}
    first = leaves[0][1].sharding
    default = NamedSharding(first.mesh, PartitionSpec()) if isinstance(first, NamedSharding) \
        else first

    def one(path, leaf):
        path = tuple(path)
        for n in range(len(path)):
            hit = by_path.get(path[n:])
            if hit is not None and hit[1] == tuple(leaf.shape):
                return hit[0]
        return default

    return jax.tree_util.tree_map_with_path(one, opt_abstract)


def init_opt_state(optimizer: optax.GradientTransformation, params):
    """optimizer.init(params), sharded like the parameters (see opt_state_shardings), its
    moments in f32 whatever the parameters' dtype: bf16 parameters train with f32 Adam moments
    unless the optimizer stores them in another (`optimizer.moments_dtype`, `state_in_dtype`).
    (The step's gradients are f32, divided by the f32 token count, so moments made in bf16
    without `state_in_dtype` would turn f32 after the first update: a second compile and,
    donated, a mismatch.)"""
    init = f32_moments_init(optimizer)
    abstract = jax.eval_shape(init, params)
    return jax.jit(init, out_shardings=opt_state_shardings(abstract, params))(params)


def f32_moments_init(optimizer: optax.GradientTransformation):
    """`optimizer.init` over the parameters cast to f32: the state `init_opt_state` makes (and
    `posttrain plan` compiles against)."""
    def init(p):
        return optimizer.init(jax.tree.map(lambda x: x.astype(jnp.float32)
                                           if jnp.issubdtype(x.dtype, jnp.floating) else x, p))

    return init
