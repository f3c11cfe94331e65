"""Rollout engines as Ray actors, and a group that splits requests across them.

`WorkerGroup(spec, n)` starts n `RolloutWorker` actors, each building its own engine from a spec
(`{"kind": "jax" | "vllm", "model_dir": ..., ...}`). `generate` splits the prompts into one chunk
per live worker and gathers the results in prompt order. A worker that dies mid-batch is replaced
by a fresh actor, which first receives the latest weights, and its chunk is retried: no request
is lost or served twice. Weights go through Ray's object store once (`ray.put`), read by every
worker on the node without a copy.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray

from rollout.engine import Rollout, SamplingParams


def build_engine(spec: dict[str, Any]):
    kind = spec["kind"]
    if kind == "jax":
        from posttrain.data.tokenizer import load_tokenizer
        from posttrain.models import from_pretrained
        from rollout.jax_engine import JaxEngine

        tok = load_tokenizer(spec["tokenizer_dir"]) if spec.get("tokenizer_dir") else None
        # the trainer's layer layout (unrolled layers decode with per-layer KV buffers)
        model = from_pretrained(spec["model_dir"], scan_layers=spec.get("scan_layers", True))
        return JaxEngine(model, tok,
                         eos_token_ids=spec.get("eos_token_ids", ()), seed=spec.get("seed", 0))
    if kind == "vllm":
        from rollout.vllm_engine import VllmEngine

        return VllmEngine(spec["model_dir"], **spec.get("vllm", {}))
    raise ValueError(f"unknown engine kind {kind!r}")


@ray.remote
class RolloutWorker:
    def __init__(self, spec: dict[str, Any]):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.engine = build_engine(spec)

    def generate(self, prompts, params: SamplingParams) -> list[Rollout]:
        return self.engine.generate(prompts, params)

    def update_weights(self, weights, version: int) -> dict[str, float]:
        return self.engine.update_weights(weights, version)

    def version(self) -> int:
        return self.engine.version

    def score(self, sequences) -> list[list[float]]:
        return self.engine.score(sequences)

    def probe_tolerance(self) -> float:
        return self.engine.probe_tolerance

    def pid(self) -> int:
        return os.getpid()


class WorkerGroup:
    def __init__(self, spec: dict[str, Any], num_workers: int, max_restarts: int = 3):
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.spec, self.max_restarts = spec, max_restarts
        self.workers = [RolloutWorker.remote(spec) for _ in range(num_workers)]
        self._weights_ref, self.version, self.restarts = None, 0, 0
        ray.get([w.version.remote() for w in self.workers])  # wait until every engine is up

    def versions(self) -> list[int]:
        return ray.get([w.version.remote() for w in self.workers])

    def scores(self, sequences) -> list[tuple[str, float, list[list[float]]]]:
        """Every worker's probe scores: (name, tolerance, scores) per worker."""
        tols = ray.get([w.probe_tolerance.remote() for w in self.workers])
        got = ray.get([w.score.remote(sequences) for w in self.workers])
        return [(f"rollout worker {i} ({self.spec['kind']})", t, g)
                for i, (t, g) in enumerate(zip(tols, got))]

    def update_weights(self, weights: dict, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self._weights_ref = ray.put(weights)  # once; every worker reads the same object
        ray.get([w.update_weights.remote(self._weights_ref, version) for w in self.workers])
        self.version = version
        nbytes = sum(getattr(v, "nbytes", 0) for v in weights.values())
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    def _replace(self, i: int) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts * len(self.workers):
            raise RuntimeError(f"rollout workers keep dying ({self.restarts} restarts)")
        try:
            ray.kill(self.workers[i])
        except Exception:
            pass
        w = RolloutWorker.remote(self.spec)
        if self._weights_ref is not None:
            ray.get(w.update_weights.remote(self._weights_ref, self.version))
        self.workers[i] = w

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        n = len(self.workers)
        chunks = [(lo, prompts[lo:hi]) for lo, hi in
                  ((len(prompts) * i // n, len(prompts) * (i + 1) // n) for i in range(n)) if hi > lo]
        results: dict[int, list[Rollout]] = {}
        todo = list(enumerate(chunks))
        while todo:
            refs = {i: self.workers[i % n].generate.remote(c[1], params) for i, c in todo}
            failed = []
            for i, ref in refs.items():
                try:
                    results[i] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                        ray.exceptions.WorkerCrashedError):
                    self._replace(i % n)
                    failed.append(i)
            todo = [(i, chunks[i]) for i in failed]
        out = []
        for i, (lo, _) in enumerate(chunks):
            for r in results[i]:
                r.prompt_index += lo
                out.append(r)
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
