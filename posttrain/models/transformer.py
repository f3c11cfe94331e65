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
import numpy as np
from flax import nnx

from posttrain.models.config import ModelConfig
from posttrain.sharding import constrain
from posttrain.models.layers import (ACT_AXES, DTYPES, MLP, Attention, LayerKV, QuantizedKV,
                                     RMSNorm, Rope, _init, kv_axes, rope_inv_freq,
                                     rope_tables)
from posttrain.models.qwen3_moe import SparseMoeBlock, router_losses

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
    "save_qkvo": jax.checkpoint_policies.save_only_these_names("qkv_proj", "out_proj"),
    # and the splash kernel's output and log-sum-exp (its residuals, named "attention" by
    # `layers.splash_attention`): the backward reruns the projections, not the kernel
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention"),
    # all three: the backward reruns the MLP alone (MaxText's save_dot_except_mlp, with the
    # kernel's residuals kept too)
    "save_qkvo_attention": jax.checkpoint_policies.save_only_these_names(
        "qkv_proj", "out_proj", "attention"),
}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.self_attn = Attention(cfg, rngs)
        self.mlp = SparseMoeBlock(cfg, rngs) if cfg.is_moe else MLP(cfg, rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pd)

    def __call__(self, x, pos, seg, rope: Rope, kv=None):
        """-> (x, new kv, router stats: {} for a dense MLP). The residual stream keeps x's
        dtype: qwix's LoRA adds its f32 adapters' output to a projection's, which would turn a
        bf16 stream f32 from the first adapted layer on (every later matmul in f32, and a
        scan's carry of another dtype than it started with)."""
        h, new_kv = self.self_attn(self.input_layernorm(x), pos, seg, rope, kv)
        x = x + h.astype(x.dtype)
        if isinstance(self.mlp, MLP):
            h, stats = self.mlp(self.post_attention_layernorm(x)), {}
        else:
            h, stats = self.mlp(self.post_attention_layernorm(x), seg != 0)
        x = x + h.astype(x.dtype)
        return constrain(x, ACT_AXES), new_kv, stats


