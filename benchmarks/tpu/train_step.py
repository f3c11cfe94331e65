"""The SFT / pretraining step on an accelerator: tokens/s, MFU, peak memory, compile seconds.

    python -m benchmarks.tpu.train_step [--configs 0.6b:2x2048,0.6b:8x2048] [--steps 10] [--out DIR]
                                        [--attention auto|xla|splash] [--remat full] [--peer tunix]
                                        [--params f32|bf16] [--profile]

A configuration is SHAPE:BATCHxSEQ with optional `+` options that override the flags for it
alone: `+bf16` (bf16 parameters; Adam moments stay f32: `init_opt_state`), `+moments=bf16`
(Adam's moments stored in bf16: `optimizer.moments_dtype`, what Tunix's optax keeps for bf16
parameters), `+remat=POLICY`, `+attn=IMPL`,
`+chunk=N` (head chunk tokens), `+unroll` (unrolled layers instead of a scan), `+block=N`
(splash attention's tiles), `+fused=0|1` (splash's fused backward kernel), `+effort=X` (XLA's execution-time
optimisation effort, -1 to 1: `train.compile_effort`), `+headfuse=0` (the loss through the
chunked head under remat instead of `fused_head_nll`, the code before it), `+headmajor=0` (q/k/v
through the Linear's call and transposed for splash, the code before `layers.dense_heads`), `+lora16` (LoRA
rank 16 on every projection, the base frozen), `+int8` (with LoRA: the frozen base quantized to int8 by qwix), `+profile` (where the device time
goes: `benchmarks.tpu.profile`), `+dpo` (a DPO step instead: each row one preference pair, chosen
and rejected of T/2 tokens each, half prompt and half completion; with LoRA the reference is the
policy with its adapters off, scored inside the measured step), e.g. `8b:2x2048+lora16+int8+bf16`,
`0.6b:8x2048+lora16+dpo`.

On the TPU machine (see ../shared/TPU.md), after `source .whl-tpu/setup.sh`, with `--out $OUT`.
Each configuration runs in a process of its own (one process holds the chip at a time, and a
configuration that runs out of memory must not take the others with it): a random model of
the named shape (f32 master weights, bf16 compute, scanned layers, remat full, AdamW) trained by
the trainer's own `make_train_step` with the next-token loss (`posttrain.train.step`, its LM
head in chunks: `model.head_chunk_tokens`, 0 = auto; `--head-chunk 1000000` runs the whole
head, the code before chunking). The measured bf16 matmul peak (8192^3) is printed beside the
chip's nominal one.

MFU convention: 6 x (every matmul parameter, the LM head included; the embedding lookup not) per
token, plus causal attention at half: 6 x L x T x (heads x head_dim) per token (2 x 2 matmuls
of T x T x d each, forward and backward at 3x, halved for the mask). Against 197 TFLOP/s
(v5e bf16 peak). On CPU (`--dry-run`: tiny shapes) the same code runs in seconds: the test
suite runs it so the command stays working.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # ModelConfig presets, or explicit tiny shapes for the CPU dry run
    "0.6b": "qwen3_0_6b",
    "llama1b": "llama3_2_1b",
    "1.7b": "qwen3_1_7b",
    "4b": "qwen3_4b",
    "8b": "qwen3_8b",
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}
PEAK_TFLOPS = {"tpu": 197.0}  # TPU v5e, bf16 dense


def model_config(shape: str, head_chunk: int, remat: str, attention: str = "auto",
                 params: str = "f32", lora: int = 0, unroll: bool = False, fused_head: bool = True):
    sw = dict(scan_layers=not unroll, remat=remat, compute_dtype="bfloat16",
              param_dtype="bfloat16" if params == "bf16" else "float32",
              head_chunk_tokens=head_chunk, attention=attention, fused_head_loss=fused_head)
    return shape_config(shape, **sw)


def shape_config(shape: str, **settings):
    """The ModelConfig of a named shape (`SHAPES`) with `settings`."""
    from posttrain.models.config import ModelConfig

    spec = SHAPES[shape]
    if isinstance(spec, str):
        return ModelConfig.preset(spec, **settings)
    return ModelConfig(**spec, **settings)


def parse_config(config: str, defaults: dict) -> tuple[str, int, int, dict]:
    """`SHAPE:BxT[+opt...]` -> (shape, batch, seq, options over `defaults`)."""
    head, *opts = config.split("+")
    shape, bs = head.split(":")
    b, t = map(int, bs.split("x"))
    o = dict(defaults)
    for opt in opts:
        if opt in ("bf16", "f32"):
            o["params"] = opt
        elif opt.startswith("lora"):
            o["lora"] = int(opt[4:] or 16)
        elif opt in ("int8", "profile", "dpo", "unroll"):
            o[opt] = True
        elif "=" in opt:
            k, v = opt.split("=", 1)
            key = {"attn": "attention", "chunk": "head_chunk"}.get(k, k)
            if key not in defaults:
                raise SystemExit(f"{config}: unknown option {k}")
            o[key] = type(defaults[key])(v)
        else:
            raise SystemExit(f"{config}: unknown option {opt}")
    return shape, b, t, o



def flops_per_token(cfg, n_matmul_params: int, seq: int, weight_grads: bool = True) -> float:
    """6 N per token (forward 2, backward 2 for the activations' gradient and 2 for the
    weights'), or 4 N for a frozen base (LoRA: no weight gradient; the adapters not counted),
    plus causal attention at half."""
    attn = 6 * cfg.num_hidden_layers * seq * cfg.num_attention_heads * cfg.head_dim
    return (6 if weight_grads else 4) * n_matmul_params + attn


def matmul_peak() -> float:
    """Measured bf16 TFLOP/s of an 8192^3 matmul (2048^3 on CPU)."""
    import jax
    import jax.numpy as jnp

    n = 8192 if jax.default_backend() != "cpu" else 1024
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(a, a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(10):
        out = f(a, a)
    out.block_until_ready()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t0) / 1e12


def build(cfg, lora: int, int8: bool):
    """(graphdef, trainable params, the rest) of a random model made on the device: with LoRA,
    qwix's adapters on every projection and the base frozen (int8 with `int8`: the weights are
    quantized inside the same jitted init, so an 8B model's bf16 weights never exist whole)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.models import CausalLM

    def make():
        model = CausalLM(cfg, nnx.Rngs(0))
        if lora:
            import qwix

            from posttrain.models import qwix_apply

            provider = qwix.LoraProvider(module_path=".*_proj", rank=lora, alpha=2.0 * lora,
                                         weight_qtype=jnp.int8 if int8 else None)
            model = qwix_apply(model, provider, rngs=nnx.Rngs(0))
        return model

    abstract = nnx.eval_shape(make)
    # an int8 base is made leaf by leaf: the whole init program holds every layer's bf16 weights
    # beside their int8 copies (16.8 GB for the 8B shape by XLA's v5e compile: out of memory)
    whole = random_state(nnx.state(abstract)) if lora and int8 else jax.jit(lambda: nnx.state(make()))()
    return nnx.split(nnx.merge(nnx.graphdef(abstract), whole), nnx.LoRAParam if lora else nnx.Param, ...)


def random_state(abstract):
    """Random values of an abstract state's shapes and dtypes, one small jitted program per leaf
    (so at most one leaf is being made at a time): int8 as random bytes, floats ~ N(0, 0.02)
    (timing does not depend on the values; on a TPU an eager draw of a large array hangs)."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(0), len(leaves))

    def one(x, k):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return jax.jit(lambda k: jax.random.bits(k, x.shape, jnp.uint8).astype(x.dtype))(k)
        return jax.jit(lambda k: (0.02 * jax.random.normal(k, x.shape, x.dtype)).astype(x.dtype))(k)

    return jax.tree.unflatten(tree, [one(x, k) for x, k in zip(leaves, keys)])


def dpo_step(graphdef, opt, cfg, batch: int, seq: int, lora: bool, tok):
    """A preference batch (a pair per row: two segments of T/2, prompt then completion) and
    the jitted DPO step (`posttrain.algorithms.dpo`); with LoRA the reference's log-probs come
    from the adapters at zero inside the step, else (precomputed) they are data."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posttrain.algorithms import dpo
    from posttrain.config import DPOSection
    from posttrain.train.step import make_train_step

    half = seq // 2
    seg = np.repeat(np.array([1, 2], np.int32), half)[None].repeat(batch, 0)
    pos = np.tile(np.arange(half, dtype=np.int32), 2)[None].repeat(batch, 0)
    comp = (pos >= half // 2).astype(np.float32)
    nxt = np.zeros_like(comp)
    nxt[:, :-1] = comp[:, 1:] * (seg[:, 1:] == seg[:, :-1])
    data = {"tokens": tok, "targets": np.roll(tok, -1, 1), "positions": pos, "segment_ids": seg,
            "loss_mask": nxt}
    k = seq // 2
    if not lora:
        data.update(ref_chosen=np.full((batch, k), -1.0, np.float32),
                    ref_rejected=np.full((batch, k), -1.0, np.float32))
    data = jax.tree.map(jnp.asarray, data)
    inner = make_train_step(graphdef, opt, dpo.make_loss_fn(DPOSection(beta=0.1)))
    ref_fn = dpo.make_reference_fn(graphdef)

    def step(state, batch_):
        if lora:
            zeros = jax.tree.map(jnp.zeros_like, state.params)
            batch_ = {**batch_, **ref_fn(zeros, state.frozen, batch_)}
        return inner(state, batch_)

    return data, jax.jit(step, donate_argnums=0)


def run_one(shape: str, batch: int, seq: int, steps: int, o: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from posttrain.models.layers import attention_impl
    from posttrain.plan import program_bytes
    from posttrain.train.optimizer import init_opt_state, state_in_dtype
    from posttrain.train.step import TrainState, head_chunk as chunk_of, make_train_step, \
        next_token_loss

    from posttrain.models import layers

    layers.SPLASH_BLOCK, layers.SPLASH_FUSED_BWD = o["block"], bool(o["fused"])
    jax.config.update("jax_exec_time_optimization_effort", o["effort"])
    cfg = model_config(shape, o["head_chunk"], o["remat"], o["attention"], o["params"], o["lora"],
                       o["unroll"], bool(o["headfuse"]))
    cfg = cfg.model_copy(update={"head_major_qkv": bool(o["headmajor"])})
    graphdef, params, rest = build(cfg, o["lora"], o["int8"])
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_matmul = cfg.matmul_params()
    opt = optax.adamw(1e-4)
    if o["moments"] == "bf16":  # optimizer.moments_dtype: bfloat16
        opt = state_in_dtype(opt, jnp.bfloat16)
    elif o["moments"] != "f32":
        raise SystemExit(f"+moments={o['moments']}: f32 or bf16")
    state = TrainState(params, rest, init_opt_state(opt, params), jnp.zeros((), jnp.int32),
                       jax.random.key_data(jax.random.key(0)))
    rng = np.random.default_rng(0)
    tok = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    data = {"tokens": tok, "targets": np.roll(tok, -1, 1),
            "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy(),
            "segment_ids": np.ones((batch, seq), np.int32),
            "loss_mask": np.ones((batch, seq), np.float32)}
    if o["dpo"]:
        data, step = dpo_step(graphdef, opt, cfg, batch, seq, bool(o["lora"]), tok)
    else:
        data = jax.tree.map(jnp.asarray, data)
        step = jax.jit(make_train_step(graphdef, opt, next_token_loss), donate_argnums=0)
    t0 = time.perf_counter()
    compiled = step.lower(state, data).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()  # the program's own bytes: the chip's peak counter misses
    xla_bytes = program_bytes(mem) if mem else None  # its temporaries
    box = [state]

    def once():
        box[0], m = compiled(box[0], data)
        jax.block_until_ready(m)
        return m

    m = once()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        m = once()
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    tps = batch * seq / dt
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    peak = PEAK_TFLOPS.get(jax.default_backend())
    flops = flops_per_token(cfg, n_matmul, seq, weight_grads=not o["lora"]) * tps
    if o["dpo"] and o["lora"]:  # the reference's forward (adapters off), inside the step
        flops += (2 * n_matmul + 2 * cfg.num_hidden_layers * seq * cfg.num_attention_heads
                  * cfg.head_dim / 2) * tps
    res = {"shape": shape, "batch": batch, "seq": seq, "tokens_per_step": batch * seq,
           "head_chunk_positions": chunk_of(cfg, batch, seq), "remat": o["remat"],
           "scan_layers": cfg.scan_layers, "splash_block": o["block"], "splash_fused_bwd": bool(o["fused"]),
           "compile_effort": o["effort"],
           "fused_head_loss": cfg.fused_head_loss,
           "attention": attention_impl(cfg, seq, False), "params_dtype": o["params"],
           "moments_dtype": o["moments"],
           "lora_rank": o["lora"], "int8_base": bool(o["lora"] and o["int8"]),
           "trainable_params": int(n_params), "matmul_params": int(n_matmul),
           "step_s": dt, "tokens_per_s": tps, "tflops": flops / 1e12,
           "mfu": flops / (peak * 1e12) if peak else None,
           "mfu_convention": ("4N (frozen base) + causal attention at half" if o["lora"]
                              else "6N + causal attention at half")
           + (" + the reference's forward (2N)" if o["dpo"] and o["lora"] else ""),
           "algorithm": "dpo" if o["dpo"] else "sft",
           "peak_bytes": stats.get("peak_bytes_in_use"), "xla_bytes": xla_bytes,
           "xla_temp_bytes": mem.temp_size_in_bytes if mem else None, "compile_s": compile_s,
           "loss": float(m["loss"]) if "loss" in m else None, "device": str(dev.device_kind)}
    if o["profile"]:
        from benchmarks.tpu.profile import op_breakdown

        res["profile"] = op_breakdown(once, steps=3, top=80)
        if os.path.isdir(os.environ.get("OUT", "")):  # the compiled program, to read its ops beside the profile's
            Path(os.environ["OUT"], f"{shape}_{batch}x{seq}.hlo.txt").write_text(compiled.as_text())
        # the share of the step the device spends in ops: the rest is host overhead / idle
        res["device_busy"] = res["profile"].get("op_ms_per_step", 0) / (dt * 1e3)
    return res


def child_result(config: str, r: subprocess.CompletedProcess) -> dict:
    """A child process's JSON result (printed after `@@`), or its error: "out of memory", else
    the tail of its output."""
    if r.returncode or "@@" not in r.stdout:
        tail = (r.stderr or r.stdout)[-600:]
        oom = "RESOURCE_EXHAUSTED" in tail or "Out of memory" in tail
        if not oom:
            return {"config": config, "error": tail}
        # the allocator's own line says how much was asked for against what the chip had
        said = [ln for ln in (r.stderr or r.stdout).splitlines()
                if "RESOURCE_EXHAUSTED" in ln or "Out of memory" in ln]
        return {"config": config, "error": "out of memory", "detail": said[-1][-300:]}
    return json.loads(r.stdout.split("@@")[-1])


def save_results(out: str | None, name: str, results: dict) -> None:
    """Written after every run: a command cut short keeps what it measured."""
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_text(json.dumps(results, indent=1))


def peer_config(config: str) -> str:
    """What of `config` Tunix runs: it takes its own settings (remat, splash), so the shape and
    batch, for its Llama (no dtype setting) our rows' bf16 parameters, and our LoRA rows' rank
    and int8 base. Rows that differ only in our settings share one Tunix run."""
    head, *opts = config.split("+")
    keep = [o for o in opts if o.startswith("lora") or o == "int8"
            or (o == "bf16" and head.startswith("llama"))]
    return "+".join([head, *keep])


def tunix_run(config: str, args, ours: dict, done: dict | None = None) -> dict:
    """Tunix's SFT trainer on `config` in a process of its own, with Tunix on its path only,
    and its MFU by the same convention; `vs_ours`: our tokens/s over its. `done`: earlier
    results by `peer_config`, reused (and filled) instead of running the same peer again."""
    base = peer_config(config)
    if done is not None and base in done:
        res = dict(done[base], config=config)
        if "tokens_per_s" in ours and "tokens_per_s" in res:
            res["vs_ours"] = ours["tokens_per_s"] / res["tokens_per_s"]
        return res
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("TUNIX_PATH"), str(ROOT), os.environ.get("PYTHONPATH")]))}
    head = base.split("+")[0]
    keep = base.split("+")[1:]
    cmd = [sys.executable, "-m", "benchmarks.tpu.tunix_sft", "--config", base,
           "--steps", str(4 if args.dry_run else args.steps)] + (["--tiny"] if args.dry_run else [])
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    res = child_result(config, r)
    if "error" in res:
        return {"peer": "tunix", **res}
    shape, b, t, _ = parse_config(head, {})
    cfg = model_config(shape, 0, "full")
    peak = PEAK_TFLOPS.get("tpu") if ours.get("device", "").startswith("TPU") else None
    lora = any(o.startswith("lora") for o in keep)  # 4N: a frozen base, as ours
    flops = flops_per_token(cfg, cfg.matmul_params(), t, weight_grads=not lora) * res["tokens_per_s"]
    res["mfu"] = flops / (peak * 1e12) if peak else None
    if "tokens_per_s" in ours:
        res["vs_ours"] = ours["tokens_per_s"] / res["tokens_per_s"]
    if done is not None:
        done[base] = res
    return res


