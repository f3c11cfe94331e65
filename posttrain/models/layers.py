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

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from posttrain.models.config import ModelConfig

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
    gradients about 2x faster than the batched [B, T, in] form (measured in benchmarks/).
    The output is in the layer's compute dtype: qwix's LoRA adds its f32 adapters' product,
    which would carry f32 into a bf16 model's attention and MLP."""
    y = layer(x.reshape(-1, x.shape[-1]))
    if layer.dtype is not None:
        y = y.astype(layer.dtype)
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


class Rope(NamedTuple):
    """RoPE's cos/sin at a chunk's positions, [B, T, 1, D] f32, shared by every layer's queries
    and keys."""

    cos: jax.Array
    sin: jax.Array


def rope_tables(positions_bt: jax.Array, inv_freq: jax.Array, num_positions: int) -> Rope:
    """cos/sin at `positions_bt`. Where there are at least as many positions as table rows
    (training, scoring, prefill) they are looked up in a [num_positions, D] table made once per
    forward: computed at each position instead, XLA fuses cos and sin into every rotation and
    gradient that reads them (16 fusions in a 4-layer train step) and evaluates them per head
    there, 2 transcendentals per element of q and k (~40 ms of a 720 ms SFT step). A decode step
    has fewer positions (B x 1) than the cache has slots, so it computes them directly; both
    paths give the same bits. `num_positions` bounds the positions (the chunk's length, or the
    KV cache's: packed segments and cache slots restart at 0); a position outside the table
    gets NaN, which poisons the logits instead of rotating silently wrong."""
    if positions_bt.size < num_positions:
        angles = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
        angles = jnp.concatenate([angles, angles], -1)[:, :, None, :]
        return Rope(jnp.cos(angles), jnp.sin(angles))
    angles = jnp.arange(num_positions, dtype=jnp.float32)[:, None] * inv_freq  # [P, D/2]
    angles = jnp.concatenate([angles, angles], -1)
    table = jnp.stack([jnp.cos(angles), jnp.sin(angles)])  # [2, P, D]
    cos, sin = jnp.take(table, positions_bt, axis=1, mode="fill", fill_value=jnp.nan)[:, :, :, None]
    return Rope(cos, sin)


