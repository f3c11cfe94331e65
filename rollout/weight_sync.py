"""Versioned weight sync from the trainer to rollout engines.

The trainer's parameters leave under HF names (the converter map), so any engine that loads HF
checkpoints can take them, bucket by bucket over a transport (`rollout.transfer`):
- colocated JAX engine: the NNX state itself (same model code, nothing converted or copied);
- colocated vLLM engine: torch views over the JAX buffers through DLPack (no copy on CPU);
- Ray workers (disaggregated): packed buckets through Ray's object store (pipelined) or a gloo
  broadcast from the trainer's process (`rollout.transfer`);
- vLLM in processes of its own (GPUs): vLLM's weight-transfer engines, CUDA IPC when colocated,
  NCCL to Ray workers (`rollout.vllm_transfer`).
Every engine confirms the version it now serves, and then proves it serves the trainer's weights
with a fixed probe (`check_probe`), in two ways:
- teacher-forced: it scores a few token sequences with a full forward pass;
- through its sampling path: it generates from prefixes of those sequences exactly as a rollout
  does (prefill, plain and packed on the JAX engine; the KV cache repeated for n samples; the
  cached decode over a growing cache; its sampler's log-probs), and the trainer re-scores what
  it sampled. A fault confined to that path (adapters skipped in the prefill, a stale KV-cache
  layout, a sampler that scores other logits) passes a teacher-forced check and would make the
  run sample from another policy than the one it trains.
A gap beyond the engine's tolerance (fp32: 1e-4 JAX, 1e-3 vLLM; bf16: 5e-2 JAX, 1e-1 vLLM)
stops the run with `WeightSyncError` naming the engine and the path: an engine that kept old
weights, loaded a tensor wrong or dropped one would otherwise look like a slow learner. The
probe samples at temperature 1 from the full softmax whatever the run's sampling settings: it
checks weights and the forward the engine runs, not the run's truncation. Bytes, seconds, GB/s
and the probe gap go to the metrics.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from posttrain import faults
from posttrain.models.config import ModelConfig
from posttrain.models.export import EffectiveParams
from posttrain.models.hf import nnx_to_hf
from rollout.buckets import DEFAULT_BUCKET_BYTES, Exporter, export_digest
from rollout.engine import engine_probe
from rollout.jax_engine import JaxEngine, score_sequences
from rollout.transfer import make_transport
from rollout.worker import WorkerGroup


def hf_torch_views(state: nnx.State, cfg: ModelConfig, lora_scale: float | None = None) -> dict:
    """HF name -> the exporter's in-process view of each tensor (a torch view over the JAX
    buffer where a transpose is due, the JAX array itself otherwise: no copy on CPU; a merged
    LoRA or dequantized int8 kernel is a new array)."""

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


def _engine_probes(eng, sequences, version: int, sampling: bool) -> list[tuple[str, dict]]:

    if isinstance(eng, WorkerGroup):
        return eng.probes(sequences, version, sampling)
    return [(f"{type(eng).__name__} (in process)", engine_probe(eng, sequences, version, sampling))]


def sampled_gap(rollouts, rescored: list[list[float]]) -> float:
    """Largest |engine - trainer| log-prob over sampled tokens (NaN if either side has one);
    `rescored[i]` holds the trainer's scores of rollout i's prompt + completion."""
    gaps = [np.max(np.abs(np.asarray(o.logprobs) - np.asarray(w[len(o.prompt_token_ids) - 1:])))
            for o, w in zip(rollouts, rescored)]
    return float(max(gaps, default=0.0))


def check_probe(engines, model, sequences: list[list[int]], version: int,
                sampling: bool = True) -> dict[str, float]:
    """Every engine answers the probe (`engine_probe`); the trainer scores the probe and every
    sampled sequence with its own code (`model`: the policy, or a function sequences ->
    log-probs such as `Trainer.score`). Returns the largest gap of each kind over
    the engines (`sync/probe_gap`: teacher-forced; `sync/probe_sampled_gap`: the sampling path)
    and the seconds it took; raises `WeightSyncError` naming the first engine and path beyond
    its tolerance. Without `sampling`, the teacher-forced check alone (the probe before the
    sampling path was added)."""
    t0 = time.perf_counter()

    def trainer_scores(seqs):
        return score_sequences(model, seqs) if isinstance(model, nnx.Module) else model(seqs)

    answers = [a for eng in engines for a in _engine_probes(eng, sequences, version, sampling)]
    want = trainer_scores(sequences)  # in the shapes the engines' scores have: bitwise equal
    sampled = [o for _, a in answers for o in a["sampled"]]
    rescored = iter(trainer_scores([o.prompt_token_ids + o.token_ids for o in sampled])
                    if sampled else [])
    worst, worst_sampled = 0.0, 0.0
    for name, a in answers:
        tol = a["tolerance"]
        gap = probe_gap(a["scores"], want)
        if not gap <= tol:  # NaN fails too
            raise WeightSyncError(
                f"{name} does not serve the trainer's weights after the sync to version "
                f"{version}: probe log-prob gap {gap:.3g} > tolerance {tol:g} (stale, partial "
                "or wrongly converted weights)")
        s_gap = sampled_gap(a["sampled"], [next(rescored) for _ in a["sampled"]])
        if not s_gap <= tol:
            raise WeightSyncError(
                f"{name} samples from another policy than the trainer's after the sync to "
                f"version {version}: the log-probs of its sampling path (prefill + cached "
                f"decode) are {s_gap:.3g} from the trainer's re-score > tolerance {tol:g}, "
                f"while its teacher-forced probe gap is {gap:.3g} (a fault in the prefill, the "
                "KV cache or the sampler)")
        worst, worst_sampled = max(worst, gap), max(worst_sampled, s_gap)
    out = {"sync/probe_gap": worst, "sync/probe_seconds": time.perf_counter() - t0}
    if sampling:
        out["sync/probe_sampled_gap"] = worst_sampled
    return out


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
        out.update(check_probe(engines, model, probe, version))
    return out
