"""Versioned weight sync from the trainer to rollout engines.

The trainer's parameters leave under HF names (the converter map), so any engine that loads HF
checkpoints can take them:
- colocated JAX engine: the NNX state itself (same model code, nothing converted or copied);
- colocated vLLM engine: torch views over the JAX buffers through DLPack (no copy on CPU);
- Ray workers (disaggregated): host numpy arrays put once in Ray's object store, which every
  worker on the node reads without a copy.
Every engine confirms the version it now serves; bytes and seconds go to the metrics.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from converters.hf import nnx_to_hf
from posttrain.models.config import ModelConfig


def _flat(state: nnx.State) -> dict[tuple, jax.Array]:
    return {tuple(p): v[...] for p, v in nnx.to_flat_state(state)}


def hf_torch_views(state: nnx.State, cfg: ModelConfig) -> dict:
    """HF name -> torch tensor viewing the JAX buffer (DLPack; zero-copy on CPU)."""
    import torch

    flat = {k: torch.utils.dlpack.from_dlpack(v) for k, v in _flat(state).items()}
    return dict(nnx_to_hf(cfg, flat, contiguous=False))


def hf_numpy(state: nnx.State, cfg: ModelConfig) -> dict[str, np.ndarray]:
    flat = {k: np.asarray(jax.device_get(v)) for k, v in _flat(state).items()}
    return dict(nnx_to_hf(cfg, flat))


def push(engines, state: nnx.State, cfg: ModelConfig, version: int) -> dict[str, float]:
    """Send `state` to every engine (in-process engines or a `WorkerGroup`); verify the version."""
    from rollout.jax_engine import JaxEngine
    from rollout.worker import WorkerGroup

    t0 = time.perf_counter()
    nbytes = 0.0
    for eng in engines:
        if isinstance(eng, JaxEngine):
            m = eng.update_weights(state, version)
        elif isinstance(eng, WorkerGroup):
            m = eng.update_weights(hf_numpy(state, cfg), version)
        else:
            m = eng.update_weights(hf_torch_views(state, cfg), version)
        nbytes += m["sync/bytes"]
        served = eng.version if not isinstance(eng, WorkerGroup) else min(eng.versions())
        if served != version:
            raise RuntimeError(f"engine {eng} reports version {served} after a sync to {version}")
    return {"sync/bytes": nbytes, "sync/seconds": time.perf_counter() - t0,
            "sync/version": float(version)}