def apply_rope(x: jax.Array, rope: Rope, scale: float = 1.0) -> jax.Array:
    """HF's rotate-half RoPE (non-interleaved halves) over the last axis, in x's dtype as
    transformers computes it (cos/sin cast to the activations' dtype), times `scale`, folded
    into cos/sin (splash's 1/sqrt(D) on the queries: no pass of its own, forward or backward).
    Written as the two half-width results concatenated, [x1 c - x2 s, x2 c + x1 s], rather than
    x * cos + concat(-x2, x1) * sin, whose rotated copy of x XLA materialises in f32. With the
    even head chunks, the 0.6B 16k-token SFT step on a v5e went from 19,430 to 22,580 tokens/s
    (BENCHMARKS.md; f32 models compute the same products as before)."""
    h = x.shape[-1] // 2
    cos, sin = rope.cos[..., :h], rope.sin[..., :h]  # the tables' halves are equal
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :h], x[..., h:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(q_pos_bt, q_seg_bt, k_pos_bs, k_seg_bs) -> jax.Array:
    """[B,T,S]: a query sees keys of its own segment at positions <= its own. Segment 0 is padding.

    Packed rows restart positions per segment, so segment equality keeps attention inside a
    sequence; the KV cache stores each slot's position and segment so the same rule serves decode.
    """
    same = q_seg_bt[:, :, None] == k_seg_bs[:, None, :]
    causal = k_pos_bs[:, None, :] <= q_pos_bt[:, :, None]
    return same & causal & (k_seg_bs[:, None, :] != 0)


class QuantizedKV(NamedTuple):
    """A KV buffer stored in int8 with one f32 scale per token and KV head (the absmax over the
    head's D values / 127): transposed keys [B, K, D, S] with scales [B, K, 1, S], values (and
    slot-major keys) [B, K, S, D] with [B, K, S, 1] (the size-1 axis where D was, so the slot
    axis, and every pad, repeat and slice of it, is the same as the data's). Half a bf16
    cache's bytes plus 1/32 for scales."""

    q: jax.Array
    scale: jax.Array


def quantize_kv(x, d_axis: int) -> QuantizedKV:
    """Symmetric int8 with one scale per vector along `d_axis` (a head's D values)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=d_axis, keepdims=True) / 127.0
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0))
    return QuantizedKV(jnp.clip(q, -127, 127).astype(jnp.int8), scale)


def pinned(buf):
    """A KV buffer (`kv_layout` skbd) held in memory in its logical order, [S, K, B, D] with
    (B, D) in the tile, and not in the layout XLA's layout assignment picks for the dots that
    read it: unpinned, a v5e program compiled from [S, K, B, D] kept [B, K, S, D] in memory
    ({3,0,1,2}), the decode step's one-slot write rewriting a tile per (row, head) again. An
    int8 buffer's values are pinned, its scales ([S, K, B, 1]: a size-1 minor axis would be
    padded to a tile's 128 lanes) laid out as XLA likes."""
    from jax.experimental.layout import Layout, with_layout_constraint

    def pin(x):
        return with_layout_constraint(x, Layout(tuple(range(x.ndim))))

    return QuantizedKV(pin(buf.q), buf.scale) if isinstance(buf, QuantizedKV) else pin(buf)


def write_kv(buf, chunk, at: tuple, d_axis: int):
    """`chunk` written into the cache buffer `buf` (an array, or a `QuantizedKV` it is quantized
    for) at index `at`."""
    if isinstance(buf, QuantizedKV):
        chunk = quantize_kv(chunk, d_axis)
        return QuantizedKV(*(jax.lax.dynamic_update_slice(b, c, at) for b, c in zip(buf, chunk)))
    return jax.lax.dynamic_update_slice(buf, chunk.astype(buf.dtype), at)


def dot_attention(q_bthd, kt_bkds, v_bksd, mask_bts, layout: str = "ds") -> jax.Array:
    """Grouped-query attention as batched matmuls over (batch, kv head): the G query heads that
    share a KV head are stacked along the row axis, [B, K, G*T, D] @ [B, K, D, S], which XLA runs
    faster than a 5-D einsum (no per-group transposes inside the dot). Keys come transposed
    ([B, K, D, S], the KV cache's `ds` layout: XLA:CPU transposes a [.., S, D] operand inside
    the dot, 2.8x slower in a decode step) and values as [B, K, S, D]. The softmax scale is
    folded into the queries ([.., D] rather than [.., S] multiplies); the core is `_attend`.
    `layout` (`kv_layout`): sd, the keys come as [B, K, S, D] instead: an int8 cache is read in
    that layout, a float one passes its transpose, which XLA folds into the dot; skbd, keys and
    values [S, K, B, D] (a KV cache only: no gradient), read by einsums over that layout."""
    b, t, h, d = q_bthd.shape
    v_data = v_bksd.q if isinstance(v_bksd, QuantizedKV) else v_bksd
    kh = v_data.shape[1]
    g = h // kh
    q = (q_bthd * (1 / math.sqrt(d))).astype(q_bthd.dtype)
    q = q.reshape(b, t, kh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, d)
    if isinstance(kt_bkds, QuantizedKV):  # an int8 KV cache (decode: no gradient)
        out = _attend_int8(q, kt_bkds, v_bksd, mask_bts, layout)
    elif layout == "skbd":
        scores = jnp.einsum("bkqd,skbd->bkqs", q, kt_bkds).astype(jnp.float32)
        e, r = _masked_exp(scores, mask_bts)
        out = (jnp.einsum("bkqs,skbd->bkqd", e.astype(v_bksd.dtype), v_bksd) * r).astype(q.dtype)
    else:
        kt = jnp.swapaxes(kt_bkds, -1, -2) if layout == "sd" else kt_bkds
        out = _attend(q, kt, v_bksd, mask_bts)  # [B, K, G*T, D]
    return out.reshape(b, kh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, h * d)


def _masked_exp(scores, mask_bts):
    """[B, K, G*T, S] f32 scores -> (e = exp(masked scores - rowmax), r = 1 / rowsum(e)
    [B, K, G*T, 1]), the mask [B, T, S] broadcast over heads and groups."""
    b, kh, gt, s = scores.shape
    t = mask_bts.shape[1]
    scores = jnp.where(mask_bts[:, None, None], scores.reshape(b, kh, gt // t, t, s), MASK_VALUE)
    e = jnp.exp(scores - jnp.max(scores, -1, keepdims=True)).reshape(b, kh, gt, s)
    return e, 1.0 / jnp.sum(e, -1, keepdims=True)


def _attend_parts(q, kt, v, mask_bts):
    """softmax(mask(q @ kt)) @ v with the normalisation applied to the output ([.., D]) instead
    of the probabilities ([.., S]): -> (out, e = exp(scores - rowmax) [B,K,G*T,S] f32,
    r = 1 / rowsum(e) [B,K,G*T,1] f32)."""
    e, r = _masked_exp(jnp.matmul(q, kt).astype(jnp.float32), mask_bts)
    out = (jnp.matmul(e.astype(v.dtype), v) * r).astype(v.dtype)
    return out, e, r


def _attend_int8(q, kt: QuantizedKV, v: QuantizedKV, mask_bts, layout: str = "ds"):
    """`_attend_parts` over int8 keys and values, never dequantized whole: a key's scale
    multiplies its column of scores after q @ K_int8, a value's scale the probabilities of its
    slot before P @ V_int8 (both per slot, so they commute with the matmuls). Keys [B, K, D, S]
    with scales [B, K, 1, S], slot-major [B, K, S, D] with [B, K, S, 1], or (`skbd`) keys and
    values [S, K, B, D] with [S, K, B, 1]."""
    k8, v8 = kt.q.astype(q.dtype), v.q.astype(q.dtype)
    if layout == "skbd":
        per_slot = lambda scale: scale[..., 0].transpose(2, 1, 0)[:, :, None]  # -> [B, K, 1, S]
        scores = jnp.einsum("bkqd,skbd->bkqs", q, k8, preferred_element_type=jnp.float32)
        scores, v_scale = scores * per_slot(kt.scale), per_slot(v.scale)
    else:
        if layout == "sd":
            scores = jnp.einsum("bkqd,bksd->bkqs", q, k8, preferred_element_type=jnp.float32)
            scores = scores * jnp.swapaxes(kt.scale, -1, -2)
        else:
            scores = jnp.matmul(q, k8).astype(jnp.float32) * kt.scale  # [.., 1, S]
        v_scale = jnp.swapaxes(v.scale, -1, -2)
    e, r = _masked_exp(scores, mask_bts)
    p = (e * v_scale).astype(q.dtype)  # [.., G*T, S] x [.., 1, S]
    pv = (jnp.einsum("bkqs,skbd->bkqd", p, v8, preferred_element_type=jnp.float32)
          if layout == "skbd" else jnp.matmul(p, v8).astype(jnp.float32))
    return (pv * r).astype(q.dtype)


@jax.custom_vjp
def _attend(q, kt, v, mask_bts):
    """Attention's core on [B, K, G*T, D] queries (already scaled), [B, K, D, S] keys, [B, K, S, D]
    values and a [B, T, S] mask, with the flash-attention backward: dS = P * (dP - rowsum(dO * O)).
    Autodiff of the softmax (JAX's default rule differentiates exp / sum) costs three more
    passes over the [.., T, S] scores and a reduction across them; this rule's only full-size
    passes are the one that forms dS and the matmuls (tests/models/test_hand_gradients.py checks it
    against autodiff)."""
    return _attend_parts(q, kt, v, mask_bts)[0]


def _attend_fwd(q, kt, v, mask_bts):
    out, e, r = _attend_parts(q, kt, v, mask_bts)
    return out, (q, kt, v, mask_bts, out, e, r)


def _attend_bwd(res, d_out):
    q, kt, v, mask_bts, out, e, r = res
    d_out32 = d_out.astype(jnp.float32)
    dv = jnp.matmul(jnp.swapaxes(e, -1, -2), d_out32 * r)  # P^T dO, P = e * r
    dp = jnp.matmul(d_out32, jnp.swapaxes(v, -1, -2).astype(jnp.float32))
    row = jnp.sum(d_out32 * out.astype(jnp.float32), -1, keepdims=True)  # = rowsum(P * dP)
    ds = e * (r * (dp - row))
    # e is 0 at masked keys except in fully masked rows (padding queries: e = 1 everywhere),
    # where the plain formula's gradient stops at the mask
    b, kh, gt, s = ds.shape
    t = mask_bts.shape[1]
    ds = jnp.where(mask_bts[:, None, None], ds.reshape(b, kh, gt // t, t, s), 0).reshape(ds.shape)
    dq = jnp.matmul(ds, jnp.swapaxes(kt, -1, -2).astype(jnp.float32))
    dkt = jnp.matmul(jnp.swapaxes(q, -1, -2).astype(jnp.float32), ds)
    return dq.astype(q.dtype), dkt.astype(kt.dtype), dv.astype(v.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)


SPLASH_BLOCK = 1024  # splash attention's query/key tile on TPU (BENCHMARKS.md: 1024 over 512)
SPLASH_FUSED_BWD = True  # dQ computed inside the dK/dV kernel: one backward kernel, not two


_TARGET: tuple[str, int] | None = None  # (platform, devices) programs are built for; see below


def target() -> tuple[str, int]:
    """The platform and device count the programs being traced will run on: JAX's default
    backend and its devices, unless `building_for` says otherwise (`posttrain plan` compiling
    for a TPU topology from a CPU machine), so kernels are chosen and lowered for the target."""
    return _TARGET or (jax.default_backend(), jax.device_count())


def kv_layout(cfg: ModelConfig) -> str:
    """How a KV cache holds its keys and values: `cfg.kv_layout`, with `auto` resolved for the
    target here. ds: keys transposed [B, K, D, S], values [B, K, S, D] (CPU, whose dot wants
    them); sd: keys slot-major [B, K, S, D] like the values (a TPU: a transposed buffer puts the
    slot on the lanes of XLA:TPU's tiles, and the decode step's one-slot write rewrote the
    whole buffer); skbd: both [S, K, B, D], slot outermost (MaxText's autoregressive cache
    order): the rows and D fill XLA:TPU's tiles, so a decode step writes whole tiles, where
    [B, K, S, D] puts 16 slots in a bf16 tile and a one-slot write reads and rewrites every
    (row, head)'s tile; on a v5e that saved less than the attention's scores lost reading
    keys slot-outermost (7.66 against sd's 7.46 ms per 0.6B step at 128 rows, BENCHMARKS.md),
    so `auto` stays sd there."""
    if cfg.kv_layout != "auto":
        return cfg.kv_layout
    return "sd" if target()[0] == "tpu" else "ds"


def kv_axes(cfg: ModelConfig, key: bool = True) -> tuple[int, int, int]:
    """(row axis, slot axis, D axis) of a KV cache's key (or value) buffer, from its end
    (`kv_layout`), so a stacked [L, ...] buffer has the same."""
    layout = kv_layout(cfg)
    if layout == "skbd":
        return -2, -4, -1
    return (-4, -1, -2) if layout == "ds" and key else (-4, -2, -1)


@contextlib.contextmanager
def building_for(platform: str, devices: int):
    global _TARGET
    prev, _TARGET = _TARGET, (platform, devices)
    try:
        yield
    finally:
        _TARGET = prev


def attention_impl(cfg: ModelConfig, t: int, cached: bool) -> str:
    """Which attention a call runs: `cfg.attention`, with `auto` resolved here, in one place.
    Splash (the Pallas TPU kernel) serves calls without a KV cache (training, scoring) of at
    least one tile of 128 (a length between tiles is padded up inside the call,
    `splash_attention`; shorter rows run XLA's); `auto` picks it on a single TPU device (a mesh needs the
    kernel under shard_map, not done yet), XLA's formulation elsewhere (CPU, GPU, a prefill into
    the cache). A decode step (one query token per row over the cache) runs the Pallas decode
    kernel only under `pallas`: on a v5e it was 2.7x slower than XLA's decode (BENCHMARKS.md)."""
    if cached:
        return "decode" if t == 1 and cfg.attention == "pallas" else "xla"
    if t < SPLASH_TILE:
        return "xla"
    if cfg.attention == "auto":
        return "splash" if target() == ("tpu", 1) else "xla"
    return "xla" if cfg.attention == "xla" else "splash"


def cached_decode_attention(q_bthd, kt_bkds, v_bksd, mask_bts, layer=None,
                            slot_major: bool = False) -> jax.Array | None:
    """One decode step's attention (T = 1) with the Pallas kernel
    (`posttrain.models.decode_attention`), or None where no block of the cache fits its VMEM
    budget (the caller runs `dot_attention`). `layer`: None, or the cache is a scanned model's
    stack of every layer's ([L, B, K, D, S] keys) and the kernel reads this layer's in place.
    `slot_major`: the keys are [.., S, D] (`kv_layout` sd)."""
    from posttrain.models.decode_attention import block_shape, decode_attention

    b, t, h, d = q_bthd.shape
    v_data = v_bksd.q if isinstance(v_bksd, QuantizedKV) else v_bksd
    kh, s = v_data.shape[-3], v_data.shape[-2]
    if t != 1 or block_shape(b, kh, d, s, v_data.dtype.itemsize) is None:
        return None
    q = (q_bthd * (1 / math.sqrt(d))).astype(q_bthd.dtype).reshape(b, kh, h // kh, d)
    bias = jnp.where(mask_bts[:, 0], 0.0, MASK_VALUE).astype(jnp.float32)
    return decode_attention(q, kt_bkds, v_bksd, bias, layer, slot_major=slot_major,
                            interpret=target()[0] != "tpu").reshape(b, 1, h * d)


SPLASH_TILE = 128  # splash's key blocks are whole multiples of the TPU's 128 lanes


def splash_block(t: int) -> int:
    """Splash's tile for a length-`t` chunk (a multiple of 128): the largest of SPLASH_BLOCK,
    512, 256 and 128 that divides it (a 1536-token chunk runs 512-wide tiles, not 128)."""
    return next(b for b in (min(SPLASH_BLOCK, t), 512, 256, 128) if t % b == 0)


def splash_attention(q_bhtd, k_bktd, v_bktd, seg_bt) -> jax.Array:
    """Causal grouped-query attention of a chunk over itself with the Pallas splash kernel
    (`jax.experimental.pallas.ops.tpu.splash_attention`): per (row, KV head), its G query heads
    against one key/value head (the MQA kernel) on head-major operands, the kernel's own layout
    ([B, K, G, T, D] is a reshape of [B, H, T, D]; the queries already scaled by 1/sqrt(D);
    -> [B, T, H*D]), segment ids keeping packed sequences apart
    (positions restart per segment and rise with the index inside one, so index-causal within a
    segment is the mask `attention_mask` builds). Never [.., T, S] scores in memory. Off a TPU
    the kernel runs interpreted (tests). Padding queries (segment 0) attend padding keys here
    and every key in `dot_attention`: their outputs differ, and no real token reads them."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, h, t_in, d = q_bhtd.shape
    pad = -t_in % SPLASH_TILE
    if pad:  # a length between tiles: the kernel runs on the next whole tile; the padding
        # comes after every real position, so the causal mask keeps it from every real query
        # (whatever the segments). Only attention pays for it: the projections, MLP and head
        # run at the row's own length (GRPO's 20 + 256-token rows: 288 positions, not 384).
        q_bhtd, k_bktd, v_bktd = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0)))
                                  for a in (q_bhtd, k_bktd, v_bktd))
        seg_bt = jnp.pad(seg_bt, ((0, 0), (0, pad)))
    b, h, t, d = q_bhtd.shape
    kh = k_bktd.shape[1]
    g = h // kh
    block = splash_block(t)
    dq = {} if SPLASH_FUSED_BWD else dict(block_q_dq=block, block_kv_dq=block)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          use_fused_bwd_kernel=SPLASH_FUSED_BWD, **dq)
    kernel = sa.make_splash_mqa_single_device(
        sa.MultiHeadMask([sa.CausalMask((t, t))] * g), block_sizes=sizes,
        residual_checkpoint_name="attention", interpret=target()[0] != "tpu")
    q = q_bhtd.reshape(b, kh, g, t, d)
    seg = sa.SegmentIds(q=seg_bt, kv=seg_bt)
    per_row = jax.vmap(kernel, in_axes=(0, 0, 0, None))  # over KV heads
    out = jax.vmap(per_row, in_axes=(0, 0, 0, sa.SegmentIds(0, 0)))(q, k_bktd, v_bktd, seg)
    out = out.astype(q_bhtd.dtype).reshape(b, h, t, d)[:, :, :t_in]
    return out.transpose(0, 2, 1, 3).reshape(b, t_in, h * d)


def dense_heads(layer: nnx.Linear, x_bte: jax.Array, d: int, plain: bool = True) -> jax.Array:
    """`dense` of [B, T, E] to head-major [B, n, T, d]: one einsum over the kernel viewed as
    [E, n, d] (its variable keeps its [E, n*d] shape). XLA lays the product out for the heads
    directly, with no copy into splash's layout: the 0.6B 16k-token SFT step on a v5e, 22,580 ->
    22,867 tokens/s against `dense` and transposes (BENCHMARKS.md). qwix's LoRA adapters over a
    float kernel are applied here the same way, as qwix computes them ((x A) B alpha / r, the
    adapters' f32 promoting the product), with B viewed [r, n, d]: the scale is the layer's
    `lora_scale` (`posttrain.models.mark_lora_scale`). A layer qwix applies in its own call (an
    int8 kernel, LoRA dropout) goes through `dense` and a transpose, and so does every layer
    where `plain` is off (`ModelConfig.head_major_qkv`: int8 QAT fake-quantizes inside the call
    and leaves no mark on the module)."""
    b, t, _ = x_bte.shape
    scale = getattr(layer, "lora_scale", None)
    own_call = hasattr(layer, "kernel_lora_a") and scale is None
    kernel = None if not plain or own_call else layer.kernel[...]
    if not isinstance(kernel, jax.Array):
        return dense(layer, x_bte).reshape(b, t, -1, d).transpose(0, 2, 1, 3)
    dt = layer.dtype or jnp.result_type(x_bte, kernel)
    x = x_bte.astype(dt)
    y = jnp.einsum("bte,ehd->bhtd", x, kernel.astype(dt).reshape(kernel.shape[0], -1, d))
    if scale is not None:
        lora_b = layer.kernel_lora_b[...]
        xa = jnp.einsum("bte,er->btr", x, layer.kernel_lora_a[...])
        y = y + jnp.einsum("btr,rhd->bhtd", xa, lora_b.reshape(lora_b.shape[0], -1, d)) * scale
    return y.astype(dt)


class LayerKV(NamedTuple):
    """What one layer sees of a `KVCache`: its keys [B, K, D, S] (slot-major: [B, K, S, D],
    `kv_layout`; skbd: both [S, K, B, D]) / values [B, K, S, D], either its
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

    def __call__(self, x_bte, pos_bt, seg_bt, rope: Rope, kv=None):
        """kv: None (keys are this chunk) or a `LayerKV`; returns (out, None | (k_all, v_all))."""
        cfg = self.cfg
        b, t, _ = x_bte.shape
        impl = attention_impl(cfg, t, kv is not None)
        if impl == "splash":
            return self._splash(x_bte, seg_bt, rope), None
        q = dense(self.q_proj, x_bte).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
        k = dense(self.k_proj, x_bte).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = dense(self.v_proj, x_bte).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        v = v.transpose(0, 2, 1, 3)  # [B, K, T, D]
        q, k, v = (checkpoint_name(x, "qkv_proj") for x in (q, k, v))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        layout = "ds" if kv is None else kv_layout(cfg)  # of the keys read below
        if layout == "skbd":  # the cache's [S, K, B, D]
            k, v = k.transpose(1, 2, 0, 3), v.transpose(2, 1, 0, 3)
        else:  # [B, K, T, D] | keys [.., D, T]
            k = k.transpose(0, 2, 1, 3) if layout == "sd" else k.transpose(0, 2, 3, 1)
        if kv is None:
            keys, values, k_pos, k_seg, new_kv = k, v, pos_bt, seg_bt, None
        else:
            _, k_slot, k_d = kv_axes(cfg, key=True)
            at = lambda slot_axis: tuple(kv.start if a == 4 + slot_axis else 0 for a in range(4))
            k_at, v_at = at(k_slot), at(kv_axes(cfg, key=False)[1])
            if kv.layer is None:
                new_kv = (write_kv(kv.k, k, k_at, k_d), write_kv(kv.v, v, v_at, -1))
            else:
                new_kv = (write_kv(kv.k, k[None], (kv.layer, *k_at), k_d),
                          write_kv(kv.v, v[None], (kv.layer, *v_at), -1))
            if layout == "skbd":
                new_kv = tuple(map(pinned, new_kv))
            keys, values = new_kv
            k_pos, k_seg = kv.pos, kv.seg
        mask = attention_mask(pos_bt, seg_bt, k_pos, k_seg)
        out = None
        if impl == "decode" and layout != "skbd":  # the kernel reads a stacked cache in place
            out = cached_decode_attention(q, *new_kv, mask, kv.layer, slot_major=layout == "sd")
        if out is None:
            if kv is not None and kv.layer is not None:  # this layer's slice of the stack
                keys, values = jax.tree.map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, kv.layer, 0, keepdims=False),
                    new_kv)
            if not isinstance(keys, QuantizedKV):
                keys, values = keys.astype(q.dtype), values.astype(q.dtype)
            out = dot_attention(q, keys, values, mask, layout)
        out = dense(self.o_proj, out)
        return checkpoint_name(out, "out_proj"), new_kv

    def _splash(self, x_bte, seg_bt, rope: Rope):
        """The splash path, head-major from the projections on ([B, H, T, D], `dense_heads`):
        the kernel's layout needs no transposes of q, k or v."""
        cfg = self.cfg
        d = cfg.head_dim
        q, k, v = (dense_heads(p, x_bte, d, cfg.head_major_qkv)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (checkpoint_name(x, "qkv_proj") for x in (q, k, v))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = Rope(rope.cos.swapaxes(1, 2), rope.sin.swapaxes(1, 2))  # [B, 1, T, D]
        q = apply_rope(q, rope, 1 / math.sqrt(d))  # the softmax scale, folded into RoPE
        k = apply_rope(k, rope)
        out = splash_attention(q, k, v, seg_bt)  # [B, T, H*D]
        return checkpoint_name(dense(self.o_proj, out), "out_proj")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = linear(cfg, e, f, ("embed", "mlp"), rngs)
        self.up_proj = linear(cfg, e, f, ("embed", "mlp"), rngs)
        self.down_proj = linear(cfg, f, e, ("mlp", "embed"), rngs)

    def __call__(self, x):
        return dense(self.down_proj, swiglu(dense(self.gate_proj, x), dense(self.up_proj, x)))


@jax.custom_vjp
def swiglu(gate, up):
    """silu(gate) * up, with a backward that recomputes the sigmoid and forms both gradients in
    one pass (autodiff keeps the sigmoid, its complement and silu's output as separate [T, F]
    arrays and walks them in several; tests/models/test_hand_gradients.py checks it)."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate, up):
    return jax.nn.silu(gate) * up, (gate, up)


def _swiglu_bwd(res, d_out):
    gate, up = res
    # The barrier keeps XLA from merging this sigmoid with the forward's (CSE): merged, the
    # sigmoid and silu become buffers of their own and the forward three passes instead of one.
    gate = jax.lax.optimization_barrier(gate)
    sig = jax.nn.sigmoid(gate)
    silu = gate * sig
    d_gate = d_out * up * (sig + silu * (1 - sig))  # d silu / dg = s + g s (1 - s)
    return d_gate.astype(gate.dtype), (d_out * silu).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
