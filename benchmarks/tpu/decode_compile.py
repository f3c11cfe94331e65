"""How long XLA takes to compile the JAX engine's decode program for a TPU v5e, on this CPU.

    python -m benchmarks.tpu.decode_compile [--configs 0.6b:64x32+256+int8,...] [--out DIR]

No chip needed: libtpu (installed aside by `make install`, `posttrain.plan.libtpu_path`)
compiles for a v5e-1 topology here, as `posttrain plan --topology` does, and the compile is the
host's work on the TPU machine too (110 s there for what takes ~100 s here). A configuration is
SHAPE:BATCHxPROMPT+NEW with `benchmarks.tpu.decode`'s options (`+effort=X`, `+int8`, `+scan`
for the scanned layers' program, default unrolled as the engine decodes; `+attn=pallas`, the
Pallas decode kernel, which with `+scan` reads each layer of the stacked cache in place) and
`+phases=N` (`rollout.decode_phases`, default 4), `+layers=L` (fewer layers of the shape: how
the compile grows with depth), `+cb=G` (the continuous-batching program instead,
`rollout.continuous_batching`: BATCH rows refilled with G samples per prompt from 4 x BATCH / G
prompts, a ring of PROMPT + NEW slots), `+step` (instead: one decode step, the model's forward of one
token over a cache of PROMPT + NEW slots and the sampler at temperature 1 over the whole
vocabulary, with XLA's count of the bytes it accesses: HBM traffic without the chip). Each
configuration lowers and compiles the engine's TPU program (`rollout.jax_engine.generate_program`;
`+msa=xla`: without its options) once, with abstract bf16 weights, in a process of its own
(libtpu's compile holds its memory), and reports lower and compile seconds, XLA's temporaries and
`kv_vmem_copies_per_step`: per decode loop body that has any, how many copies of a KV buffer,
whole or sliced, XLA's memory-space assignment makes into VMEM per step
(`hlo_cost.loop_vmem_copies`; the engine's TPU options are there to keep it empty). The runtime
of a program is the chip's to measure (`benchmarks.tpu.decode`); this measures what a cold run
waits before its first rollout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.tpu.decode import parse_config
from benchmarks.tpu.hlo_cost import loop_vmem_copies
from benchmarks.tpu.train_step import save_results, shape_config

ROOT = Path(__file__).resolve().parents[2]


def parse(config: str) -> tuple[str, int, int, int, dict]:
    """`benchmarks.tpu.decode`'s configuration, plus `+phases=N`, `+layers=L` and `+step`."""
    head, *opts = config.split("+")
    own, rest = {"phases": 4, "layers": None, "step": False, "cb": 0}, []
    for opt in opts:
        if opt == "step":
            own["step"] = True
        elif opt.startswith(("phases=", "layers=", "cb=")):
            k, v = opt.split("=")
            own[k] = int(v)
        else:
            rest.append(opt)
    shape, b, p, new, o = parse_config("+".join([head, *rest]))
    if o["profile"] or o["top_p"] != 1.0:
        raise SystemExit(f"{config}: +profile and +topp= need the chip (benchmarks.tpu.decode)")
    return shape, b, p, new, {**o, **own}