def main():
    from posttrain.models.layers import SPLASH_BLOCK, SPLASH_FUSED_BWD

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="0.6b:2x2048,0.6b:4x2048,0.6b:8x2048")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--head-chunk", type=int, default=0)
    ap.add_argument("--remat", default="full")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "splash"])
    ap.add_argument("--params", default="f32", choices=["f32", "bf16"],
                    help="parameter (and optimizer moment) dtype; compute is bf16 either way")
    ap.add_argument("--profile", action="store_true", help="op time breakdown of every run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--peer", default="", choices=["", "tunix"],
                    help="tunix: Tunix's PeftTrainer on each configuration too (needs $TUNIX_PATH)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (the test suite)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child: one configuration
    args = ap.parse_args()
    if args.one == "peak":
        print("@@" + json.dumps(matmul_peak()))
        return
    defaults = dict(head_chunk=args.head_chunk, remat=args.remat, attention=args.attention,
                    params=args.params, lora=0, int8=False, profile=args.profile, dpo=False,
                    unroll=False, fused=int(SPLASH_FUSED_BWD), block=SPLASH_BLOCK,
                    effort=0.0, headfuse=1, headmajor=1, moments="f32")
    if args.one:
        shape, b, t, o = parse_config(args.one, defaults)
        print("@@" + json.dumps(run_one(shape, b, t, args.steps, o)))
        return
    configs = ("tiny:2x64,tiny:2x64+lora4+int8+bf16+profile,tiny:2x64+lora4+dpo" if args.dry_run
               else args.configs)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    def child(one: str):  # this process never opens the chip: one process at a time holds it
        return subprocess.run([sys.executable, "-m", "benchmarks.tpu.train_step", "--one", one,
                               "--steps", str(2 if args.dry_run else args.steps),
                               "--head-chunk", str(args.head_chunk), "--remat", args.remat,
                               "--attention", args.attention, "--params", args.params]
                              + (["--profile"] if args.profile else []),
                              cwd=ROOT, env=env, capture_output=True, text=True, check=False)

    r = child("peak")
    peak = json.loads(r.stdout.split("@@")[-1]) if "@@" in r.stdout else None
    print(f"measured bf16 matmul peak {peak} TFLOP/s", flush=True)
    results = {"measured_bf16_peak_tflops": peak, "runs": []}
    peers: dict = {}
    for c in configs.split(","):
        res = child_result(c, child(c))
        results["runs"].append(res)
        print(json.dumps(res), flush=True)
        if args.peer == "tunix" and "+dpo" not in c:  # its SFT trainer: full or LoRA
            results["runs"].append(tunix_run(c, args, res, peers))
            print(json.dumps(results["runs"][-1]), flush=True)
        save_results(args.out, "train_step.json", results)
    if any("error" in r for r in results["runs"]) and args.dry_run:
        sys.exit(1)


if __name__ == "__main__":
    main()
