"""The JAX engine's decode on an accelerator: ms per decode step against the HBM roofline.

    python -m benchmarks.tpu.decode [--configs 0.6b:64x128+128,...] [--out DIR] [--dry-run]
                                    [--peer tunix]

A configuration is SHAPE:BATCHxPROMPT+NEW with optional options: `+profile` (where the device
time goes: `benchmarks.tpu.profile`), `+scan` (scanned layers over a stacked [L, ...] cache;
the default is unrolled layers, one KV buffer per layer, as the engine decodes:
`rollout.unroll_layers`; `+unroll` says so explicitly), `+topp=P` (nucleus sampling; default temperature 1 and the
whole vocabulary), `+effort=X` (XLA's execution-time optimisation effort, -1 to 1), `+int8` (the
KV cache in int8 with a scale per token and head: `rollout.kv_cache_dtype`), `+attn=pallas` (the
Pallas decode kernel over the cache instead of XLA's attention: `model.attention`), `+kv=ds|sd|skbd`
(the cache layout, `model.kv_layout`: keys transposed or slot-major, or keys and values slot
outermost, [S, K, B, D]; default auto, slot-major on a TPU), `+msa=xla` (compile without the engine's TPU options, `rollout.jax_engine.TPU_DECODE_OPTIONS`:
XLA's default memory-space assignment, which copies each layer's KV cache into VMEM per step),
`+xla=NAME:VALUE` (an XLA option for this program over the engine's, for an A/B), e.g.
`0.6b:128x128+128+profile`.

Each configuration runs in a process of its own (one process holds the chip; one that runs out
of memory must not take the others with it): a random bf16 model of the named shape, the
engine's own jitted program (`rollout.jax_engine.generate_program`: prefill, the phased decode over a KV cache,
the sampler with log-probs and kept counts), BATCH distinct prompts of PROMPT tokens, NEW new
tokens with no stop token. The per-step time is (t(NEW) - t(1)) / (NEW - 1): the same compiled
program run to NEW tokens and to one (prefill and the last sample only), medians of 3 calls.

`--peer tunix`: then Tunix 0.1.7's vanilla sampler on each BATCHxPROMPT+NEW of the bf16
configurations, in a process of its own (`benchmarks.tpu.tunix_decode`: its own Qwen3, the same
prompts' length, temperature 1 over the whole vocabulary, log-probs, the same timing); our rows
of a shape it ran get `tunix_step_ms` and `ours_over_tunix`.

Rooflines (819 GB/s, TPU v5e HBM): `weights` reads every matmul weight once per step (bf16;
the LM head included, the embedding lookup not); `weights+kv` adds the KV cache a step reads,
averaged over the generation (B x layers x 2 x kv_heads x head_dim x 2 bytes x (PROMPT + NEW/2);
int8: 1 + 4 / head_dim bytes per value).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HBM_BYTES_S = {"tpu": 819e9}  # TPU v5e


def parse_config(config: str) -> tuple[str, int, int, int, dict]:
    """`SHAPE:BxP+N[+opt...]` -> (shape, batch, prompt, new, options)."""
    head, new, *opts = config.split("+")
    shape, bp = head.split(":")
    b, p = map(int, bp.split("x"))
    o = {"profile": False, "scan": False, "top_p": 1.0, "effort": 0.0, "int8": False,
         "attn": "auto", "kv": "auto", "msa": "engine", "xla": {}}
    for opt in opts:
        if opt in ("profile", "scan", "int8"):
            o[opt] = True
        elif opt == "unroll":
            o["scan"] = False
        elif opt.startswith("topp="):
            o["top_p"] = float(opt[5:])
        elif opt.startswith("effort="):
            o["effort"] = float(opt[7:])
        elif opt.startswith("attn="):
            o["attn"] = opt[5:]
        elif opt.startswith("kv="):
            o["kv"] = opt[3:]
        elif opt == "msa=xla":
            o["msa"] = "xla"
        elif opt.startswith("xla="):  # xla=NAME:VALUE, an XLA option for this program
            name, value = opt[4:].split(":", 1)
            o["xla"][name] = xla_option_value(value)
        else:
            raise SystemExit(f"{config}: unknown option {opt}")
    return shape, b, p, int(new), o


def xla_option_value(text: str):
    """An XLA option's value from its text: a bool, an int, a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def per_step_seconds(gen, new: int, calls: int = 3) -> tuple[float, float, float]:
    """(t(NEW), t(1), the decode step's seconds): `gen(n)` generates n tokens (compiled for both
    already); medians of `calls` calls; the step is (t(NEW) - t(1)) / (NEW - 1)."""
    def timed(n: int) -> float:
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            gen(n)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    t_new, t_one = timed(new), timed(1)
    return t_new, t_one, (t_new - t_one) / (new - 1)


