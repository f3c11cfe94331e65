"""Ray, the coordinator: join `ray.address`, or start a local Ray (the embedded default)."""

from __future__ import annotations

import math
import os

from posttrain.config import RunConfig


def init_ray(cfg: RunConfig) -> None:
    """Once per process. A local Ray gets enough logical CPUs for the trainer group's
    reservations plus room to schedule the rollout workers (on a laptop they share the cores)."""
    import jax
    import ray

    if ray.is_initialized():
        return
    env = ({"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}}
           if jax.default_backend() == "cpu" else None)
    if cfg.ray.address is not None:
        ray.init(address=cfg.ray.address, include_dashboard=False, log_to_driver=False,
                 runtime_env=env)
        return
    t = cfg.trainer
    need = (math.ceil(t.hosts * t.cpus_per_host) if t.hosts > 1 else 0) + 1
    ray.init(include_dashboard=False, log_to_driver=False, runtime_env=env,
             num_cpus=max(os.cpu_count() or 1, need))
