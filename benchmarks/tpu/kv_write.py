"""A decode step's KV cache row writes, alone: what writing one slot into every layer's cache
costs on a TPU, by the cache's element type.

    python -m benchmarks.tpu.kv_write [--configs 128x256,256x256] [--out DIR] [--dry-run]

A configuration is BATCHxSLOTS: Qwen3-0.6B's 28 layers, 8 KV heads, head_dim 128, slot-major
[B, K, S, D] buffers carried through a while loop as the engine's decode loop carries them (the
chip's decode profile put 122 ms of a 1,187 ms generation at 128 rows in these writes,
BENCHMARKS.md). Each step writes slot t of every buffer (a [B, K, 1, D] row made from t, so
nothing folds) with `dynamic_update_slice`, in place (the buffers donated). Variants, each a
program of its own, timed in the same process:

  bf16     K and V in bf16 buffers (the engine's cache): in XLA:TPU's (16, 128) bf16 tiles
           a slot is half of each packed 32-bit word of a sublane;
  f32      K and V in f32 buffers: a slot is one sublane of an (8, 128) tile;
  pair32   one u32 buffer per layer, a word holding the bf16 bits of K and V at the same
           (slot, d): a slot is one sublane, and the cache's bytes are bf16's;
  skbd     K and V in bf16 [S, K, B, D] buffers held in that order (`model.kv_layout` skbd,
           `layers.pinned`): a slot is whole (16, 128) tiles of rows x D.

Per step: (t(STEPS) - t(1)) / (STEPS - 1), medians of 5 calls. Reported beside it: the bytes the
written rows hold and what a read-modify-write of every tile a row touches moves; their time at
the HBM bandwidth (819 GB/s, TPU v5e). Off a TPU (`--dry-run`) tiny shapes on CPU keep the
command working (the test suite).
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

from benchmarks.tpu.decode import HBM_BYTES_S
from benchmarks.tpu.train_step import save_results

LAYERS, KV_HEADS, HEAD_DIM, STEPS = 28, 8, 128, 128
VARIANTS = ("bf16", "f32", "pair32", "skbd")


def tile_rows(variant: str) -> int:
    """Slots per (sublanes x 128 lanes) tile in XLA:TPU's layout: 16 for packed bf16, else 8;
    skbd's slot is outside the tile (its write is whole tiles: 1)."""
    return {"bf16": 16, "skbd": 1}.get(variant, 8)


def run(config: str, variant: str, layers: int = LAYERS, steps: int = STEPS) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posttrain.models.layers import pinned

    b, s = map(int, config.split("x"))
    skbd = variant == "skbd"
    shape = (s, KV_HEADS, b, HEAD_DIM) if skbd else (b, KV_HEADS, s, HEAD_DIM)
    dtype = {"f32": jnp.float32, "pair32": jnp.uint32}.get(variant, jnp.bfloat16)
    n_buffers = layers if variant == "pair32" else 2 * layers

    def row(t, i):  # the [B, K, 1, D] row step t writes into buffer i
        x = (jnp.arange(b * KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(b, KV_HEADS, 1, HEAD_DIM)
             + t.astype(jnp.float32) + i)
        if variant == "pair32":  # K's bf16 bits low, V's high
            bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
            return bits | (bits << 16)
        return x.astype(dtype).transpose(2, 1, 0, 3) if skbd else x.astype(dtype)

    @jax.jit
    def make():
        return [jnp.zeros(shape, dtype) for _ in range(n_buffers)]

    def body(c):
        t, bufs = c
        slot = t % s
        at = (slot, 0, 0, 0) if skbd else (0, 0, slot, 0)
        bufs = [jax.lax.dynamic_update_slice(buf, row(t, i), at) for i, buf in enumerate(bufs)]
        return t + 1, [pinned(x) for x in bufs] if skbd else bufs

    @partial(jax.jit, donate_argnums=0)
    def write(bufs, n):
        _, bufs = jax.lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), bufs))
        return bufs

    bufs = make()
    t0 = time.perf_counter()
    bufs = jax.block_until_ready(write(bufs, jnp.int32(steps)))
    compile_s = time.perf_counter() - t0

    def timed(n: int) -> float:
        nonlocal bufs
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            bufs = jax.block_until_ready(write(bufs, jnp.int32(n)))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    step_s = (timed(steps) - timed(1)) / (steps - 1)
    item = jnp.dtype(dtype).itemsize
    row_bytes = n_buffers * b * KV_HEADS * HEAD_DIM * item
    tile_bytes = 2 * n_buffers * b * KV_HEADS * tile_rows(variant) * HEAD_DIM * item  # read + write
    bw = HBM_BYTES_S.get(jax.default_backend())
    return {"config": config, "variant": variant, "buffers": n_buffers, "compile_s": compile_s,
            "step_us": step_s * 1e6, "row_bytes": row_bytes, "tile_rmw_bytes": tile_bytes,
            "rows_at_bandwidth_us": row_bytes / bw * 1e6 if bw else None,
            "tile_rmw_at_bandwidth_us": tile_bytes / bw * 1e6 if bw else None,
            "device": str(jax.devices()[0].device_kind)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="128x256,256x256")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    args = ap.parse_args()
    results = {"runs": []}
    for config in ("8x32" if args.dry_run else args.configs).split(","):
        for variant in VARIANTS:
            try:
                res = run(config, variant, **({"layers": 2, "steps": 8} if args.dry_run else {}))
            except Exception as e:  # one variant out of memory must not hide the others
                res = {"config": config, "variant": variant, "error": f"{type(e).__name__}: {e}"[-800:]}
            results["runs"].append(res)
            print(json.dumps(res), flush=True)
            save_results(args.out, "kv_write.json", results)


if __name__ == "__main__":
    main()