def run_one(config: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from benchmarks.tpu.train_step import shape_config
    from posttrain.models import CausalLM
    from posttrain.models.layers import attention_impl, kv_layout
    from rollout.jax_engine import DECODE_PHASES, generate_program, phase_ends

    shape, b, p, new, o = parse_config(config)
    jax.config.update("jax_exec_time_optimization_effort", o["effort"])
    sw = dict(scan_layers=o["scan"], compute_dtype="bfloat16", param_dtype="bfloat16",
              attention=o["attn"], kv_layout=o["kv"])
    cfg = shape_config(shape, **sw)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0)))
    state = jax.jit(lambda: nnx.state(CausalLM(cfg, nnx.Rngs(0))))()
    graphdef = nnx.graphdef(abstract)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, p)).astype(np.int32))
    lens = jnp.full((b,), p, jnp.int32)
    stop = jnp.full((4,), -1, jnp.int32)
    phases = phase_ends(new, DECODE_PHASES)

    _generate = generate_program(jax.default_backend() if o["msa"] == "engine" else None, o["xla"])

    def gen(max_new: int):
        out = _generate(graphdef, state, tokens, lens, jax.random.key(0), jnp.float32(1.0),
                        jnp.int32(0), jnp.float32(o["top_p"]), jnp.bool_(False),
                        jnp.int32(max_new), stop, gen_len=new, group=1, phases=phases,
                        kv_int8=o["int8"])
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    out = gen(new)
    compile_s = time.perf_counter() - t0
    assert int(out[3].min()) == new, "every row decodes NEW tokens (no stop token)"

    t_new, t_one, step_s = per_step_seconds(gen, new)
    weights = 2 * cfg.matmul_params()
    per_value = 1 + 4 / cfg.head_dim if o["int8"] else 2  # int8: + an f32 scale per head_dim
    kv = b * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * per_value \
        * (p + new / 2)
    bw = HBM_BYTES_S.get(jax.default_backend())
    dev = jax.devices()[0]
    res = {"config": config, "shape": shape, "batch": b, "prompt": p, "new": new,
           "scan_layers": cfg.scan_layers, "kv_int8": o["int8"], "top_p": o["top_p"], "compile_effort": o["effort"],
           "msa": o["msa"], "xla_options": o["xla"],
           "attention": attention_impl(cfg, 1, cached=True),
           "kv_layout": kv_layout(cfg),
           "phases": list(phases),
           "compile_s": compile_s, "generate_s": t_new, "prefill_s": t_one,
           "step_ms": step_s * 1e3, "tokens_per_s": b / step_s,
           "weights_bytes": weights, "kv_bytes_per_step": kv,
           "of_weights_roofline": weights / bw / step_s if bw else None,
           "of_weights_kv_roofline": (weights + kv) / bw / step_s if bw else None,
           "peak_bytes": (dev.memory_stats() or {}).get("peak_bytes_in_use"),
           "device": str(dev.device_kind)}
    if o["profile"]:
        from benchmarks.tpu.profile import op_breakdown

        prof = op_breakdown(lambda: gen(new), steps=2)
        res["profile_per_generate"] = prof
    return res


def main():
    from benchmarks.tpu.train_step import child_result, save_results

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="0.6b:16x128+128,0.6b:64x128+128,0.6b:128x128+128,"
                    "0.6b:256x128+128,0.6b:256x128+512")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    ap.add_argument("--peer", default="", choices=["", "tunix"],
                    help="tunix: Tunix's vanilla sampler on the same shapes after ours (needs "
                         "$TUNIX_PATH: `source .whl-tpu/setup.sh` on the TPU machine)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one configuration
    args = ap.parse_args()
    if args.one:
        print("@@" + json.dumps(run_one(args.one)))
        return
    configs = ("tiny:4x32+32+scan+kv=skbd,tiny:8x32+48+topp=0.9+profile+int8+attn=pallas" if args.dry_run
               else args.configs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    results = {"runs": []}
    for c in configs.split(","):
        r = subprocess.run([sys.executable, "-m", "benchmarks.tpu.decode", "--one", c], cwd=ROOT,
                           env=env, capture_output=True, text=True, check=False)
        res = child_result(c, r)
        results["runs"].append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "profile_per_generate"}), flush=True)
        save_results(args.out, "decode.json", results)
    if args.peer == "tunix":
        tunix_peer(results, configs, args, env)
    if any("error" in r for r in results["runs"]) and args.dry_run:
        sys.exit(1)


def tunix_peer(results: dict, configs: str, args, env: dict) -> None:
    """Tunix's vanilla sampler (`benchmarks.tpu.tunix_decode`, Tunix on its path alone) on each
    BATCHxPROMPT+NEW of the bf16 configurations, after ours; each of our rows of a shape it ran
    gets `tunix_step_ms` and `ours_over_tunix` (its step time over ours)."""
    from benchmarks.tpu.train_step import save_results

    def shape(config: str) -> str | None:  # BATCHxPROMPT+NEW of a bf16 configuration
        _, b, p, new, o = parse_config(config)
        return None if o["int8"] else f"{b}x{p}+{new}"

    shapes = list(dict.fromkeys(filter(None, map(shape, configs.split(",")))))
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("TUNIX_PATH"), env.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.tpu.tunix_decode", "--shapes", ",".join(shapes),
           *(["--tiny"] if args.dry_run else [])]
    # stderr to a file: a pipe left unread while stdout streams fills and stalls the child
    with tempfile.TemporaryFile("w+") as log, subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True) as proc:
        for line in proc.stdout:  # a shape's row as soon as it is measured
            if not line.startswith("@@"):
                continue
            peer = json.loads(line[2:])
            results["runs"].append(peer)
            for ours in results["runs"]:
                if ("step_ms" in ours and "step_ms" in peer and "config" in ours
                        and shape(ours["config"]) == peer["shape"]):
                    ours["tunix_step_ms"] = peer["step_ms"]
                    ours["ours_over_tunix"] = peer["step_ms"] / ours["step_ms"]
            print(json.dumps(peer), flush=True)
            save_results(args.out, "decode.json", results)
        proc.wait()
        log.seek(0)
        err = log.read()
    if proc.returncode:
        results["runs"].append({"peer": "tunix", "error": err[-1500:]})
        save_results(args.out, "decode.json", results)


if __name__ == "__main__":
    main()
