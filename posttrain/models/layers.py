"""Shared transformer layers for every architecture in the zoo (Qwen3, Qwen3 MoE, Llama 3).

Parameters are `nnx.Param`s whose metadata `logical_axes` names each dimension (`embed`, `mlp`,
`heads`, ...); `posttrain.sharding` maps those names to mesh axes with the recipe's rules table, so
no mesh appears in model code. Module and parameter names mirror the HF checkpoint names
(`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) so converters are name maps plus a
transpose. Matmuls go through `nnx.Linear`/`nnx.Embed`, which qwix knows how to LoRA-fy and quantize.

Shapes: B batch, T query length, S key length, H query heads, K kv heads, G = H/K, D head dim,
E hidden size, F MLP size, V vocab.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from posttrain.models.config import ModelConfig
from posttrain.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# A large finite negative rather than -inf keeps fully-masked rows (padding queries) NaN-free.
ACT_AXES = ("batch", "activation_length", "activation_embed")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _init(axes: tuple[str, ...], std: float = 0.02):
    return nnx.with_metadata(nnx.initializers.normal(std), logical_axes=axes)


def linear(cfg: ModelConfig, din: int, dout: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, kernel_init=_init(axes),
                      param_dtype=DTYPES[cfg.param_dtype], dtype=DTYPES[cfg.compute_dtype],
                      rngs=rngs)


def dense(layer: nnx.Linear, x: jax.Array) -> jax.Array:
    """Apply a Linear to [..., in] as one 2-D matmul: XLA:CPU runs [B*T, in] @ [in, out] and its
    gradients about 2x faster than the batched [B, T, in] form (measured in benchmarks/)."""
    y = layer(x.reshape(-1, x.shape[-1]))
    return y.reshape(*x.shape[:-1], y.shape[-1])


class RMSNorm(nnx.Module):
    """HF's LlamaRMSNorm / Qwen3RMSNorm: normalise in f32, scale by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * x32.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies of RoPE, with Llama 3's `llama3` scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv
    # Same arithmetic as transformers' _compute_llama3_parameters.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_l = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * inv_l / s.factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return jnp.where(medium, smoothed, inv_l)


def apply_rope(x_bthd: jax.Array, positions_bt: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """HF's rotate-half RoPE (non-interleaved halves), computed in f32."""
    freqs = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B,T,D/2]
    cos = jnp.cos(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([freqs, freqs], -1))[:, :, None, :]
    x = x_bthd.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * cos + rotated * sin).astype(x_bthd.dtype)


def attention_mask(q_pos_bt, q_seg_bt, k_pos_bs, k_seg_bs) -> jax.Array:
    """[B,T,S]: a query sees keys of its own segment at positions <= its own. Segment 0 is padding.

    Packed rows restart positions per segment, so segment equality keeps attention inside a
    sequence; the KV cache stores each slot's position and segment so the same rule serves decode.
    """
    same = q_seg_bt[:, :, None] == k_seg_bs[:, None, :]
    causal = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    return same & causal & (k_seg_bs[:, None, :] != 0)


def dot_attention(q_bthd, kt_bkds, v_bksd, mask_bts) -> jax.Array:
    """Grouped-query attention as batched matmuls over (batch, kv head): the G query heads that
    share a KV head are stacked along the row axis, [B, K, G*T, D] @ [B, K, D, S], which XLA runs
    faster than a 5-D einsum (no per-group transposes inside the dot). Keys come transposed
    ([B, K, D, S], the KV cache's layout: XLA:CPU transposes a [.., S, D] operand inside the dot,
    2.8x slower in a decode step) and values as [B, K, S, D]."""
    b, t, h, d = q_bthd.shape
    kh, s = kt_bkds.shape[1], kt_bkds.shape[3]
    g = h // kh
    q = q_bthd.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    scores = jnp.matmul(q, kt_bkds).astype(jnp.float32) / math.sqrt(d)
    scores = jnp.where(mask_bts[:, None, None], scores.reshape(b, kh, g, t, s), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bksd.dtype).reshape(b, kh, g * t, s)
    out = jnp.matmul(probs, v_bksd)  # [B, K, G*T, D]
    return out.reshape(b, kh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)


