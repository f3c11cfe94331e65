"""Weight transports from the trainer to rollout engines (the wire format, the exporter and the
`Transport` interface are in `rollout.buckets`).

Transports, modelled on vLLM's weight-transfer API (init / start / update per bucket / finish):
- `InProcess`: colocated engines. The JAX engine takes the trainer's NNX state itself; vLLM
  takes torch views over the JAX buffers (DLPack, no copy on CPU) bucket by bucket.
- `ObjectStore`: Ray workers. Each bucket's arrays are put in Ray's object store as one object
  (shared memory on a node, read by every worker there without a copy; Ray's serializer writes
  the trainer's arrays straight in, the only copy on the trainer) and loaded by every worker;
  the put of bucket k+1 overlaps the workers' loading of bucket k.
- `Collective`: Ray workers. The trainer's process and the workers form a torch.distributed
  gloo group (NCCL on GPUs is the GPU transports' job, behind the same interface) and each
  bucket is broadcast from the trainer into a buffer on every worker, which loads it while the
  trainer packs the next one.
`auto` picks in-process for colocated engines, and the object store for Ray workers (measured
faster than gloo on one node: BENCHMARKS.md; gloo is for when workers are on other nodes
without a shared object store path, or for parity with NCCL).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from rollout.buckets import Transport, free_address, broadcast, collective_group
from rollout.vllm_transfer import VllmIPC, VllmNCCL
from rollout.worker import WorkerGroup


class InProcess(Transport):
    """An engine in the trainer's process: its `start/load/finish_weight_update` directly."""

    name = "in_process"

    def payloads(self, exporter):
        return exporter.views()

    def send(self, exporter, version, check_digest=False):
        if not (exporter.views_only and hasattr(self.target, "load_all")):
            return super().send(exporter, version, check_digest)
        # Views cost nothing to hold at once: one call into the engine instead of one per
        # bucket (buckets bound memory only where tensors are computed or cast).
        t0 = time.perf_counter()
        self.target.load_all([tv for _, views in exporter.views() for tv in views], version,
                             check_digest)
        return {"sync/bytes": float(exporter.nbytes), "sync/seconds": time.perf_counter() - t0,
                "sync/buckets": 1.0}

    def start(self, version, check_digest=False):
        self.target.start_weight_update(version, check_digest)

    def update(self, meta, payload):
        self.target.load_weights(payload, self.layout)

    def finish(self, version):
        self.target.finish_weight_update(version)


class ObjectStore(Transport):
    """Ray workers: one `ray.put` per bucket, loaded by every worker; `depth` buckets in flight
    while the next is packed and put. With `keep_for_restarts` the buckets stay in the object
    store after the sync, so a replaced worker loads the current weights at once (costs the
    store one copy of the model); without, it sits out until the next sync."""

    name = "object_store"

    def payloads(self, exporter):
        return exporter.host_arrays()  # Ray's serializer writes each array into shared memory

    def __init__(self, target, depth: int = 1, keep_for_restarts: bool = False):
        super().__init__(target)
        self.depth, self.keep = depth, keep_for_restarts
        self._inflight, self._kept = deque(), []

    def start(self, version, check_digest=False):
        self.target.stash = None  # the old buckets go before the new ones come
        self.target.call_all("start_weight_update", version, check_digest)

    def update(self, meta, payload):
        import ray

        # a trainer group's rank 0 has put the bucket already
        ref = payload if isinstance(payload, ray.ObjectRef) else ray.put(payload)
        if self.keep:
            self._kept.append((meta, ref))
        self._inflight.append(self.target.submit_all("load_bucket", meta, ref))
        while len(self._inflight) > self.depth:
            self.target.wait(self._inflight.popleft())

    def finish(self, version):
        while self._inflight:
            self.target.wait(self._inflight.popleft())
        self.target.call_all("finish_weight_update", version)
        self.target.synced(version)
        if self.keep:
            self.target.stash, self._kept = (version, self._kept), []