class KVCache(NamedTuple):
    """Keys/values of every layer in slots filled in order: a call on a chunk of T tokens writes
    slots [end, end + T) of every row and advances `end`. Each slot records the position and
    segment of its token, so the attention mask needs no slot/position relation: rows of
    different prompt lengths decode in lockstep into one shared slot per step, which is a
    `dynamic_update_slice` at a scalar offset (in place inside a `while_loop`), never a scatter.
    The caller sizes the cache: a chunk written past the last slot is clamped by XLA.

    Unrolled models keep one buffer per layer: a layer's attention then reads its buffer as is,
    where a slice of a stacked [L, ...] array is a copy per layer per step (on CPU, half the
    decode step of the reference model).

    Stored in the compute dtype, or in int8 (`QuantizedKV`: a scale per token and head), half
    the bytes, with `dtype=jnp.int8`; a buffer below is then a `QuantizedKV` of such arrays."""

    k: jax.Array | tuple  # scanned layers: [L, B, K, D, S]; unrolled: L arrays [B, K, D, S]
    # (`layers.kv_layout` sd: [.., S, D] as the values; skbd: keys and values [S, K, B, D])
    v: jax.Array | tuple  # scanned layers: [L, B, K, S, D]; unrolled: L arrays [B, K, S, D]
    pos: jax.Array  # [B, S] position held by each slot
    seg: jax.Array  # [B, S] segment of each slot; 0 = empty
    end: jax.Array  # [] next slot to write

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
        dtype = dtype or DTYPES[cfg.compute_dtype]

        def buffer_shape(key: bool):
            out = [0, cfg.num_key_value_heads, 0, 0]  # K is always axis 1 (-3)
            rows, slots, d = kv_axes(cfg, key)
            out[4 + rows], out[4 + slots], out[4 + d] = batch, max_len, cfg.head_dim
            return tuple(out)

        k_shape, v_shape, k_d = buffer_shape(True), buffer_shape(False), kv_axes(cfg, True)[2]
        lead = (cfg.num_hidden_layers,) if cfg.scan_layers else ()

        def zeros(shape, d_axis):
            if jnp.dtype(dtype) != jnp.int8:
                return jnp.zeros(lead + shape, dtype)
            scale = list(lead + shape)
            scale[d_axis] = 1
            return QuantizedKV(jnp.zeros(lead + shape, jnp.int8), jnp.zeros(scale, jnp.float32))

        if cfg.scan_layers:
            k, v = zeros(k_shape, k_d), zeros(v_shape, -1)
        else:
            k = tuple(zeros(k_shape, k_d) for _ in range(cfg.num_hidden_layers))
            v = tuple(zeros(v_shape, -1) for _ in range(cfg.num_hidden_layers))
        return cls(k, v,
                   jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((batch, max_len), jnp.int32),
                   jnp.zeros((), jnp.int32))

    def repeat(self, n: int, cfg: ModelConfig) -> "KVCache":
        """Each row n times in a row (row i -> rows i*n .. i*n + n-1): one prompt's prefill
        shared by the n completions sampled from it. `cfg`: the model's, for the layout."""
        if n == 1:
            return self
        rows = kv_axes(cfg)[0]  # from the end: the same in a stacked [L, ...] buffer
        k, v = jax.tree.map(lambda x: jnp.repeat(x, n, axis=x.ndim + rows), (self.k, self.v))
        return KVCache(k, v, jnp.repeat(self.pos, n, axis=0), jnp.repeat(self.seg, n, axis=0),
                       self.end)

    def grow(self, slots: int, cfg: ModelConfig) -> "KVCache":
        """The same cache with empty slots appended up to `slots` (segment 0: masked out). A
        decode that reads only the slots it can have filled by now attends over a short cache
        first and grows it as it goes (`rollout.jax_engine`). `cfg`: the model's, for the
        keys' layout."""
        extra = slots - self.pos.shape[1]
        if extra <= 0:
            return self

        def pad(x, axis):
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, extra)
            return jnp.pad(x, widths)

        k = jax.tree.map(lambda x: pad(x, kv_axes(cfg, True)[1]), self.k)
        v = jax.tree.map(lambda x: pad(x, kv_axes(cfg, False)[1]), self.v)
        return KVCache(k, v, pad(self.pos, 1), pad(self.seg, 1), self.end)


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
        # positions restart at 0 per packed segment and index cache slots: below the longest axis
        num_positions = max(tokens_bt.shape[1], 0 if cache is None else cache.pos.shape[1])
        rope = rope_tables(pos_bt, rope_inv_freq(cfg), num_positions)
        if cache is not None:
            start = cache.end
            cache = cache._replace(pos=jax.lax.dynamic_update_slice(cache.pos, pos_bt, (0, start)),
                                   seg=jax.lax.dynamic_update_slice(cache.seg, seg_bt, (0, start)))

        def body(x, layer_state, kv):
            layer = nnx.merge(graphdef, layer_state)
            return layer(x, pos_bt, seg_bt, rope, kv)

        def layer_kv(k, v, layer=None):
            """This layer's view of the cache: its own buffers, or the stacked ones and its index."""
            return None if cache is None else LayerKV(k, v, layer, start, cache.pos, cache.seg)

        policy = REMAT_POLICIES[cfg.remat]
        if cfg.remat != "none":
            body = jax.checkpoint(body, policy=policy)

        k_all, v_all = (None, None) if cache is None else (cache.k, cache.v)
        if cfg.scan_layers:
            # The whole cache rides in the carry: each layer writes its chunk in place.
            graphdef, state = nnx.split(self.layers)

            def scan_body(carry, xs):
                x, k_all, v_all = carry
                st, i = xs
                x, kv, stats = body(x, st, layer_kv(k_all, v_all, i))
                k_all, v_all = (None, None) if kv is None else kv
                return (x, k_all, v_all), stats

            idx = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
            (x, k_all, v_all), stats = jax.lax.scan(scan_body, (x, k_all, v_all), (state, idx))
        else:
            # Unrolled: call each layer object itself (qwix attaches LoRA params to it).
            def call(layer, x, kv):
                return layer(x, pos_bt, seg_bt, rope, kv)

            if cfg.remat != "none":
                call = _remat_layer_call(call, policy)
            per_layer, new_k, new_v = [], [], []
            for i, layer in enumerate(self.layers):
                kv = None if cache is None else layer_kv(k_all[i], v_all[i])
                x, kv, layer_stats = call(layer, x, kv)
                per_layer.append(layer_stats)
                if kv is not None:
                    new_k.append(kv[0])
                    new_v.append(kv[1])
            k_all, v_all = tuple(new_k), tuple(new_v)
            stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
        x = self.norm(x)
        if cache is not None:
            cache = cache._replace(k=k_all, v=v_all, end=start + tokens_bt.shape[1])
        return x, cache, stats


