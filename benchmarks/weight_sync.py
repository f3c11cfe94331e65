"""Seconds and peak memory per weight sync, trainer -> rollout engines, for the reference model
(3.3M parameters) and a ~500M-parameter one (Qwen3 architecture: hidden 1024, 32 layers,
16 heads x 128, 8 KV heads, MLP 3072; 503M parameters), each path as the pipeline runs it:

- `memcpy`: the reference for the in-process paths: a host copy of every array of the state
- `jax`: colocated JAX engine, the trainer's NNX state handed over in memory (the engine takes
  its own copy: the trainer donates its buffers to the next step);
- `vllm_reload` (the in-process path before buckets): one `reload_weights` of every view;
- `vllm`: colocated vLLM engine, bucket by bucket of HF-named torch views over the JAX buffers
  (DLPack, no copy on CPU) loaded in place, prefix cache reset;
- `ray_put` (the path before buckets, the baseline): every HF tensor exported to numpy, the
  whole dict put once in Ray's object store, loaded by each worker (`WorkerGroup.update_weights`);
- `object_store`: packed buckets (`--bucket-mb`), one `ray.put` each, pipelined;
- `collective`: packed buckets broadcast over a gloo group from the trainer's process.
The Ray paths go to `--workers` JAX engine workers (`--engine vllm` for vLLM workers).

    python -m benchmarks.weight_sync [--sizes ref,500m] [--paths jax,vllm_reload,vllm,ray_put,...]
                                     [--workers 1,2] [--reps 2] [--bucket-mb 256]

Each (size, path, workers) runs in its own process; best of `reps` syncs after one warm-up sync.
Peak RSS (VmHWM) of the trainer and of each worker is reset after the warm-up (`clear_refs`), so
it is the peak of the measured syncs, printed beside the model's bytes and the bucket size: the
trainer's peak above its resident size before the syncs is what a sync costs it. Then the probe
check that ends every pipeline sync (`rollout.weight_sync.check_probe`): seconds and gap, for the
teacher-forced probe alone (`tf`, the probe before it covered the sampling path) and for the
probe with its sampling path (`both`), alternating in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # save_tiny_model_with_tokenizer arguments
    "ref": {"hidden": 256, "inter": 768, "layers": 4, "heads": 4, "kv": 2, "head_dim": 64},
    "500m": {"hidden": 1024, "inter": 3072, "layers": 32, "heads": 16, "kv": 8, "head_dim": 128},
}
RAY_PATHS = ("ray_put", "object_store", "collective")

CHILD = r'''
import json, os, re, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, ".")
path, model_dir, reps, workers, bucket_mb, engine = sys.argv[1:7]
reps, workers, bucket_mb = int(reps), int(workers), int(bucket_mb)

def rss(pid="self"):
    s = open(f"/proc/{pid}/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}

import threading
peaks = {"RssAnon": 0, "RssShmem": 0}
def sample(stop):  # the private / shared split of the trainer's RSS, polled during the syncs
    while not stop.is_set():
        s = open("/proc/self/status").read()
        for k in peaks:
            peaks[k] = max(peaks[k], int(re.search(rf"{k}:\s+(\d+) kB", s).group(1)) * 1024)
        stop.wait(0.005)

def reset_peak(pid="self"):
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")

import jax
from flax import nnx
from posttrain.models import from_pretrained
from rollout.weight_sync import hf_numpy, push
model = from_pretrained(model_dir, scan_layers=False)
state = nnx.state(model)
n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
bucket = bucket_mb << 20
pids = []
if path in ("jax", "memcpy"):
    from rollout.jax_engine import JaxEngine
    eng = JaxEngine(from_pretrained(model_dir, scan_layers=False), None, copy_weights=True)
    sync = lambda v: push([eng], state, model.cfg, v)
    if path == "memcpy":  # the reference: one host memcpy of every array of the state
        import numpy as np
        leaves = [np.asarray(x) for x in jax.tree.leaves(state)]
        sync = lambda v: [np.copy(a) for a in leaves]
elif path == "vllm":
    from rollout.vllm_engine import VllmEngine
    # room for the 500M model's weights (2 GB) and its KV cache in vLLM-CPU's memory budget
    eng = VllmEngine(model_dir, gpu_memory_utilization=0.4, enforce_eager=True)
    sync = lambda v: push([eng], state, model.cfg, v, bucket_bytes=bucket)
elif path == "vllm_reload":  # the in-process path before buckets: one reload_weights of all views
    from rollout.vllm_engine import VllmEngine, _refresh_embedding_gemms, _to_torch
    from rollout.weight_sync import hf_torch_views
    eng = VllmEngine(model_dir, gpu_memory_utilization=0.4, enforce_eager=True)
    def sync(v):
        tensors = [(n, _to_torch(a)) for n, a in hf_torch_views(state, model.cfg).items()]
        def load(worker):
            worker.model_runner.reload_weights(weights_iterator=iter(tensors))
            _refresh_embedding_gemms(worker.model_runner.get_model())
        eng.llm.collective_rpc(load)
        eng.llm.reset_prefix_cache()
        eng.version = v
else:
    import ray
    from rollout.worker import WorkerGroup
    ray.init(include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    spec = ({"kind": "jax", "model_dir": model_dir, "scan_layers": False} if engine == "jax" else
            {"kind": "vllm", "model_dir": model_dir,
             "vllm": {"gpu_memory_utilization": 0.2, "enforce_eager": True, "max_model_len": 512}})
    eng = WorkerGroup(spec, workers)
    pids = ray.get([w.pid.remote() for w in eng.workers])
    if path == "ray_put":  # the whole model as one object, as before buckets
        def sync(v):
            eng.update_weights(hf_numpy(state, model.cfg), v)
            assert min(eng.versions()) == v
    else:
        sync = lambda v: push([eng], state, model.cfg, v, transport=path, bucket_bytes=bucket)
sync(1)
before = rss()["VmRSS"]
for p in ["self", *pids]:
    reset_peak(p)
anon_before = int(re.search(r"RssAnon:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
stop = threading.Event(); sampler = threading.Thread(target=sample, args=(stop,)); sampler.start()
best = 1e9
for v in range(2, reps + 2):
    t0 = time.perf_counter(); sync(v); best = min(best, time.perf_counter() - t0)
stop.set(); sampler.join()
trainer_peak = rss()["VmHWM"]
worker_peak = max([rss(p)["VmHWM"] for p in pids], default=0)
# the probe check that ends every sync in the pipeline: engine and trainer score 4 x 24 tokens
# teacher-forced (the probe before the sampling path: "tf"), and the engine's sampling path
# generates 24 x 32 tokens from the probe's prefixes, which the trainer re-scores ("both")
from rollout.weight_sync import check_probe, probe_sequences
probe = probe_sequences(model.cfg.vocab_size)
probe_best, gap = {}, {}
for kind in ("tf", "both"):
    check_probe([eng], model, probe, v, sampling=kind == "both")  # compiles
probe_best = {"tf": 1e9, "both": 1e9}
for _ in range(reps):
    for kind in ("tf", "both"):  # alternating
        t0 = time.perf_counter(); m = check_probe([eng], model, probe, v, sampling=kind == "both")
        probe_best[kind] = min(probe_best[kind], time.perf_counter() - t0)
        gap[kind] = max(m["sync/probe_gap"], m.get("sync/probe_sampled_gap", 0.0))
print("@@" + json.dumps({"seconds": best, "params": int(n_params), "probe_seconds": probe_best,
                         "probe_gap": gap, "trainer_before": before, "trainer_peak": trainer_peak,
                         "worker_peak": worker_peak, "anon_before": anon_before,
                         "anon_peak": peaks["RssAnon"], "shmem_peak": peaks["RssShmem"]}))
os._exit(0)
'''


def run_one(path, d, reps, workers, bucket_mb, engine):
    r = subprocess.run([sys.executable, "-c", CHILD, path, str(d), str(reps), str(workers),
                        str(bucket_mb), engine], cwd=ROOT, capture_output=True, text=True,
                       check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.split("@@")[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="ref,500m")
    ap.add_argument("--paths", default="jax,vllm_reload,vllm,ray_put,object_store,collective")
    ap.add_argument("--workers", default="1,2", help="Ray workers (Ray paths)")
    ap.add_argument("--engine", default="jax", choices=["jax", "vllm"], help="Ray workers' engine")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=256)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.helpers import save_tiny_model_with_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sync_bench_"))
    gib = 1 << 30
    print(f"buckets of {args.bucket_mb} MiB; RSS in GiB: trainer before the syncs / its peak "
          "during them (VmHWM), its private memory (RssAnon) before / peak, the peak of the "
          "shared memory it mapped (RssShmem: Ray's object store), the largest worker peak")
    print(f"{'model':<6}{'params':>13}{'path':>14}{'workers':>8}{'seconds':>9}{'GB/s':>7}"
          f"{'vs ray_put':>11}{'trainer':>12}{'private':>12}{'shared':>7}{'worker':>7}"
          f"{'probe s: tf':>12}{'both':>7}{'gap: tf':>9}{'both':>9}")
    for size in args.sizes.split(","):
        d = work / size
        save_tiny_model_with_tokenizer(d, "qwen3", **SIZES[size])
        base = {}
        for path in args.paths.split(","):
            for workers in (args.workers.split(",") if path in RAY_PATHS else ["0"]):
                res = run_one(path, d, args.reps, int(workers), args.bucket_mb, args.engine)
                if path == "ray_put":
                    base[workers] = res["seconds"]
                ratio = (f"{base[workers] / res['seconds']:.1f}x" if workers in base
                         and path in RAY_PATHS else "")
                gbs = res["params"] * 4 / res["seconds"] / 1e9
                mem = f"{res['trainer_before'] / gib:.2f}/{res['trainer_peak'] / gib:.2f}"
                anon = f"{res['anon_before'] / gib:.2f}/{res['anon_peak'] / gib:.2f}"
                wk = f"{res['worker_peak'] / gib:.2f}" if res["worker_peak"] else "-"
                print(f"{size:<6}{res['params']:>13,}{path:>14}{workers:>8}{res['seconds']:>9.3f}"
                      f"{gbs:>7.2f}{ratio:>11}{mem:>12}{anon:>12}{res['shmem_peak'] / gib:>7.2f}"
                      f"{wk:>7}{res['probe_seconds']['tf']:>12.3f}{res['probe_seconds']['both']:>7.3f}"
                      f"{res['probe_gap']['tf']:>9.1e}{res['probe_gap']['both']:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