class Collective(Transport):
    """Ray workers in one torch.distributed gloo group with the trainer's process (rank 0):
    each bucket is broadcast from rank 0 into a buffer on every worker, which loads it while the
    trainer packs the next. The group re-forms when the workers change (a replaced worker)."""

    name = "collective"

    def __init__(self, target, timeout_s: float = 600.0):
        super().__init__(target)
        self.timeout_s, self.pg, self._members, self._pending = timeout_s, None, None, []
        self._buffers: list[np.ndarray] = []

    def payloads(self, exporter):
        # a broadcast has left the trainer when it returns: two buffers, reused sync after sync
        need = exporter.largest_bucket()
        if not self._buffers or self._buffers[0].nbytes < need:
            self._buffers = [np.zeros(need, np.uint8) for _ in range(2)]
        return exporter.buckets(self._buffers)

    def init(self, exporter):
        members = self.target.members()
        if self.pg is not None and members == self._members:
            return
        host, port = free_address()
        world = len(members) + 1
        joins = [w.init_collective.remote(host, port, rank, world, self.timeout_s)
                 for rank, w in enumerate(self.target.workers, start=1)]
        self.pg = collective_group(host, port, 0, world, self.timeout_s)
        self.target.wait(joins)
        self._members = members

    def start(self, version, check_digest=False):
        self.target.call_all("start_weight_update", version, check_digest)

    def update(self, meta, payload):
        recv = self.target.submit_all("recv_bucket", meta)
        broadcast(self.pg, payload)
        if self._pending:  # the workers have loaded the bucket before (they run calls in order)
            self.target.wait(self._pending)
        self._pending = recv

    def finish(self, version):
        if self._pending:
            self.target.wait(self._pending)
            self._pending = []
        self.target.call_all("finish_weight_update", version)
        self.target.synced(version)


TRANSPORTS = {"in_process": InProcess, "object_store": ObjectStore, "collective": Collective}
VLLM_TRANSPORTS = ("vllm_ipc", "vllm_nccl")  # vLLM's own engines: rollout.vllm_transfer


def make_transport(name: str, target, timeout_s: float = 600.0) -> Transport:
    """`name`: a key of TRANSPORTS, one of VLLM_TRANSPORTS, or `auto`: the transport the engine
    was built for (`weight_transfer`: a vLLM engine whose model lives in processes of its own),
    else in-process for an engine in this process and the object store for Ray workers."""
    remote = isinstance(target, WorkerGroup)
    if name == "auto":
        built = getattr(target, "weight_transfer", None)
        name = f"vllm_{built}" if built else "object_store" if remote else "in_process"
    if name in VLLM_TRANSPORTS:
        built = getattr(target, "weight_transfer", None)
        if built != name.removeprefix("vllm_"):
            raise ValueError(f"transport {name!r}: the engine was not built with vLLM's "
                             f"{name.removeprefix('vllm_')!r} weight-transfer engine "
                             f"(weight_transfer={built!r})")
        if name == "vllm_ipc" and remote:
            raise ValueError("transport 'vllm_ipc' reaches a vLLM engine on the trainer's own "
                             "GPUs (colocated), not Ray workers: use vllm_nccl")
        return VllmIPC(target) if name == "vllm_ipc" else VllmNCCL(target)
    if remote == (name == "in_process"):
        where = "Ray workers" if remote else "an engine in the trainer's process"
        raise ValueError(f"transport {name!r} cannot reach {where}")
    if getattr(target, "weight_transfer", None):
        raise ValueError(f"transport {name!r}: this vLLM engine runs its model in processes of "
                         f"its own and takes weights through vLLM's weight-transfer engine: use "
                         f"vllm_{target.weight_transfer} (or auto)")
    return Collective(target, timeout_s) if name == "collective" else TRANSPORTS[name](target)
