"""Steps/s of the trainer as a 2-host group (2 Ray actors x 2 CPU devices, gloo between them)
against one process with the same 4 devices, on the same workload, side by side in one script;
and the in-process `Trainer` against the bare jitted step it wraps (the default path's cost).

    python benchmarks/trainer_group.py [--steps 10] [--batch 16] [--seq 256]

The workload is the reference model (3.3M parameters, fp32, AdamW) on packed random tokens.
Each timed step includes fetching its metrics (every variant waits for the step to finish).
The group's overhead per step is split into what the driver pays to reach the hosts (a no-op
call to every rank and back: Ray's dispatch) and the rest (the batch slices' transfer,
gloo's cross-process collectives against XLA's in-process ones).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import REFERENCE, matmul_peak_gflops, train_flops_per_token  # noqa: E402


def config(run_dir: Path, steps: int, batch: int, seq: int, hosts: int):
    from posttrain.config import load_recipe

    model = REFERENCE.model_dump(mode="json", include={
        "arch", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "tie_word_embeddings", "max_position_embeddings"})
    over = [f"run_dir={run_dir}", f"train.steps={steps}", f"train.batch_size={batch}",
            f"data.seq_len={seq}", "checkpoint.every=0", "checkpoint.resume=false",
            "tracking.wandb.enabled=false", "model.scan_layers=false",
            f"model.config={json.dumps(model)}"]
    if hosts > 1:
        over += [f"trainer.hosts={hosts}", "trainer.devices_per_host=2"]
    (cfg,) = load_recipe(str(Path(__file__).parents[1] / "recipes/pretrain_tiny.yaml"), over)
    return cfg


def batches(n: int, batch: int, seq: int) -> list[dict]:
    from benchmarks.train_step import make_batch

    return [jax.tree.map(np.asarray, make_batch(batch, seq, seed=i)) for i in range(n)]


def time_steps(step, data: list[dict], warmup: int = 3) -> float:
    """Seconds per step (median) of `step(batch)()` after `warmup` steps."""
    for b in data[:warmup]:
        step(b)()
    times = []
    for b in data[warmup:]:
        t0 = time.perf_counter()
        step(b)()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from posttrain.models.config import ModelConfig
    from posttrain.sharding import batch_sharding
    from posttrain.train.group import TrainerGroup
    from posttrain.train.trainer import Trainer

    peak = matmul_peak_gflops()
    model_cfg = ModelConfig(**{**REFERENCE.model_dump(), "scan_layers": False})
    data = batches(args.steps + 3, args.batch, args.seq)
    tokens = args.batch * args.seq
    out = {"devices": 4, "batch": args.batch, "seq": args.seq, "matmul_peak_gflops": peak}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        one = Trainer(config(tmp / "one", 1000, args.batch, args.seq, 1), tmp / "one", model_cfg)

        def bare(b):  # the jitted step the Trainer wraps, called as the loop did before it
            dev = {k: jax.device_put(v, batch_sharding(one.mesh, one.rules, v.ndim))
                   for k, v in b.items()}
            one.state, m = one.step_fn(one.state, dev)
            return lambda: jax.device_get(m)

        for _ in range(args.rounds):  # alternating: the machine's noise falls on both
            for k, f in (("bare_step_s", bare), ("one_process_s", one.train_step)):
                out[k] = min(out.get(k, float("inf")), time_steps(f, data))
        one.close()
        group = TrainerGroup(config(tmp / "group", 1000, args.batch, args.seq, 2), tmp / "group",
                             model_cfg)
        try:
            out["group_s"] = min(time_steps(group.train_step, data) for _ in range(args.rounds))
            rtts = []
            for _ in range(20):
                t0 = time.perf_counter()
                group._gather([h.info.remote() for h in group.hosts], "a no-op")
                rtts.append(time.perf_counter() - t0)
            out["dispatch_s"] = float(np.median(rtts))
        finally:
            group.close()
    out["batch_bytes"] = float(sum(v.nbytes for v in data[0].values()))
    out["group_vs_one"] = out["one_process_s"] / out["group_s"]
    out["overhead_per_step_s"] = out["group_s"] - out["one_process_s"]
    out["trainer_vs_bare"] = out["bare_step_s"] / out["one_process_s"]
    flops = train_flops_per_token(model_cfg, args.seq) * tokens
    for k in ("bare_step_s", "one_process_s", "group_s"):
        out[k[:-2] + "_mfu"] = flops / out[k] / 1e9 / peak
    print(f"matmul peak {peak:.0f} GFLOP/s; 4 CPU devices; batch {args.batch} x {args.seq}")
    print(f"  bare jitted step      {out['bare_step_s'] * 1e3:8.1f} ms/step "
          f"({1 / out['bare_step_s']:.2f} steps/s)")
    print(f"  Trainer (in process)  {out['one_process_s'] * 1e3:8.1f} ms/step "
          f"({1 / out['one_process_s']:.2f} steps/s)  {out['trainer_vs_bare']:.3f}x the bare step")
    print(f"  TrainerGroup 2 x 2    {out['group_s'] * 1e3:8.1f} ms/step "
          f"({1 / out['group_s']:.2f} steps/s)  {out['group_vs_one']:.3f}x one process")
    print(f"  group overhead {out['overhead_per_step_s'] * 1e3:.1f} ms/step, of which Ray "
          f"dispatch to both ranks and back {out['dispatch_s'] * 1e3:.1f} ms; batch "
          f"{out['batch_bytes'] / 1e6:.2f} MB per step")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
