"""The decoder-only causal LM shared by Qwen3 and Llama 3 (they differ only in config switches).

`CausalLM(cfg, rngs)(tokens, positions, segment_ids)` returns logits. With a `KVCache` it also
returns the updated cache: prefill and decode are the same call on a chunk of 1..T tokens, used
by `rollout.jax_engine`. Layers are either stacked and run under `jax.lax.scan` (one compiled
layer, fast compiles for deep models) or unrolled; both run the same layer body, optionally under
`jax.checkpoint` with the remat policy named in the config.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.sharding import constrain
from posttrain.models.layers import ACT_AXES, DTYPES, DecoderLayer, RMSNorm, _init, rope_inv_freq

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
}


class KVCache(NamedTuple):
    """Per-slot keys/values of every layer; a token at position p lives in slot p."""

    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]
    pos: jax.Array  # [B, S] position held by each slot
    seg: jax.Array  # [B, S] segment of each slot; 0 = empty

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or DTYPES[cfg.compute_dtype]
        shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                   jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch, max_len), jnp.int32))


def _stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs) -> DecoderLayer:
    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(r: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, r)

    return make(rngs)


class Decoder(nnx.Module):
    """HF's `model.*`: embed_tokens, layers, norm."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size,
                                      embedding_init=_init(("vocab", "embed")),
                                      param_dtype=DTYPES[cfg.param_dtype],
                                      dtype=DTYPES[cfg.compute_dtype], rngs=rngs)
        if cfg.scan_layers:
            self.layers = _stacked_layers(cfg, rngs)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, DTYPES[cfg.param_dtype])
        self.cfg = cfg

    def __call__(self, tokens_bt, pos_bt, seg_bt, cache: KVCache | None = None):
        cfg = self.cfg
        x = constrain(self.embed_tokens(tokens_bt).astype(DTYPES[cfg.compute_dtype]), ACT_AXES)
        inv_freq = rope_inv_freq(cfg)
        if cache is not None:
            rows = jnp.arange(tokens_bt.shape[0])[:, None]
            cache = cache._replace(pos=cache.pos.at[rows, pos_bt].set(pos_bt, mode="drop"),
                                   seg=cache.seg.at[rows, pos_bt].set(seg_bt, mode="drop"))

        def body(x, layer_state, kv):
            layer = nnx.merge(graphdef, layer_state)
            kv_in = None if kv is None else (kv[0], kv[1], cache.pos, cache.seg)
            return layer(x, pos_bt, seg_bt, inv_freq, kv_in)

        policy = REMAT_POLICIES[cfg.remat]
        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy)

        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            kv_l = None if cache is None else (cache.k, cache.v)

            def scan_body(x, xs):
                st, kv = xs
                x, kv, stats = body(x, st, kv)
                return x, (kv, stats)

            x, (new_kv, stats) = jax.lax.scan(scan_body, x, (state, kv_l))
        else:
            # Unrolled: call each layer object itself (qwix attaches LoRA params to it).
            def call(layer, x, kv):
                kv_in = None if kv is None else (kv[0], kv[1], cache.pos, cache.seg)
                return layer(x, pos_bt, seg_bt, inv_freq, kv_in)

            if cfg.remat != "none":
                call = nnx.remat(call, policy=policy)
            new_k, new_v, per_layer = [], [], []
            for i, layer in enumerate(self.layers):
                kv = None if cache is None else (cache.k[i], cache.v[i])
                x, kv_out, layer_stats = call(layer, x, kv)
                per_layer.append(layer_stats)
                if kv_out is not None:
                    new_k.append(kv_out[0])
                    new_v.append(kv_out[1])
            new_kv = None if cache is None else (jnp.stack(new_k), jnp.stack(new_v))
            stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        x = self.norm(x)
        if cache is not None:
            cache = cache._replace(k=new_kv[0], v=new_kv[1])
        return x, cache, stats


class CausalLM(nnx.Module):
    """Qwen3 / Qwen3 MoE / Llama 3 causal LM. Parameter paths mirror HF (`model.layers.*`, `lm_head`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.model = Decoder(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                      kernel_init=_init(("embed", "vocab")),
                                      param_dtype=DTYPES[cfg.param_dtype],
                                      dtype=DTYPES[cfg.compute_dtype], rngs=rngs)
        self.cfg = cfg

    def hidden_states(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None):
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        return self.model(tokens_bt, positions_bt, segment_ids_bt, cache)

    def logits_from_hidden(self, x_bte):
        x2 = x_bte.reshape(-1, x_bte.shape[-1])  # 2-D matmul: see layers.dense
        if self.cfg.tie_word_embeddings:
            y = self.model.embed_tokens.attend(x2)
        else:
            y = self.lm_head(x2)
        return y.reshape(*x_bte.shape[:-1], y.shape[-1])

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None,
                 with_router_losses: bool = False):
        """Logits; with a cache, (logits, cache); with `with_router_losses`, (logits, losses)
        where losses holds the MoE router's load-balancing and z losses ({} for dense models)."""
        x, cache, stats = self.hidden_states(tokens_bt, positions_bt, segment_ids_bt, cache)
        logits = self.logits_from_hidden(x)
        if with_router_losses:
            from posttrain.models.qwen3_moe import router_losses

            return logits, router_losses(self.cfg, stats)
        return logits if cache is None else (logits, cache)