class LayerKV(NamedTuple):
    """What one layer sees of a `KVCache`: its keys [B, K, D, S] / values [B, K, S, D], either its
    own buffers (`layer` None) or every layer's stacked on a leading axis with its index, written in place at
    slots [start, start + T); and the slots' positions/segments (this chunk's already recorded)."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array | None
    start: jax.Array
    pos: jax.Array  # [B, S]
    seg: jax.Array  # [B, S]


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, h, k, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = linear(cfg, e, h * d, ("embed", "heads"), rngs)
        self.k_proj = linear(cfg, e, k * d, ("embed", "kv_heads"), rngs)
        self.v_proj = linear(cfg, e, k * d, ("embed", "kv_heads"), rngs)
        self.o_proj = linear(cfg, h * d, e, ("heads", "embed"), rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, DTYPES[cfg.param_dtype])
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, DTYPES[cfg.param_dtype])
        self.cfg = cfg

    def __call__(self, x_bte, pos_bt, seg_bt, inv_freq, kv=None):
        """kv: None (keys are this chunk) or a `LayerKV`; returns (out, None | (k_all, v_all))."""
        cfg = self.cfg
        b, t, _ = x_bte.shape
        q = dense(self.q_proj, x_bte).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = dense(self.k_proj, x_bte).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = dense(self.v_proj, x_bte).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        q = checkpoint_name(q, "qkv_proj")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, pos_bt, inv_freq)
        k = apply_rope(k, pos_bt, inv_freq).transpose(0, 2, 3, 1)  # [B, K, D, T]
        if kv is None:
            keys, values, k_pos, k_seg, new_kv = k, v, pos_bt, seg_bt, None
        else:
            if kv.layer is None:
                keys = jax.lax.dynamic_update_slice(kv.k, k.astype(kv.k.dtype), (0, 0, 0, kv.start))
                values = jax.lax.dynamic_update_slice(kv.v, v.astype(kv.v.dtype), (0, 0, kv.start, 0))
                new_kv = (keys, values)
            else:
                k_at, v_at = (kv.layer, 0, 0, 0, kv.start), (kv.layer, 0, 0, kv.start, 0)
                k_all = jax.lax.dynamic_update_slice(kv.k, k[None].astype(kv.k.dtype), k_at)
                v_all = jax.lax.dynamic_update_slice(kv.v, v[None].astype(kv.v.dtype), v_at)
                keys = jax.lax.dynamic_index_in_dim(k_all, kv.layer, 0, keepdims=False)
                values = jax.lax.dynamic_index_in_dim(v_all, kv.layer, 0, keepdims=False)
                new_kv = (k_all, v_all)
            k_pos, k_seg = kv.pos, kv.seg
        mask = attention_mask(pos_bt, seg_bt, k_pos, k_seg)
        out = dot_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask)
        out = dense(self.o_proj, out)
        return checkpoint_name(out, "out_proj"), new_kv


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(cfg, e, f, ("embed", "mlp"), rngs)
        self.up_proj = linear(cfg, e, f, ("embed", "mlp"), rngs)
        self.down_proj = linear(cfg, f, e, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return dense(self.down_proj, jax.nn.silu(dense(self.gate_proj, x)) * dense(self.up_proj, x))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.self_attn = Attention(cfg, rngs)
        if cfg.is_moe:
            from posttrain.models.qwen3_moe import SparseMoeBlock

            self.mlp = SparseMoeBlock(cfg, rngs)
        else:
            self.mlp = MLP(cfg, rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)

    def __call__(self, x, pos, seg, inv_freq, kv=None):
        """-> (x, new kv, router stats: {} for a dense MLP)."""
        h, new_kv = self.self_attn(self.input_layernorm(x), pos, seg, inv_freq, kv)
        x = x + h
        if isinstance(self.mlp, MLP):
            h, stats = self.mlp(self.post_attention_layernorm(x)), {}
        else:
            h, stats = self.mlp(self.post_attention_layernorm(x), seg != 0)
        x = x + h
        return constrain(x, ACT_AXES), new_kv, stats
