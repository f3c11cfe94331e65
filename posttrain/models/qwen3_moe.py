"""Qwen3 MoE: the sparse MLP block that replaces the dense MLP in every `qwen3_moe` layer.

Routing has HF's semantics (`Qwen3MoeTopKRouter`): softmax over the router logits in f32, top-k,
optionally renormalised over the k chosen (`norm_topk_prob`), cast to the activation dtype. Experts
are stacked weights `[X, E, F]` whose leading axis is the logical `expert` axis, so the mesh rules
shard them over the `expert` mesh axis (expert parallelism) with no MoE-specific mesh code.

Two implementations of the same function (`cfg.moe_impl`):
- `ragged`: the k assignments of every token sorted by expert, then three grouped matmuls with
  `jax.lax.ragged_dot` (megablox-style on TPU/GPU): FLOPs proportional to k, not to X.
- `dense`: every expert on every token, weighted by the (mostly zero) routing weights: exact and
  simple, X/k times the FLOPs; for tiny models and as the reference the ragged path is tested against.

Both return per-layer router statistics for the load-balancing loss (Switch/HF form,
X * sum_e f_e p_e) and the router z-loss (ST-MoE, mean logsumexp^2), padding excluded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.models.layers import DTYPES, linear


class Experts(nnx.Module):
    """HF's `mlp.experts.{j}.{gate,up,down}_proj`, stacked: [X, E, F], [X, E, F], [X, F, E]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        x, e, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        pd, init = DTYPES[cfg.param_dtype], nnx.initializers.normal(0.02)
        self.gate_proj = nnx.Param(init(rngs.params(), (x, e, f), pd), logical_axes=("expert", "embed", "mlp"))
        self.up_proj = nnx.Param(init(rngs.params(), (x, e, f), pd), logical_axes=("expert", "embed", "mlp"))
        self.down_proj = nnx.Param(init(rngs.params(), (x, f, e), pd), logical_axes=("expert", "mlp", "embed"))


def route(logits_nx: jax.Array, k: int, norm_topk_prob: bool):
    """(top-k weights [N, k] in f32, expert ids [N, k], softmax probs [N, X] in f32)."""
    probs = jax.nn.softmax(logits_nx.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, ids, probs


def experts_dense(x_ne, weights_nk, ids_nk, g_xef, u_xef, d_xfe, first_expert=0) -> jax.Array:
    """Every expert (of those held here: ids first_expert .. +X) on every token, weighted."""
    x_count = g_xef.shape[0]
    combine = (jax.nn.one_hot(ids_nk - first_expert, x_count, dtype=weights_nk.dtype)
               * weights_nk[..., None]).sum(1)  # ids outside this block one-hot to zeros
    g = jnp.einsum("ne,xef->xnf", x_ne, g_xef)
    u = jnp.einsum("ne,xef->xnf", x_ne, u_xef)
    y = jnp.einsum("xnf,xfe->xne", jax.nn.silu(g) * u, d_xfe)
    return jnp.einsum("xne,nx->ne", y, combine.astype(x_ne.dtype))


def experts_ragged(x_ne, weights_nk, ids_nk, g_xef, u_xef, d_xfe, first_expert=0,
                   num_experts=None) -> jax.Array:
    """Assignments sorted by expert, grouped matmuls over the experts held here (ids
    first_expert .. +X): their rows are moved to the front, every other row comes out zero."""
    k = ids_nk.shape[1]
    x_local = g_xef.shape[0]
    flat = ids_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    token = order // k
    sizes = jnp.bincount(flat, length=num_experts or x_local).astype(jnp.int32)
    start = jnp.cumsum(sizes)[first_expert] - sizes[first_expert] if num_experts else 0
    local = jax.lax.dynamic_slice_in_dim(sizes, first_expert, x_local) if num_experts else sizes
    xs = jnp.roll(x_ne[token], -start, axis=0)
    g = jax.lax.ragged_dot(xs, g_xef, local)
    u = jax.lax.ragged_dot(xs, u_xef, local)
    y = jnp.roll(jax.lax.ragged_dot(jax.nn.silu(g) * u, d_xfe, local), start, axis=0)
    y = y * weights_nk.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x_ne).at[token].add(y)


