"""One decode step's attention over a KV cache, alone: XLA's formulation against the Pallas
kernel (`posttrain.models.decode_attention`), per layer call, against the HBM roofline.

    python -m benchmarks.tpu.decode_attention [--configs 64x256,128x256,...] [--out DIR] [--dry-run]

A configuration is BATCHxSLOTS with options: `+int8` (the int8 cache with its scales), `+kv=sd`
(keys slot-major, [B, K, S, D], as the engine caches them on a TPU; default `kv=ds`, transposed),
`+kv=skbd` (keys and values [S, K, B, D], `model.kv_layout` skbd: the Pallas kernel does not read
it, so XLA's attention over it is timed beside XLA's over `kv=sd` instead of the kernel),
`+rows=R+slots=S` (the kernel's block). The Qwen3-0.6B attention shape (8 KV heads, G = 2,
head_dim 128), bf16, every slot visible, one query token per row. Each line times, in the same
process, `layers.dot_attention` (the XLA path the engine ran before) and the kernel on the same
arrays (medians of 20 calls of a jitted loop of 28 calls, one per layer of the 0.6B model), and
checks they agree. Roofline: the cache's bytes (K and V, every slot; int8: 1 + 4 / head_dim bytes
per value) over 819 GB/s (TPU v5e). Off a TPU (`--dry-run`) the kernel runs interpreted on tiny
shapes: the test suite keeps the command working.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

from benchmarks.tpu.decode import HBM_BYTES_S
from benchmarks.tpu.train_step import save_results

LAYERS = 28


def parse(config: str) -> tuple[int, int, dict]:
    head, *opts = config.split("+")
    b, s = map(int, head.split("x"))
    o = {"int8": False, "rows": None, "slots": None, "layout": "ds"}
    for opt in opts:
        if opt == "int8":
            o["int8"] = True
        elif opt in ("kv=sd", "kv=ds", "kv=skbd"):
            o["layout"] = opt[3:]
        elif opt.startswith(("rows=", "slots=")):
            k, v = opt.split("=")
            o[k] = int(v)
        else:
            raise SystemExit(f"{config}: unknown option {opt}")
    return b, s, o


def run(config: str, kh: int = 8, g: int = 2, d: int = 128, layers_n: int = LAYERS) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posttrain.models import layers
    from posttrain.models.decode_attention import block_shape, decode_attention

    b, s, o = parse(config)
    rng = np.random.default_rng(0)  # host-made inputs: eager jax.random on the TPU machine hung

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    q, kt, v = normal(b, 1, kh * g, d), normal(b, kh, d, s), normal(b, kh, s, d)
    layout = o["layout"]
    sd = layout != "ds"  # the kernel's (or, for skbd, the reference's) keys [B, K, S, D]
    if sd:  # keys as the values are, [B, K, S, D]: the engine's cache on a TPU
        kt = jnp.swapaxes(kt, -1, -2)
    # skbd: the same keys and values as [S, K, B, D]
    k_o, v_o = (x.transpose(2, 1, 0, 3) for x in (kt, v)) if layout == "skbd" else (None, None)
    if o["int8"]:
        kt, v = layers.quantize_kv(kt, -1 if sd else -2), layers.quantize_kv(v, -1)
        if k_o is not None:
            k_o, v_o = layers.quantize_kv(k_o, -1), layers.quantize_kv(v_o, -1)
    mask = jnp.ones((b, 1, s), bool)
    rows, slots = o["rows"], o["slots"]
    if rows is None or slots is None:
        rows, slots = block_shape(b, kh, d, s, 1 if o["int8"] else 2)
    qs = (q * (1 / d ** 0.5)).astype(q.dtype).reshape(b, kh, g, d)
    bias = jnp.zeros((b, s), jnp.float32)

    def xla(q, kt, v, layout=layout):
        return layers.dot_attention(q, kt, v, mask, layout).reshape(b, kh, g, d)

    def kernel(q, kt, v):
        return decode_attention(q, kt, v, bias, rows=rows, slots=slots, slot_major=sd)

    def layered(f, kt, v):  # LAYERS calls, each feeding the next (nothing hoisted or merged)
        def body(_, x):
            return f(x, kt, v).astype(x.dtype).reshape(x.shape)
        return jax.jit(lambda x: jax.lax.fori_loop(0, layers_n, body, x))

    res = {"config": config, "batch": b, "slots": s, "int8": o["int8"], "layout": layout,
           "block": [rows, slots],
           "device": str(jax.devices()[0].device_kind)}
    if layout == "skbd":  # XLA's attention over [S, K, B, D] against XLA's over [B, K, S, D]
        ref = jax.jit(partial(xla, layout="sd"))(q, kt, v).astype(jnp.float32)
        got = jax.jit(xla)(q, k_o, v_o).astype(jnp.float32)
        timed = (("xla", xla, q, k_o, v_o), ("xla_sd", partial(xla, layout="sd"), q, kt, v))
    else:
        ref = jax.jit(xla)(q, kt, v).astype(jnp.float32)
        got = jax.jit(kernel)(qs, kt, v).astype(jnp.float32)
        timed = (("xla", xla, q, kt, v), ("kernel", kernel, qs, kt, v))
    res["max_abs_diff"] = float(jnp.max(jnp.abs(ref - got)))
    per_value = 1 + 4 / d if o["int8"] else 2
    kv_bytes = b * 2 * kh * d * s * per_value
    bw = HBM_BYTES_S.get(jax.default_backend())
    for name, f, x, k_in, v_in in timed:
        run_layers = layered(f, k_in, v_in)  # compiled once, timed after
        t0 = time.perf_counter()
        jax.block_until_ready(run_layers(x))
        res[f"{name}_compile_s"] = time.perf_counter() - t0
        ts = []
        for _ in range(5 if jax.default_backend() == "cpu" else 20):
            t0 = time.perf_counter()
            jax.block_until_ready(run_layers(x))
            ts.append(time.perf_counter() - t0)
        per_call = float(np.median(ts)) / layers_n
        res[f"{name}_us"] = per_call * 1e6
        res[f"{name}_of_roofline"] = kv_bytes / bw / per_call if bw else None
    if layout == "skbd":
        res["skbd_over_sd"] = res["xla_sd_us"] / res["xla_us"]
    else:
        res["kernel_over_xla"] = res["xla_us"] / res["kernel_us"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="64x256,128x256,256x256,256x640+int8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    args = ap.parse_args()
    configs = ("4x256+rows=4+slots=128,4x128+int8,4x128+int8+kv=sd,4x128+kv=skbd,"
               "4x128+int8+kv=skbd" if args.dry_run
               else args.configs)
    results = {"runs": []}
    for c in configs.split(","):
        try:
            res = run(c) if not args.dry_run else run(c, kh=2, g=2, d=32, layers_n=2)
        except Exception as e:  # one configuration's failure (out of memory, lowering) is a row
            res = {"config": c, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        results["runs"].append(res)
        print(json.dumps(res), flush=True)
        save_results(args.out, "decode_attention.json", results)
    if args.dry_run and any("error" in r for r in results["runs"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
