"""Where the GRPO update's time goes, op by op, on the reference workload of `grpo_step.py`.

    python -m benchmarks.grpo_update_profile [--top 25]

Builds the pipeline's own jitted update (`make_train_step` with the GRPO loss) for the 3.3M
reference model on a [64, 96] batch (8 x 8 completions of <= 64 tokens after ~20-token prompts,
padded to the pipeline's 32-token bucket), times it, then traces three steps with the JAX profiler
and charges the wall clock to the XLA:CPU thunks (`benchmarks.common.op_times`: two ops that run
at once on the two cores share the interval), summed by kind (`ynn_fusion`: YNNPACK dot fusions,
i.e. the matmuls; the rest element-wise, copy and transpose fusions).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import donating_calls, op_kinds, op_times  # noqa: E402

B, T = 64, 96


def build(work: Path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import yaml
    from flax import nnx

    from benchmarks.grpo_step import RECIPE
    from posttrain.config import resolve_stages
    from posttrain.algorithms.grpo import make_loss_fn
    from posttrain.sharding import make_mesh, use_mesh
    from posttrain.train.loop import prepare_tokenizer, resolve_model_config
    from posttrain.train.trainer import create_model
    from posttrain.train.optimizer import init_opt_state, lr_schedule, make_optimizer
    from posttrain.train.step import TrainState, make_train_step
    from tests.helpers import save_tiny_model_with_tokenizer

    save_tiny_model_with_tokenizer(work / "model", "qwen3", hidden=256, inter=768, layers=4, heads=4,
                                   kv=2, head_dim=64)
    cfg = resolve_stages(yaml.safe_load(RECIPE.format(run_dir=work / "run", model=work / "model",
                                                      steps=10, extra="")))[0]
    tok = prepare_tokenizer(cfg, work / "run")
    mesh = make_mesh(cfg.mesh)
    with use_mesh(mesh, cfg.mesh.rules):
        model = create_model(cfg, resolve_model_config(cfg, tok), mesh)
        graphdef, params, frozen = nnx.split(model, nnx.Param, ...)
        opt = make_optimizer(cfg.optimizer, 100)
        state = TrainState(params, frozen, init_opt_state(opt, params), jnp.zeros((), jnp.int32),
                           jax.random.key_data(jax.random.key(0)))
        step = jax.jit(make_train_step(graphdef, opt, make_loss_fn(cfg), 1,
                                       lr_schedule(cfg.optimizer, 100)), donate_argnums=0)
    rng = np.random.RandomState(0)
    mask = np.zeros((B, T), np.float32)
    mask[:, 20:84] = 1
    batch = {"tokens": rng.randint(0, 400, (B, T)), "targets": rng.randint(0, 400, (B, T)),
             "positions": np.broadcast_to(np.arange(T), (B, T)), "segment_ids": np.ones((B, T)),
             "loss_mask": mask, "logp_rollout": np.zeros((B, T), np.float32),
             "kept_counts": np.zeros((B, T), np.int32), "advantages": rng.randn(B).astype(np.float32)}
    batch = {k: jnp.asarray(v, jnp.float32 if v.dtype.kind == "f" else jnp.int32) for k, v in batch.items()}
    return step, state, batch


def main() -> None:
    import jax

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    from posttrain import host_memory

    host_memory.keep_freed_memory()  # as `posttrain run` does, before JAX runs
    work = Path(tempfile.mkdtemp(prefix="grpo_update_profile_"))
    step, state, batch = build(work)
    for _ in range(3):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    print(f"update step [{B}, {T}]: {min(times):.3f} s (best of 5)")
    ops = op_times(donating_calls(step, state, batch), 3)
    kinds = op_kinds(ops)
    total = sum(kinds.values())
    print(f"busy {total:.0f} ms per step (wall clock: ops that run at once on the two cores share "
          f"it; their own times add up to {sum(t.op for t in ops.values()):.0f} ms), by kind:")
    for kind, ms in list(kinds.items())[:args.top]:
        print(f"  {ms:8.1f} ms  {100 * ms / total:5.1f}%  {kind}")
    print("largest ops (wall ms; own time):")
    for name, t in sorted(ops.items(), key=lambda kv: -kv[1].wall)[:args.top]:
        print(f"  {t.wall:8.1f} ms  {t.op:8.1f} ms  {name}")


if __name__ == "__main__":
    main()