def _remat_layer_call(call, policy):
    """`call(layer, x, kv)` under `jax.checkpoint`, the layer passed in as its state and merged
    inside, as the scanned path does. Not `nnx.remat`: under qwix's LoRA interception it writes
    the layer's Variables back from inside the checkpoint's trace, which flax refuses
    (TraceContextError), so LoRA with remat on unrolled layers could not train at all. Nothing
    is written back: a layer's forward changes no state but LoRA dropout's RNG counts, which
    the train step reseeds every step (`train.step._reseed_dropout`)."""

    def remat_call(layer, x, kv):
        graphdef, state = nnx.split(layer)
        return jax.checkpoint(lambda st, x, kv: call(nnx.merge(graphdef, st), x, kv),
                              policy=policy)(state, x, kv)

    return remat_call


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

    def _hidden_states(self, tokens_bt, positions_bt, segment_ids_bt, cache):
        b, t = tokens_bt.shape
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        return self.model(tokens_bt, positions_bt, segment_ids_bt, cache)

    def head_weight(self) -> jax.Array:
        """The LM head's weight as [V, E] in the parameter dtype (the tied embedding, or
        lm_head's kernel transposed), for a loss that runs the head itself
        (`posttrain.train.step.fused_head_nll`; only where nothing wraps the head)."""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.embedding[...]
        return self.lm_head.kernel[...].T

    def _lm_head(self, x_bte):
        x2 = x_bte.reshape(-1, x_bte.shape[-1])  # 2-D matmul: see layers.dense
        if self.cfg.tie_word_embeddings:
            y = self.model.embed_tokens.attend(x2)
        else:
            y = self.lm_head(x2)
        return y.reshape(*x_bte.shape[:-1], y.shape[-1])

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache=None, *,
                 with_router_losses: bool = False, head=None):
        """Logits; with a cache, (logits, cache); with `with_router_losses`, (logits, losses)
        where losses holds the MoE router's load-balancing and z losses ({} for dense models).

        `head`: a function `(x_bte, lm_head) -> out` that takes the place of the LM head over
        every position, given the final hidden states and the head (`lm_head(x_...e)` -> logits):
        the engine's prefill applies the head at each prompt's last token only, the GRPO loss
        over hidden states it assembles from a shared prefix (`lambda x, _: x` returns the hidden
        states). It runs inside this call, and everything must: qwix's LoRA and int8 wrap
        `__call__` alone (their matmuls are intercepted in its dynamic extent), so a forward
        pieced together from other methods would silently run without the adapters."""
        x, cache, stats = self._hidden_states(tokens_bt, positions_bt, segment_ids_bt, cache)
        out = self._lm_head(x) if head is None else head(x, self._lm_head)
        if with_router_losses:
            return out, router_losses(self.cfg, stats)
        return out if cache is None else (out, cache)


