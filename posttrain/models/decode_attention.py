"""One decode step's attention over the KV cache as a Pallas TPU kernel.

XLA runs a decode step's attention as (row, KV head) pairs of tiny batched matmuls, G query rows
against a [D, S] slice of the cache, plus the softmax's passes over [B, K, G, S] scores in HBM;
on a TPU v5e that ran the decode at 35-48% of the weights+KV roofline with the share falling as
the batch grew (BENCHMARKS.md). This kernel reads each block of the cache once into VMEM (a
block of `rows` sequences x every KV head x `slots` cache slots, keys [D, slots] and values
[slots, D] per head, the cache's own layouts) and keeps the softmax there (flash-decoding's
online softmax over slot blocks): the only HBM traffic is the cache, the queries and the output.
An int8 cache (`layers.QuantizedKV`) is read as int8 and scaled in VMEM (a key's scale on its
score column, a value's scale on its probability), never dequantized in HBM.

The mask arrives as an additive f32 bias per (row, slot) (0 or MASK_VALUE), built from the
cache's slot positions and segments as `layers.attention_mask` does, so left padding, packed
prompts and the ring of a row's own slots all mean what they mean on the XLA path. Off a TPU the
kernel runs interpreted (tests).

Measured on a v5e (benchmarks/tpu/decode_attention.py, BENCHMARKS.md): one layer's attention at
64 / 128 / 256 rows x 256 slots in 120 / 212 / 392 us, XLA's in 122 / 218 / 395 us (68-84% of
the cache's roofline for both): XLA's fusion already reads the cache near bandwidth, so this
kernel stays opt-in (`model.attention: pallas`) and the decode step's remaining time is elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

VMEM_BUDGET = 16 << 20  # bytes of double-buffered cache blocks (v5e: 128 MiB of VMEM)


def block_shape(b: int, kh: int, d: int, s: int, itemsize: int) -> tuple[int, int] | None:
    """(rows, slots) per grid step: 8 rows (the f32 tile's sublanes; all B when B is not a
    multiple of 8) and the largest slot block, the whole S or a multiple of 128 dividing it,
    whose double-buffered K and V blocks fit VMEM_BUDGET. None: none fits."""
    rows = 8 if b % 8 == 0 else b
    per_slot = 2 * 2 * rows * kh * d * itemsize  # K and V, two buffers each
    for slots in [s] + [c for c in (2048, 1024, 512, 256, 128) if c < s and s % c == 0]:
        if slots * per_slot <= VMEM_BUDGET:
            return rows, slots
    return None


def _kernel(*refs, quantized: bool, kh: int, g: int, cdt, slot_major: bool):
    """Grid (row blocks, slot blocks); per (row, KV head) pair the G query heads' scores and
    P @ V, and the online softmax's running max, sum and output in VMEM scratch (lane-replicated
    max and sum, as Pallas' flash attention keeps them). Two 2-D matmuls per pair in `cdt` (the
    queries' dtype; int8 is exact in bf16). A vector-unit form (f32 multiply-adds, no MXU tile
    load for G = 2 query rows) measured 3.5-4.3x slower than this on a v5e (BENCHMARKS.md)."""
    if quantized:  # the first ref: the layer index, used by the index maps only
        _, q_ref, k_ref, v_ref, bias_ref, ks_ref, vs_ref, o_ref, m_sc, l_sc, acc_sc = refs
    else:
        _, q_ref, k_ref, v_ref, bias_ref, o_ref, m_sc, l_sc, acc_sc = refs
    j = pl.program_id(1)
    rows = q_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    for r in range(rows):
        bias = bias_ref[pl.ds(r, 1), :]  # [1, slots]
        for h in range(kh):
            i = r * kh + h
            q = q_ref[r, pl.ds(h * g, g), :].astype(cdt)  # [G, D]
            k = k_ref[r, h].astype(cdt)  # [D, slots], or [slots, D] slot-major
            s = (jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) if slot_major
                 else jnp.dot(q, k, preferred_element_type=jnp.float32))
            if quantized:
                s = s * ks_ref[r, pl.ds(h, 1), :]  # a key's scale on its column
            s = s + bias  # [G, slots]
            m_prev, l_prev = m_sc[i][:, :1], l_sc[i][:, :1]
            m_new = jnp.maximum(m_prev, s.max(-1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            p = jnp.exp(s - m_new)
            l_new = alpha * l_prev + p.sum(-1, keepdims=True)
            if quantized:
                p = p * vs_ref[r, pl.ds(h, 1), :]  # a value's scale on its probability
            pv = jnp.dot(p.astype(cdt), v_ref[r, h].astype(cdt),
                         preferred_element_type=jnp.float32)  # [G, D]
            acc_sc[i] = alpha * acc_sc[i] + pv
            m_sc[i] = jnp.broadcast_to(m_new, m_sc.shape[1:])
            l_sc[i] = jnp.broadcast_to(l_new, l_sc.shape[1:])

    @pl.when(j == pl.num_programs(1) - 1)
    def _out():
        for r in range(rows):
            for h in range(kh):
                i = r * kh + h
                o_ref[r, pl.ds(h * g, g), :] = acc_sc[i] / l_sc[i][:, :1]


@functools.partial(jax.jit, static_argnames=("rows", "slots", "interpret", "slot_major"))
def decode_attention(q_bkgd, kt, v, bias_bs, layer=None, *, rows: int | None = None,
                     slots: int | None = None, interpret: bool | None = None,
                     slot_major: bool = False) -> jax.Array:
    """softmax(q @ K + bias) @ V for one query token per row.

    q_bkgd [B, K, G, D] (already scaled by 1/sqrt(D)); kt: keys [B, K, D, S] (or a QuantizedKV of
    int8 keys with scales [B, K, 1, S]); v: values [B, K, S, D] (or a QuantizedKV with scales
    [B, K, S, 1]); with `slot_major` the keys come as the values do ([B, K, S, D], scales
    [B, K, S, 1]: `layers.kv_layout` sd); bias_bs [B, S] f32 (0 where a slot is visible, MASK_VALUE where not).
    Returns [B, K, G, D] in q's dtype. `rows`/`slots`: the block (default `block_shape`).
    `layer`: None, or a scanned model's stacked cache ([L, B, K, D, S] keys, [L, B, K, S, D]
    values) and the index of the layer to read, a traced scalar: the kernel's blocks are taken
    from that layer in place (prefetched into SMEM for the index maps), where slicing the layer
    out first copies it (the scanned decode's 24% on a v5e, BENCHMARKS.md); an int8 cache's
    scales (1/D of its bytes) are sliced.

    Layouts at the kernel's edge keep every block's last two dims in whole (8, 128) tiles or
    whole dims (XLA and Mosaic must agree on the tiling of what crosses): queries and output as
    f32 [B, H, D], the scales as [B, K, S] and the bias as [B, S]."""
    quantized = hasattr(kt, "scale")  # a `layers.QuantizedKV` (int8 values, f32 scales)
    b, kh, g, d = q_bkgd.shape
    kq, vq = (kt.q, v.q) if quantized else (kt, v)
    if layer is None:  # one layer's buffers: a stack of one (a free reshape)
        kq, vq, layer = kq[None], vq[None], 0
        ks, vs = (kt.scale, v.scale) if quantized else (None, None)
    elif quantized:  # this layer's scales alone (1/D of its bytes); its int8 values in place
        ks, vs = (jax.lax.dynamic_index_in_dim(x.scale, layer, 0, keepdims=False) for x in (kt, v))
    s = vq.shape[-2]
    if rows is None or slots is None:
        rows, slots = block_shape(b, kh, d, s, kq.dtype.itemsize)
    q_in = q_bkgd.reshape(b, kh * g, d).astype(jnp.float32)
    sq = pl.Squeezed()
    in_specs = [
        pl.BlockSpec((rows, kh * g, d), lambda i, j, l: (i, 0, 0)),
        (pl.BlockSpec((sq, rows, kh, slots, d), lambda i, j, l: (l[0], i, 0, j, 0)) if slot_major
         else pl.BlockSpec((sq, rows, kh, d, slots), lambda i, j, l: (l[0], i, 0, 0, j))),
        pl.BlockSpec((sq, rows, kh, slots, d), lambda i, j, l: (l[0], i, 0, j, 0)),
        pl.BlockSpec((rows, slots), lambda i, j, l: (i, j)),
    ]
    args = [q_in, kq, vq, bias_bs.astype(jnp.float32)]
    if quantized:
        in_specs += [pl.BlockSpec((rows, kh, slots), lambda i, j, l: (i, 0, j))] * 2
        args += [ks.reshape(b, kh, s), vs.reshape(b, kh, s)]
    n = rows * kh
    if interpret is None:  # `layers.cached_decode_attention` passes it for its target
        interpret = jax.default_backend() != "tpu"
    out = pl.pallas_call(
        functools.partial(_kernel, quantized=quantized, kh=kh, g=g, cdt=q_bkgd.dtype,
                          slot_major=slot_major),
        out_shape=jax.ShapeDtypeStruct((b, kh * g, d), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(b // rows, s // slots), in_specs=in_specs,
            out_specs=pl.BlockSpec((rows, kh * g, d), lambda i, j, l: (i, 0, 0)),
            scratch_shapes=[pltpu.VMEM((n, g, 128), jnp.float32),
                            pltpu.VMEM((n, g, 128), jnp.float32),
                            pltpu.VMEM((n, g, d), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=4 * VMEM_BUDGET),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), *args)
    return out.reshape(b, kh, g, d).astype(q_bkgd.dtype)
