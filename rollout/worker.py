"""Rollout engines as Ray actors, and a group that splits requests across them.

`WorkerGroup(spec, n)` starts n `RolloutWorker` actors, each building its own engine from a spec
(`{"kind": "jax" | "vllm", "model_dir": ..., ...}`). `generate` splits the prompts into one chunk
per live worker and gathers the results in prompt order. A worker that dies mid-batch is replaced
by a fresh actor and its chunk is retried: no request is lost or served twice. The replacement
first loads the latest weights when a copy of them is kept in the object store (a whole-dict
sync, or the object-store transport with `keep_for_restarts`); otherwise it sits out until the
next sync, and its chunk goes to a worker that serves the current version.

Weights arrive bucket by bucket (`rollout.transfer`): `start_weight_update`, then `load_bucket`
(object store: the bucket is read from shared memory without a copy) or `recv_bucket` (a gloo
broadcast from the trainer's process into a buffer here), then `finish_weight_update`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray

from posttrain.errors import warn
from rollout.buckets import broadcast, collective_group, unpack
from rollout.engine import Rollout, SamplingParams, engine_probe


def build_engine(spec: dict[str, Any]):
    kind = spec["kind"]
    if kind == "jax":
        from posttrain.data.tokenizer import load_tokenizer
        from posttrain.models import from_pretrained
        from rollout.jax_engine import DECODE_PHASES, JaxEngine

        tok = load_tokenizer(spec["tokenizer_dir"]) if spec.get("tokenizer_dir") else None
        # the trainer's layer layout, or straight away the unrolled one the engine decodes with
        unroll = spec.get("unroll_layers", True)
        model = from_pretrained(spec["model_dir"],
                                scan_layers=spec.get("scan_layers", True) and not unroll)
        return JaxEngine(model, tok, eos_token_ids=spec.get("eos_token_ids", ()),
                         seed=spec.get("seed", 0), unroll_layers=unroll,
                         kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
                         max_rows=spec.get("max_rows", 0),
                         continuous_batching=spec.get("continuous_batching", False),
                         reuse_programs=spec.get("reuse_programs"),
                         decode_phases=spec.get("decode_phases", DECODE_PHASES))
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

    def probe(self, sequences, version: int, sampling: bool = True) -> dict:
        return engine_probe(self.engine, sequences, version, sampling)

    def pid(self) -> int:
        return os.getpid()

    # ---- streamed weight updates (rollout.transfer) ----
    def weight_spec(self) -> tuple[str, str]:
        return self.engine.weight_layout, self.engine.weight_dtype

    def start_weight_update(self, version: int, check_digest: bool = False) -> None:
        self.engine.start_weight_update(version, check_digest)

    def load_bucket(self, meta, bucket) -> None:
        """`bucket`: a packed buffer, or the bucket's (name, array) list."""
        if isinstance(bucket, list):  # from the object store: immutable shared memory
            self.engine.load_weights(bucket, self.engine.weight_layout, borrow=True)
        else:
            self.engine.load_weights(unpack(meta, bucket), self.engine.weight_layout)

    def init_collective(self, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        self.pg = collective_group(host, port, rank, world, timeout_s)

    def recv_bucket(self, meta) -> None:
        # One receive buffer, kept, when the engine copies out of it before the next bucket
        # comes (JAX). vLLM's layerwise reload may hold a layer's tensors until the layer is
        # complete: a fresh buffer per bucket (reusing one served a corrupted model, which the
        # probe check caught).
        if not self.engine.copies_on_load:
            buf = np.empty(meta.nbytes, np.uint8)
        else:
            if getattr(self, "_recv", None) is None or self._recv.nbytes < meta.nbytes:
                self._recv = np.zeros(meta.nbytes, np.uint8)
            buf = self._recv[:meta.nbytes]
        broadcast(self.pg, buf)
        self.load_bucket(meta, buf)

    def finish_weight_update(self, version: int) -> str | None:
        return self.engine.finish_weight_update(version)

    def last_digest(self) -> str | None:
        return getattr(self.engine, "last_digest", None)

    def vllm_transfer(self, method: str, *args):
        """One of the vLLM engine's weight-transfer calls (`rollout.vllm_transfer`)."""
        return getattr(self.engine, method)(*args)

    def call(self, fn, *args):
        """`fn(engine, *args)` here (CPU stand-ins for CUDA-only calls; diagnostics)."""
        return fn(self.engine, *args)


class WorkerGroup:
    def __init__(self, spec: dict[str, Any], num_workers: int, max_restarts: int = 3,
                 request_timeout_s: float = 3600.0):
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.spec, self.max_restarts = spec, max_restarts
        # a worker that has not answered its prompts after this long is hung: replaced
        self.request_timeout_s = request_timeout_s
        vspec = spec.get("vllm", {}) if spec["kind"] == "vllm" else {}
        self.tensor_parallel_size = vspec.get("tensor_parallel_size", 1)
        self.weight_transfer = vspec.get("weight_transfer")
        # GPUs: each worker is one vLLM deployment over its tensor-parallel GPUs
        self._actor = RolloutWorker.options(num_gpus=spec.get("num_gpus", 0))
        self.workers = [self._actor.remote(spec) for _ in range(num_workers)]
        self.version, self.restarts = 0, 0
        self.stash = None  # (version, [(meta, ref)]): buckets kept for replacements
        self._whole_ref = None  # the last whole-dict sync (`update_weights`), likewise
        self.stale: set[int] = set()  # replaced workers that do not serve `version` yet
        self.versions()  # wait until every engine is up
        self.pids = ray.get([w.pid.remote() for w in self.workers])  # for messages about hangs
        self.weight_layout, self.weight_dtype = ray.get(self.workers[0].weight_spec.remote())

    def __repr__(self) -> str:
        return f"WorkerGroup({len(self.workers)} x {self.spec['kind']})"

    def versions(self) -> list[int]:
        return ray.get([w.version.remote() for w in self.workers])

    def probes(self, sequences, version: int, sampling: bool = True) -> list[tuple[str, dict]]:
        """Every serving worker's answer to the probe (`rollout.engine.engine_probe`), by
        name."""
        live = [i for i in range(len(self.workers)) if i not in self.stale]
        got = ray.get([self.workers[i].probe.remote(sequences, version, sampling) for i in live])
        return [(f"rollout worker {i} ({self.spec['kind']})", g) for i, g in zip(live, got)]

    # ---- what the transports call ----
    def members(self) -> tuple:
        return tuple(w._actor_id.hex() for w in self.workers)

    def submit_all(self, method: str, *args) -> list:
        return [getattr(w, method).remote(*args) for w in self.workers]

    def wait(self, refs: list):
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            dead = [i for i, r in enumerate(refs) if _failed(r)]
            raise RuntimeError(f"rollout worker(s) {dead} died during a weight sync ({e})") from e

    def call_all(self, method: str, *args):
        return self.wait(self.submit_all(method, *args))

    def synced(self, version: int) -> None:
        """Every worker now serves `version` (a transport finished a sync)."""
        self.version, self.stale, self._whole_ref = version, set(), None

    def update_weights(self, weights: dict, version: int) -> dict[str, float]:
        """The whole model as one object (`ray.put` once, every worker reads it): the path
        before bucketed transports, kept for tests and as the benchmark's baseline."""
        t0 = time.perf_counter()
        self._whole_ref, self.stash = ray.put(weights), None
        ray.get([w.update_weights.remote(self._whole_ref, version) for w in self.workers])
        self.version, self.stale = version, set()
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
        w = self._actor.remote(self.spec)
        self.pids[i] = ray.get(w.pid.remote())
        if self._whole_ref is not None:
            ray.get(w.update_weights.remote(self._whole_ref, self.version))
        elif self.stash is not None and self.stash[0] == self.version:
            ray.get(w.start_weight_update.remote(self.version))
            ray.get([w.load_bucket.remote(meta, ref) for meta, ref in self.stash[1]])
            ray.get(w.finish_weight_update.remote(self.version))
        elif self.version != 0:
            self.stale.add(i)  # no copy of the weights to give it: it joins at the next sync
        self.workers[i] = w

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Rollout]:
        live = [i for i in range(len(self.workers)) if i not in self.stale]
        if not live:
            raise RuntimeError(f"no rollout worker serves weights version {self.version} "
                               "(replaced workers join at the next sync)")
        n = len(live)
        chunks = [(lo, prompts[lo:hi]) for lo, hi in
                  ((len(prompts) * i // n, len(prompts) * (i + 1) // n) for i in range(n)) if hi > lo]
        results: dict[int, list[Rollout]] = {}
        pending: dict = {}  # ref -> (chunk, worker index, its actor, when sent)

        def send(c: int, w: int) -> None:
            actor = self.workers[w]
            pending[actor.generate.remote(chunks[c][1], params)] = (c, w, actor, time.monotonic())

        fresh: set[int] = set()  # replaced during this call: still starting, not compiled

        def replace(w: int, actor) -> None:
            if self.workers[w] is actor:  # not already replaced for another of its chunks
                self._replace(w)
                fresh.add(w)

        for c in range(len(chunks)):
            send(c, live[c])
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            retry = []
            for ref in ready:
                c, w, actor, _ = pending.pop(ref)
                try:
                    results[c] = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                        ray.exceptions.WorkerCrashedError):
                    replace(w, actor)
                    retry.append(c)
            now = time.monotonic()
            for ref, (c, w, actor, sent) in list(pending.items()):
                if now - sent > self.request_timeout_s:  # alive but not answering: hung
                    del pending[ref]
                    warn(f"rollout worker {w} (pid {self.pids[w]}) has not answered "
                         f"{len(chunks[c][1])} prompts in {now - sent:.0f} s "
                         "(rollout.request_timeout_s): replacing it and sending them again")
                    replace(w, actor)
                    retry.append(c)
            if not retry:
                continue
            live = [i for i in range(len(self.workers)) if i not in self.stale]
            if not live:
                raise RuntimeError(f"no rollout worker serves weights version {self.version} "
                                   "after the restarts (the collective transport keeps no copy)")
            # resend to warm workers first: a replacement's first call includes its compile
            # and would count against request_timeout_s
            warm = [i for i in live if i not in fresh] or live
            for k, c in enumerate(retry):
                send(c, warm[k % len(warm)])
        out = []
        for c, (lo, _) in enumerate(chunks):
            for r in results[c]:
                r.prompt_index += lo
                out.append(r)
        return out

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass


def _failed(ref) -> bool:
    """Whether `ref`'s actor died (a call still running or one that raised otherwise: no)."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        pass
    return False
