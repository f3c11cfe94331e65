"""Versioned weight sync from the trainer to rollout engines.

The trainer's parameters leave under HF names (the converter map), so any engine that loads HF
checkpoints can take them, bucket by bucket over a transport (`rollout.transfer`):
- colocated JAX engine: the NNX state itself (same model code, nothing converted or copied);
- colocated vLLM engine: torch views over the JAX buffers through DLPack (no copy on CPU);
- Ray workers (disaggregated): packed buckets through Ray's object store (pipelined) or a gloo
  broadcast from the trainer's process (`rollout.transport`);
- vLLM in processes of its own (GPUs): vLLM's weight-transfer engines, CUDA IPC when colocated,
  NCCL to Ray workers (`rollout.vllm_transfer`).
Every engine confirms the version it now serves, and then proves it serves the trainer's weights:
it scores a fixed probe (a few token sequences, teacher-forced) and the trainer compares those
log-probs with its own (`check_probe`). A gap beyond the engine's tolerance (fp32: 1e-4 JAX,
1e-3 vLLM; bf16: 5e-2 JAX, 1e-1 vLLM) stops the run with `WeightSyncError` naming the engine:
an engine that kept old weights, loaded a tensor wrong or dropped one would otherwise look like
a slow learner. The probe is scored under the full softmax at temperature 1 whatever the run's
log-prob semantics: it checks weights, not sampling. Bytes, seconds, GB/s and the probe gap go
to the metrics.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from converters.export import EffectiveParams
from posttrain import faults
from converters.hf import nnx_to_hf
from posttrain.models.config import ModelConfig


def hf_torch_views(state: nnx.State, cfg: ModelConfig, lora_scale: float | None = None) -> dict:
    """HF name -> the exporter's in-process view of each tensor (a torch view over the JAX
    buffer where a transpose is due, the JAX array itself otherwise: no copy on CPU; a merged
    LoRA or dequantized int8 kernel is a new array)."""
    from rollout.transfer import Exporter

    exporter = Exporter(state, cfg, lora_scale=lora_scale)
    return {name: v for _, views in exporter.views() for name, v in views}


def hf_numpy(state: nnx.State, cfg: ModelConfig, lora_scale: float | None = None) -> dict[str, np.ndarray]:
    return {name: np.asarray(jax.device_get(v)) for name, v in
            nnx_to_hf(cfg, EffectiveParams(state, lora_scale))}


class WeightSyncError(RuntimeError):
    """An engine serves weights other than the trainer's (found by the probe check)."""


def probe_sequences(vocab_size: int, n: int = 4, length: int = 24, seed: int = 0) -> list[list[int]]:
    """The fixed probe: `n` token sequences drawn once from a seeded RNG (every token id range
    of the vocabulary, so every embedding row can matter)."""
    rng = np.random.default_rng([seed, 0x9E0BE])
    return rng.integers(0, vocab_size, (n, length)).tolist()


def probe_gap(got: list[list[float]], want: list[list[float]]) -> float:
    """Largest |engine - trainer| log-prob over the probe (NaN if either side has one)."""
    return max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)))) for g, w in zip(got, want))


def _engine_scores(eng, sequences):
    from rollout.worker import WorkerGroup

    if isinstance(eng, WorkerGroup):
        return eng.scores(sequences)
    return [(f"{type(eng).__name__} (in process)", eng.probe_tolerance, eng.score(sequences))]


def check_probe(engines, model, sequences: list[list[int]], version: int) -> float:
    """Every engine scores the probe; the trainer scores it with its own code (`model`: the
    policy, or a function sequences -> log-probs such as `Trainer.score`). Returns the largest
    gap; raises `WeightSyncError` naming the first engine beyond its tolerance."""
    from rollout.jax_engine import score_sequences

    want = (score_sequences(model, sequences) if isinstance(model, nnx.Module)
            else model(sequences))
    worst = 0.0
    for eng in engines:
        for name, tol, got in _engine_scores(eng, sequences):
            gap = probe_gap(got, want)
            if not gap <= tol:  # NaN fails too
                raise WeightSyncError(
                    f"{name} does not serve the trainer's weights after the sync to version "
                    f"{version}: probe log-prob gap {gap:.3g} > tolerance {tol:g} (stale, partial "
                    "or wrongly converted weights)")
            worst = max(worst, gap)
    return worst


def push(engines, state, cfg: ModelConfig, version: int, *, probe=None,
         model: nnx.Module | None = None, lora_scale: float | None = None,
         transport: str = "auto", bucket_bytes: int | None = None,
         check_digest: bool = False, timeout_s: float = 600.0) -> dict[str, float]:
    """Send `state` (an NNX state, or a trainer: `posttrain.train.trainer`, whose exporter
    and probe scores are used, so that a multi-host trainer exports from its own processes)
    to every engine (in-process engines or a `WorkerGroup`) over `transport`
    (`rollout.transfer.make_transport`; the transport of an engine is kept between syncs);
    verify the version and, given `probe` sequences and the trainer's `model`, the weights
    (`check_probe`). Engines that take HF tensors get the effective weights (LoRA merged with
    `lora_scale`, int8 dequantized) in their layout and dtype; the colocated JAX engine runs
    the trainer's own modules on its state. With `check_digest` every engine also hashes what
    it loaded and the hash must equal the exporter's (`sync/digest_ok`): bitwise delivery."""
    from rollout.jax_engine import JaxEngine
    from rollout.transfer import DEFAULT_BUCKET_BYTES, Exporter, export_digest, make_transport
    from rollout.worker import WorkerGroup

    trainer = None if isinstance(state, nnx.State) else state
    if trainer is not None:
        model = trainer.score
    t0 = time.perf_counter()
    nbytes, buckets = 0.0, 0.0
    for eng in engines:
        faults.point("weight_sync")
        if isinstance(eng, JaxEngine) and transport in ("auto", "in_process"):
            m = eng.update_weights(state if trainer is None else trainer.policy_state(), version)
        else:
            tr = getattr(eng, "_posttrain_transport", None)
            if tr is None or tr.requested != transport:
                if tr is not None:
                    tr.close()
                tr = make_transport(transport, eng, timeout_s=timeout_s)
                tr.requested = transport
                eng._posttrain_transport = tr
            kw = dict(layout=eng.weight_layout, dtype=eng.weight_dtype, lora_scale=lora_scale,
                      bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES)
            exporter = (Exporter(state, cfg, **kw) if trainer is None else trainer.exporter(**kw))
            m = tr.send(exporter, version, check_digest)
            buckets += m["sync/buckets"]
            if check_digest:
                want = export_digest(exporter)
                got = ([eng.last_digest] if not isinstance(eng, WorkerGroup)
                       else eng.call_all("last_digest"))
                if any(g != want for g in got):
                    raise WeightSyncError(f"{eng}: the tensors loaded differ from those sent "
                                          f"(digests {got} != {want})")
        nbytes += m["sync/bytes"]
        served = eng.version if not isinstance(eng, WorkerGroup) else min(eng.versions())
        if served != version:
            raise WeightSyncError(f"engine {eng} reports version {served} after a sync to {version}")
    seconds = time.perf_counter() - t0
    out = {"sync/bytes": nbytes, "sync/seconds": seconds, "sync/gbps": nbytes / seconds / 1e9,
           "sync/version": float(version), "sync/buckets": buckets}
    if probe is not None:
        t0 = time.perf_counter()
        out["sync/probe_gap"] = check_probe(engines, model, probe, version)
        out["sync/probe_seconds"] = time.perf_counter() - t0
    return out