def dequantize(qvalue, scale):
    """An int8 kernel (qwix's QArray: its values and scale) in f32 (numpy or JAX arrays)."""
    return qvalue.astype(np.float32) * scale.astype(np.float32)


def merge_lora(w, a, b, scale: float):
    """A LoRA kernel as one plain kernel, W' = W + (alpha / rank) A B, in W's dtype (numpy or
    JAX arrays; stacked ones layer by layer)."""
    return (w.astype(np.float32) + scale * (a @ b)).astype(w.dtype)


def layer_unstacker(cfg: ModelConfig, lora_scale: float | None = None):
    """(graphdef, unstack) for a scanned model's unrolled twin: `unstack(state[, into])` (jitted,
    one dispatch) takes the scanned model's state, or a part of it, to the twin's layout, each
    stacked [L, ...] leaf under `model.layers` split into its L layers' leaves. The decode of
    unrolled layers reads one KV buffer per layer in place, where a layer of a scan slices its
    keys and values out of the stacked cache, a copy per layer per step (24% of the decode's
    time on a TPU v5e, BENCHMARKS.md). A scanned LoRA model's adapters are merged into the
    twin's kernels (`merge_lora` with `lora_scale`) and an int8 base dequantized: the twin
    decodes plain weights."""
    twin = cfg.model_copy(update={"scan_layers": False})
    graphdef, like = nnx.split(nnx.eval_shape(lambda: CausalLM(twin, nnx.Rngs(0))))
    like = [(tuple(p), v) for p, v in nnx.to_flat_state(like)]

    def source(path):
        if path[:2] == ("model", "layers"):  # ("model", "layers", i, ...) <- ("model", "layers", ...)[i]
            return path[:2] + path[3:], path[2]
        return path, None

    def unstack(state: nnx.State, into: nnx.State | None = None) -> nnx.State:
        """With `into` (a state of the twin's, donated) the result is written into its buffers."""
        return _unstack(state) if into is None else _unstack_into(into, state)

    def unstack_tree(state):
        src = {tuple(p): v for p, v in nnx.to_flat_state(state)}
        out, whole = [], {}

        def effective(at, dtype):
            """The leaf at `at`, all its layers at once, an int8 base dequantized and LoRA
            adapters merged; None when the state lacks it. One batched op per kind of kernel,
            then sliced: merged layer by layer, the 0.6B LoRA policy's program held 596 fusions
            and compiled for a v5e in 67 s on a 2-core CPU (21 s on the TPU host, in a cold
            GRPO run's first sync); stacked, 43 fusions in 2.7 s."""
            q = at + ("array", "qvalue"), at + ("array", "scale")
            if at in src:
                value = src[at].get_value()
            elif q[0] in src:  # an int8 base: dequantized, as checkpoints load it
                value = dequantize(*(src[k].get_value() for k in q)).astype(dtype)
            else:
                return None
            lora = at[:-1] + (f"{at[-1]}_lora_a",), at[:-1] + (f"{at[-1]}_lora_b",)
            if lora[0] in src:
                if lora_scale is None:
                    raise ValueError(f"{'.'.join(map(str, at))}: a LoRA kernel, but no "
                                     "lora_scale (alpha / rank) to merge its adapters with")
                value = merge_lora(value, *(src[k].get_value() for k in lora), lora_scale)
            return value

        for path, var in like:
            at, layer = source(path)
            if at not in whole:
                whole[at] = effective(at, var.dtype)
            value = whole[at]
            if value is None:
                continue
            out.append((path, var.replace(value if layer is None else value[layer])))
        return nnx.from_flat_state(out)

    _unstack = jax.jit(unstack_tree)
    _unstack_into = jax.jit(lambda into, state: unstack_tree(state), donate_argnums=0,
                            keep_unused=True)
    return graphdef, unstack