def run_one(config: str, save: str | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    from posttrain.models import CausalLM
    from posttrain.models.layers import building_for
    from posttrain.plan import target_devices
    from rollout.jax_engine import bucket_rows, generate_program, phase_ends, refill_prompts

    shape, b, p, new, o = parse(config)
    jax.config.update("jax_exec_time_optimization_effort", o["effort"])
    sw = dict(scan_layers=o["scan"], compute_dtype="bfloat16", param_dtype="bfloat16",
              attention=o["attn"], kv_layout=o["kv"])
    if o["layers"]:
        sw["num_hidden_layers"] = o["layers"]
    cfg = shape_config(shape, **sw)
    sh = SingleDeviceSharding(target_devices("v5e-1", None)[0])

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

    with building_for("tpu", 1):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))))
        state = jax.tree.map(lambda v: abstract(v.shape, v.dtype), state)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = abstract(key.shape, key.dtype)
        if o["step"]:
            return {"config": config, **step_cost(graphdef, state, cfg, b, p + new, key, abstract)}
        phases = () if o["cb"] else phase_ends(new, o["phases"])
        program = generate_program("tpu" if o["msa"] == "engine" else None, o["xla"],
                                   continuous=bool(o["cb"]))
        sampling = (key, abstract((), jnp.float32), abstract((), jnp.int32),
                    abstract((), jnp.float32), abstract((), jnp.bool_), abstract((), jnp.int32),
                    abstract((4,), jnp.int32))
        t0 = time.perf_counter()
        if o["cb"]:  # as `JaxEngine._generate_continuous` calls it
            group = o["cb"]
            refill = refill_prompts(b // group)
            prompts = bucket_rows(4 * b // group + refill - 1)
            lowered = program.lower(
                graphdef, state, abstract((prompts, p), jnp.int32), abstract((prompts,), jnp.int32),
                abstract((), jnp.int32), *sampling, rows=b, gen_len=new, group=group,
                refill=refill, kv_int8=o["int8"])
        else:
            lowered = program.lower(
                graphdef, state, abstract((b, p), jnp.int32), abstract((b,), jnp.int32),
                *sampling, gen_len=new, group=1, phases=phases, kv_int8=o["int8"])
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        text = compiled.as_text()
        if save:  # the compiled program, for `python -m benchmarks.tpu.hlo_cost --hlo`
            Path(save).mkdir(parents=True, exist_ok=True)
            (Path(save) / f"{config.replace(':', '_')}.hlo.txt").write_text(text)
    kh, hd = cfg.num_key_value_heads, cfg.head_dim  # [B, K, S, D] or (skbd) [S, K, B, D]
    kv_shape = rf"(bf16|s8)\[({b},{kh},\d+,{hd}|\d+,{kh},{b},{hd})\]"
    return {"config": config, "layers": cfg.num_hidden_layers, "scan_layers": o["scan"],
            "phases": list(phases), "continuous_group": o["cb"], "kv_int8": o["int8"],
            "attention": o["attn"], "msa": o["msa"], "xla_options": o["xla"], "lower_s": t1 - t0,
            "compile_s": t2 - t1, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "kv_vmem_copies_per_step": sorted(loop_vmem_copies(text, kv_shape).values())}


def step_cost(graphdef, state, cfg, b: int, slots: int, key, abstract) -> dict:
    """One decode step (a token per row through the model over a cache of `slots`, then the
    sampler) compiled for the target: seconds and XLA's bytes accessed and FLOPs."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.models.transformer import KVCache
    from rollout.sampling import sample

    cache = jax.tree.map(lambda v: abstract(v.shape, v.dtype),
                         jax.eval_shape(lambda: KVCache.init(cfg, b, slots)))

    def step(state, cache, tok, key):
        model = nnx.merge(graphdef, state)
        logits, cache = model(tok[:, None], jnp.full((b, 1), slots // 2, jnp.int32),
                              jnp.ones((b, 1), jnp.int32), cache=cache)
        return sample(key, logits[:, 0], jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0),
                      jnp.bool_(False)), cache

    t0 = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=1).lower(
        state, cache, abstract((b,), jnp.int32), key).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"layers": cfg.num_hidden_layers, "step_compile_s": time.perf_counter() - t0,
            "step_bytes_accessed": cost["bytes accessed"], "step_flops": cost["flops"]}


def main():
    from posttrain.plan import libtpu_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="0.6b:64x32+256+int8,0.6b:64x32+256+int8+scan,"
                    "0.6b:64x32+256+int8+phases=1,0.6b:128x128+128,0.6b:128x128+128+layers=4,"
                    "0.6b:128x128+128+step+layers=1")
    ap.add_argument("--out", default=None)
    ap.add_argument("--save-hlo", default=None,
                    help="write each compiled program's text here (for benchmarks.tpu.hlo_cost --hlo)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one configuration
    args = ap.parse_args()
    if args.one:
        print("@@" + json.dumps(run_one(args.one, args.save_hlo)))
        return
    lib = libtpu_path()
    if lib is None:
        raise SystemExit("libtpu is not installed (make install puts it in .venv/libtpu)")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **({} if lib == "libtpu" else {"TPU_LIBRARY_PATH": lib}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    results = {"runs": []}
    for c in args.configs.split(","):
        p = subprocess.run([sys.executable, "-m", "benchmarks.tpu.decode_compile", "--one", c,
                            *(["--save-hlo", args.save_hlo] if args.save_hlo else [])],
                           cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        line = next((x for x in p.stdout.splitlines() if x.startswith("@@")), None)
        res = json.loads(line[2:]) if line else {"config": c, "error": p.stderr[-1500:]}
        results["runs"].append(res)
        print(json.dumps(res), flush=True)
        save_results(args.out, "decode_compile.json", results)


if __name__ == "__main__":
    main()
