"""Rollout output tokens/s, side by side: our JAX engine, our vLLM engine, standalone vLLM and
transformers' generate, on the reference workload (64 prompts x 64 new tokens, temperature 1,
the 3.3M-parameter model), plus seconds per weight sync.

    python -m benchmarks.rollout_throughput [--shape reference|large] [--kinds ...] [--rounds 2]

`--shape large`: hidden 512, 8 layers, 8 heads x 64, 4 KV heads, MLP 1536 (~25M parameters; the
vocabulary stays the local tokenizer's 512 so that every engine can detokenize what it samples).

Each contender runs in its own process (vLLM and torch own process-wide state), alternating over
rounds; in each, the best of 8 generations after a warm-up; the best round counts (every round
is printed). Every completion is forced to 64 tokens (no stop token) so all sides produce the
same number of tokens.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, NEW = 64, 64
SHAPES = {"reference": dict(hidden=256, inter=768, layers=4, heads=4, kv=2, head_dim=64),
          "large": dict(hidden=512, inter=1536, layers=8, heads=8, kv=4, head_dim=64)}

CHILD = r'''
import json, os, statistics, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, ".")
kind, model_dir = sys.argv[1], sys.argv[2]
import numpy as np
rng = np.random.default_rng(0)
prompts = [rng.integers(3, 400, int(rng.integers(8, 24))).tolist() for _ in range(%(P)d)]
N = %(N)d
def timed(fn, reps=8):
    fn(); best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); n = fn(); best = min(best, time.perf_counter() - t0)
    return n / best
if kind == "jax":
    from posttrain.models import from_pretrained
    from rollout.engine import SamplingParams
    from rollout.jax_engine import JaxEngine
    # unrolled layers, as the tiny recipes configure a 4-layer model (per-layer KV buffers)
    eng = JaxEngine(from_pretrained(model_dir, scan_layers=False), None)
    sp = SamplingParams(temperature=1.0, max_tokens=N, seed=0, ignore_eos=True)
    tps = timed(lambda: sum(len(r.token_ids) for r in eng.generate(prompts, sp)))
    import jax
    from flax import nnx
    st = nnx.state(from_pretrained(model_dir, scan_layers=False))
    t0 = time.perf_counter(); eng.update_weights(st, 1); sync = time.perf_counter() - t0
elif kind == "vllm_same":
    # One LLM (our engine's), three requests alternated in one process: process-to-process
    # variance on these shared cores is larger than the differences measured here.
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from rollout.engine import SamplingParams
    from rollout.vllm_engine import VllmEngine
    eng = VllmEngine(model_dir, gpu_memory_utilization=0.15)
    tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    def raw(**extra):
        sp = VSP(temperature=1.0, max_tokens=N, ignore_eos=True, seed=0, **extra)
        return lambda: sum(len(o.outputs[0].token_ids) for o in eng.llm.generate(tp, sp, use_tqdm=False))
    ours_sp = SamplingParams(temperature=1.0, max_tokens=N, seed=0, ignore_eos=True)
    fns = {"no_logprobs": raw(), "logprobs": raw(logprobs=0, flat_logprobs=True, detokenize=False),
           "engine": lambda: sum(len(r.token_ids) for r in eng.generate(prompts, ours_sp))}
    for f in fns.values():
        f()
    rates = {k: [] for k in fns}
    for _ in range(5):
        for k, f in fns.items():
            t0 = time.perf_counter(); n = f(); rates[k].append(n / (time.perf_counter() - t0))
    print("@@" + json.dumps({"tokens_per_s": max(rates["engine"]), "sync_s": None,
                             "same": {k: statistics.median(v) for k, v in rates.items()}}))
    sys.exit(0)
elif kind in ("vllm_ours", "vllm_raw"):
    from vllm import LLM, SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    if kind == "vllm_ours":
        from rollout.engine import SamplingParams
        from rollout.vllm_engine import VllmEngine
        eng = VllmEngine(model_dir, gpu_memory_utilization=0.15)
        sp = SamplingParams(temperature=1.0, max_tokens=N, seed=0, ignore_eos=True)
        tps = timed(lambda: sum(len(r.token_ids) for r in eng.generate(prompts, sp)))
        from posttrain.models import from_pretrained
        from rollout.weight_sync import hf_torch_views
        m = from_pretrained(model_dir)
        from flax import nnx
        views = hf_torch_views(nnx.state(m, nnx.Param), m.cfg)
        t0 = time.perf_counter(); eng.update_weights(views, 1); sync = time.perf_counter() - t0
    else:
        llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.15, seed=0)
        sp = VSP(temperature=1.0, max_tokens=N, ignore_eos=True, seed=0)
        tps = timed(lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)))
        sync = None
else:
    import torch
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    def gen():
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=N,
                             min_new_tokens=N, pad_token_id=0)
        return (out.shape[1] - L) * out.shape[0]
    tps = timed(gen, reps=1); sync = None
print("@@" + json.dumps({"tokens_per_s": tps, "sync_s": sync}))
''' % {"P": PROMPTS, "N": NEW}


def child(kind: str, model_dir: Path) -> dict:
    from benchmarks.common import peer_environ

    # glibc's malloc defaults for all: our engines as `posttrain generate` and Ray rollout
    # workers run them (posttrain/host_memory.py), the peers as they ship
    r = subprocess.run([sys.executable, "-c", CHILD, kind, str(model_dir)], cwd=ROOT,
                       capture_output=True, text=True, env=peer_environ())
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.split("@@")[-1])


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="jax,vllm_ours,vllm_raw,hf,vllm_same",
                    help="comma-separated subset of jax,vllm_ours,vllm_raw,hf,vllm_same (vllm_raw is "
                         "the reference; vllm_same: one LLM, three requests alternated in-process)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shape", default="reference", choices=list(SHAPES))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.helpers import save_tiny_model_with_tokenizer

    d = Path(tempfile.mkdtemp(prefix="rollout_bench_"))
    # the reference model: hidden 256, 4 layers, 4 heads x 64, 2 KV heads, MLP 768, tied
    save_tiny_model_with_tokenizer(d, "qwen3", **SHAPES[args.shape])
    from benchmarks.common import matmul_peak_gflops, steal_report, with_steal

    print(f"shape {args.shape}: {SHAPES[args.shape]}; matmul peak measured now: "
          f"{matmul_peak_gflops():.0f} GFLOP/s (f32)")
    kinds = args.kinds.split(",")
    if "vllm_raw" not in kinds:
        kinds.append("vllm_raw")
    res = {k: [] for k in kinds}
    stolen = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for k in kinds:
            r, st = with_steal(lambda k=k: child(k, d))
            res[k].append(r)
            stolen[k].append(st)
    best = {k: max(x["tokens_per_s"] for x in v) for k, v in res.items()}
    names = {"jax": "posttrain JAX engine", "vllm_ours": "posttrain vLLM engine",
             "vllm_raw": "standalone vLLM", "hf": "transformers generate"}
    print(f"{'engine':<24}{'output tokens/s':>16}{'vs standalone vLLM':>20}{'weight sync s':>15}")
    for k in kinds:
        if k == "vllm_same":
            continue
        sync = min((x["sync_s"] for x in res[k] if x["sync_s"] is not None), default=None)
        print(f"{names[k]:<24}{best[k]:>16.0f}{best[k] / best['vllm_raw']:>19.2f}x"
              f"{'' if sync is None else f'{sync:>15.4f}'}")
    print("all rounds (tokens/s): " + json.dumps(
        {k: [round(x["tokens_per_s"]) for x in v] for k, v in res.items() if k != "vllm_same"}))
    print(steal_report(stolen))
    if "vllm_same" in res:
        print_same_llm(res["vllm_same"])


def print_same_llm(runs: list[dict]) -> None:
    """Medians over the rounds of the in-process medians: standalone requests with and without the
    sampled token's logprob against our engine's `generate`, on the same LLM."""
    keys = ("no_logprobs", "logprobs", "engine")
    med = {k: statistics.median(r["same"][k] for r in runs) for k in keys}
    print("\nsame LLM, alternated in one process (median tokens/s):")
    labels = {"no_logprobs": "standalone request, no logprobs",
              "logprobs": "standalone request, logprobs=0 (flat, no detokenize)",
              "engine": "posttrain VllmEngine.generate"}
    for k in keys:
        print(f"  {labels[k]:<56}{med[k]:>8.0f}{med[k] / med['no_logprobs']:>8.2f}x"
              f"{med[k] / med['logprobs']:>8.2f}x vs same request")


if __name__ == "__main__":
    main()