def experts_parallel(x_ne, weights_nk, ids_nk, g_xef, u_xef, d_xfe, impl: str) -> jax.Array:
    """The experts under the active mesh, as a shard_map: every device routes its own tokens
    (sharded over the batch axes, never gathered), applies the experts it holds (sliced over the
    `expert` axis, their MLP dimension over `tensor`; FSDP-sharded weights are all-gathered
    one layer at a time on the way in, as for dense layers), and the partial outputs are summed
    over the expert and tensor axes. Without a mesh, the same function on one device."""
    from jax.sharding import PartitionSpec as P

    from posttrain.sharding import active_mesh, logical_to_spec

    fn = experts_ragged if impl == "ragged" else experts_dense
    active = active_mesh()
    if active is None or active[0].size == 1:
        return fn(x_ne, weights_nk, ids_nk, g_xef, u_xef, d_xfe)
    mesh, rules = active
    num_experts = g_xef.shape[0]
    tok = logical_to_spec(("batch", None), rules, mesh, x_ne.shape)
    ex = logical_to_spec(("expert",), rules, mesh, (num_experts,))[0]
    mlp = logical_to_spec(("mlp",), rules, mesh, (g_xef.shape[-1],))[0]

    def names(entry):
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    ex_axes, mlp_axes = names(ex), names(mlp)
    if set(ex_axes) & set(names(tok[0])):
        from posttrain.errors import UserError

        raise UserError("mesh.rules: `batch` and `expert` share a mesh axis; MoE layers need the "
                        "tokens replicated over the expert axis")
    w_in, w_out = P(ex, None, mlp), P(ex, mlp, None)

    def local(x, w, ids, g, u, d):
        first = jax.lax.axis_index(ex_axes) * g.shape[0] if ex_axes else 0
        if impl == "ragged":
            out = experts_ragged(x, w, ids, g, u, d, first, num_experts)
        else:
            out = experts_dense(x, w, ids, g, u, d, first)
        reduce = ex_axes + mlp_axes
        return jax.lax.psum(out, reduce) if reduce else out

    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, w_in, w_in, w_out),
                         out_specs=tok)(x_ne, weights_nk, ids_nk, g_xef, u_xef, d_xfe)


class SparseMoeBlock(nnx.Module):
    """HF's `Qwen3MoeSparseMoeBlock`: `mlp.gate` (the router) and `mlp.experts`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate = linear(cfg, cfg.hidden_size, cfg.num_experts, ("embed", None), rngs)
        self.experts = Experts(cfg, rngs)
        self.cfg = cfg

    def __call__(self, x_bte: jax.Array, valid_bt: jax.Array):
        cfg = self.cfg
        b, t, e = x_bte.shape
        x = x_bte.reshape(b * t, e)
        logits = self.gate(x)
        weights, ids, probs = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        w = self.experts
        y = experts_parallel(x, weights.astype(x.dtype), ids, w.gate_proj[...].astype(x.dtype),
                             w.up_proj[...].astype(x.dtype), w.down_proj[...].astype(x.dtype),
                             cfg.moe_impl)
        return y.reshape(b, t, e), router_stats(logits, probs, ids, valid_bt.reshape(-1), cfg.num_experts)


def router_stats(logits_nx, probs_nx, ids_nk, valid_n, x_count: int) -> dict:
    """Per-layer f (fraction of assignments per expert, summed over the k slots, as HF), p (mean
    router probability per expert) and z (mean logsumexp^2), over non-padding tokens."""
    m = valid_n.astype(jnp.float32)
    denom = jnp.maximum(m.sum(), 1.0)
    f = (jax.nn.one_hot(ids_nk, x_count, dtype=jnp.float32).sum(1) * m[:, None]).sum(0) / denom
    p = (probs_nx * m[:, None]).sum(0) / denom
    z = ((jax.nn.logsumexp(logits_nx.astype(jnp.float32), axis=-1) ** 2) * m).sum() / denom
    return {"f": f, "p": p, "z": z}


def router_losses(cfg: ModelConfig, stats: dict) -> dict:
    """Layer-stacked stats ([L, X], [L, X], [L]) -> the load-balancing and z losses. Every layer
    routes the same tokens, so averaging per-layer means equals HF's statistics over all layers'
    router logits concatenated."""
    if not stats:
        return {}
    f, p = stats["f"].mean(0), stats["p"].mean(0)
    return {"router_load_balance": cfg.num_experts * jnp.sum(f * p),
            "router_z_loss": stats["z"].mean()}


def router_loss(cfg: ModelConfig, losses: dict) -> jax.Array:
    if not losses:
        return jnp.float32(0.0)
    return (cfg.router_aux_loss_coef * losses["router_load_balance"]
            + cfg.router_z_loss_coef * losses["router_z_loss"])


def add_router_loss(cfg: ModelConfig, loss_sum: jax.Array, count: jax.Array, losses: dict,
                    aux: dict) -> tuple[jax.Array, jax.Array, dict]:
    """Fold the router losses into a (sum, count) loss: sum + coef * loss * count, so that the
    mean the step takes is mean + coef * loss; the losses also go to the metrics."""
    if not losses:
        return loss_sum, count, aux
    return (loss_sum + router_loss(cfg, losses) * count, count,
            {**aux, **{k: jax.lax.stop_gradient(v) for k, v in losses.items()}})
