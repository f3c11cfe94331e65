"""Weights into vLLM through vLLM's own weight-transfer engines (`vllm.distributed.weight_transfer`).

The in-process transport hands a vLLM engine torch views of the JAX buffers, which only works
while vLLM's model lives in the trainer's process (one device, `VLLM_ENABLE_V1_MULTIPROCESSING=0`).
On GPUs vLLM runs its model in worker processes of its own (its engine core, and one process
per tensor-parallel rank), so weights reach it through the weight-transfer engine each worker
builds from `weight_transfer_config` (vLLM >= 0.32), driven from the trainer through the four
calls of vLLM's `VLLMWeightSyncClient`: `init_weight_transfer_engine` (once), then per sync
`start_weight_update`, `update_weights` per chunk, `finish_weight_update`:

- `VllmIPC` ("ipc" engine): vLLM on the trainer's own GPUs (colocated, any tensor-parallel
  size). Each bucket is packed back to back (vLLM's packed format: `tensor_sizes` cut the
  buffer, no padding) into one staging buffer per GPU, exported once per sync as a CUDA IPC
  handle keyed by the GPU's UUID; every vLLM rank opens the handle of its own GPU, copies its
  tensors out (vLLM's `packed_ipc_consumer` clones) and loads them. A JAX trainer holds all its
  GPUs in one process, so the handle dict carries every GPU's buffer at once (what a torch
  trainer builds with an all-gather across its ranks). The staging buffers are torch's, outside
  JAX's memory pool: `posttrain plan` counts them.
- `VllmNCCL` ("nccl" engine): vLLM engines on other GPUs or nodes (Ray workers). vLLM's own
  trainer engine (`NCCLTrainerWeightTransferEngine`) broadcasts packed chunks from the trainer
  (rank 0) to every vLLM rank while the workers receive, both sides cutting chunks by the same
  rule (`nccl_chunks`); the tensors come from `ExporterSource`, the exporter seen as vLLM's
  `WeightSource`. Each Ray worker is a vLLM deployment of its own, so the group's client gives
  worker k the ranks after the first k deployments (`GroupClient`).

The tensors are the exporter's (`rollout.buckets.Exporter`): HF names, effective weights (LoRA
merged, int8 dequantized), in the engine's dtype. Every sync still ends with the probe check.
Calls that need CUDA or NCCL go through `_cuda` (`device_uuid`, `ipc_share`, `staging`), and
`rollout.cuda_standins` replaces them on CPU for tests and the GPU script's dry run.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np

from posttrain import faults
from rollout.buckets import Exporter, Transport, free_address, plan_buckets
from rollout.vllm_engine import require_weight_transfer
from rollout.worker import WorkerGroup

try:
    from vllm.distributed.weight_transfer import WeightSource
except ImportError:  # vLLM < 0.32: `require_weight_transfer` says so when a transport is made
    WeightSource = object

# ---- the control plane: vLLM's four calls, into one engine or a group of Ray workers ------------
class EngineClient:
    """`VLLMWeightSyncClient` of a `VllmEngine` in this process (its model may live in worker
    processes: every call is vLLM's `collective_rpc` to all of them). `version` is what the
    next `finish_weight_update` makes the engine serve."""

    def __init__(self, engine):
        self.engine, self.version, self.calls = engine, None, []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        self.engine.init_transfer(init_info)

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.engine.start_transfer()

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self.engine.update_transfer(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.engine.finish_transfer(self.version)


class GroupClient(EngineClient):
    """The same four calls fanned out to every worker of a `WorkerGroup` (each a vLLM
    deployment of `ranks` processes). NCCL: worker k joins at rank offset 1 + k * ranks."""

    def __init__(self, group, ranks: int):
        super().__init__(group)
        self.ranks = ranks

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.calls.append("init")
        g = self.engine
        if "rank_offset" not in init_info:
            g.call_all("vllm_transfer", "init_transfer", init_info)
            return
        g.wait([w.vllm_transfer.remote("init_transfer", {**init_info, "rank_offset":
                                                         init_info["rank_offset"] + k * self.ranks})
                for k, w in enumerate(g.workers)])

    def start_weight_update(self) -> None:
        self.calls.append("start")
        self.engine.call_all("vllm_transfer", "start_transfer")

    def update_weights(self, update_info: dict) -> None:
        self.calls.append("update")
        self.engine.call_all("vllm_transfer", "update_transfer", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append("finish")
        self.engine.call_all("vllm_transfer", "finish_transfer", self.version)
        self.engine.synced(self.version)


def client_for(target, ranks: int = 1) -> EngineClient:
    return GroupClient(target, ranks) if isinstance(target, WorkerGroup) else EngineClient(target)


# ---- the data plane: the exporter's tensors as torch tensors on a device -------------------------
class _cuda:
    """The calls that need CUDA (replaced on CPU by `rollout.cuda_standins`)."""

    @staticmethod
    def device_uuid(device) -> str:
        import torch

        return str(torch.cuda.get_device_properties(device.index).uuid)

    @staticmethod
    def ipc_share(tensor) -> tuple:
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(tensor)[1]  # the rebuild_cuda_tensor arguments

    @staticmethod
    def staging(nbytes: int, device):
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    @staticmethod
    def synchronize(device) -> None:
        import torch

        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @staticmethod
    def release() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let the trainer reclaim what the consumers released


def torch_device(jax_device):
    """The torch device holding the same memory as a JAX device (CUDA ordinal = JAX's local id)."""
    import torch

    if jax_device.platform == "gpu":
        return torch.device("cuda", jax_device.local_hardware_id)
    return torch.device("cpu")


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def exported(exporter: Exporter, name: str, dtype: str):
    """One exported tensor, whole, as a JAX array in `dtype` (computed once: a LoRA merge, a
    dequantization, a transpose, the cast)."""
    import jax.numpy as jnp

    arr = exporter.tensor(name)
    if isinstance(arr, np.ndarray):
        arr = jnp.asarray(arr)
    return arr if arr.dtype == jnp.dtype(dtype) else arr.astype(jnp.dtype(dtype))


def on_device(arr, jax_device):
    """`arr` on `jax_device` as a torch tensor over the JAX buffer (DLPack: no copy beyond the
    gather of a sharded array)."""
    import jax
    import torch

    if arr.sharding.device_set != {jax_device}:
        arr = jax.device_put(arr, jax_device)
    return torch.from_dlpack(arr)


def tensor_on(exporter: Exporter, name: str, dtype: str, jax_device):
    return on_device(exported(exporter, name, dtype), jax_device)


class ExporterSource(WeightSource):
    """The exporter as vLLM's `WeightSource`: `metadata()` from the bucket plan (nothing
    computed), iteration yields each tensor on the sender's device. `exporter` is replaced
    before each sync (vLLM's trainer engines replay one source every round)."""

    def __init__(self, device):
        self.device, self.exporter = device, None

    def specs(self):
        return [t for b in self.exporter.plan for t in b.tensors]

    def metadata(self):
        from vllm.distributed.weight_transfer import ParamMeta

        return [ParamMeta(t.name, torch_dtype(t.dtype), tuple(t.shape)) for t in self.specs()]

    def __iter__(self):
        for t in self.specs():
            faults.point("weight_sync")
            yield t.name, tensor_on(self.exporter, t.name, t.dtype, self.device)


def nccl_chunks(sizes: list[int], buffer_bytes: int) -> list[int]:
    """How many tensors each packed NCCL chunk holds, by vLLM's rule on both sides
    (`packed_nccl_broadcast_producer/consumer`): a chunk takes tensors until its size exceeds
    `buffer_bytes`, the tensor that crosses it included."""
    out, n, size = [], 0, 0
    for s in sizes:
        n, size = n + 1, size + s
        if size > buffer_bytes:
            out.append(n)
            n, size = 0, 0
    return out + ([n] if n else [])


# ---- transports ------------------------------------------------------------------------------
class _VllmTransport(Transport):
    """What the two vLLM transports share: the version gate, the client, no digests."""

    def __init__(self, target):
        require_weight_transfer()
        super().__init__(target)
        self.ranks = int(getattr(target, "tensor_parallel_size", 1))
        self.client = client_for(target, self.ranks)

    def send(self, exporter, version, check_digest=False):
        if check_digest:
            raise ValueError("vLLM's weight-transfer engines do not hash what they load: "
                             "the probe check proves the weights (check_digest needs another "
                             "transport)")
        t0 = time.perf_counter()
        self.client.version = version
        buckets = self._send(exporter, version)
        return {"sync/bytes": float(exporter.nbytes), "sync/seconds": time.perf_counter() - t0,
                "sync/buckets": float(buckets)}


class VllmIPC(_VllmTransport):
    """CUDA IPC into a vLLM engine on the trainer's GPUs (see the module docstring)."""

    name = "vllm_ipc"

    def __init__(self, target, devices=None):
        import jax

        super().__init__(target)
        # the engine's GPUs: its tensor-parallel ranks are on the first devices of this process
        self.devices = list(devices or jax.local_devices()[:self.ranks])
        self._ready, self._staging = False, {}

    def init(self, exporter):
        if not self._ready:
            self.client.init_weight_transfer_engine({"packed": True})
            self._ready = True

    def plan(self, exporter: Exporter):
        """vLLM's packed IPC layout: the exporter's tensors back to back, cut at `bucket_bytes`."""
        specs = [(t.name, t.shape, t.dtype) for b in exporter.plan for t in b.tensors]
        return plan_buckets(specs, exporter.bucket_bytes, align=1)

    def _send(self, exporter, version) -> int:
        import torch

        plan = self.plan(exporter)
        need = max(b.nbytes for b in plan)
        for d in self.devices:  # kept between syncs, grown when a bucket needs more
            if d not in self._staging or self._staging[d].numel() < need:
                self._staging[d] = _cuda.staging(need, torch_device(d))
        # one export per sync, as vLLM's producer does (its importer maps it once per sync)
        handles = {_cuda.device_uuid(torch_device(d)): _cuda.ipc_share(self._staging[d])
                   for d in self.devices}
        self.init(exporter)
        self.client.start_weight_update()
        for meta in plan:
            faults.point("weight_sync")
            for t in meta.tensors:
                arr = exported(exporter, t.name, t.dtype)  # once, then onto every GPU
                for d in self.devices:
                    src = on_device(arr, d).reshape(-1).view(torch.uint8)
                    self._staging[d][t.offset:t.offset + t.nbytes].copy_(src)
            for d in self.devices:
                _cuda.synchronize(torch_device(d))
            self.client.update_weights(update_info(meta, handles))
        self.client.finish_weight_update(str(version))
        _cuda.release()
        return len(plan)


def update_info(meta, handles: dict) -> dict:
    """One packed chunk as vLLM's `IPCWeightTransferUpdateInfo` (its fields, as a dict)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo

    return asdict(IPCWeightTransferUpdateInfo(
        names=[t.name for t in meta.tensors], dtype_names=[t.dtype for t in meta.tensors],
        shapes=[list(t.shape) for t in meta.tensors], ipc_handles=handles,
        tensor_sizes=[t.nbytes for t in meta.tensors]))


class VllmNCCL(_VllmTransport):
    """vLLM's NCCL trainer engine into vLLM engines elsewhere (see the module docstring)."""

    name = "vllm_nccl"

    def __init__(self, target, num_buffers: int = 2, device=None):
        import jax

        super().__init__(target)
        self.num_buffers, self.device = num_buffers, device or jax.local_devices()[0]
        self.engine, self._members, self._bucket = None, None, None
        self.source = None

    def _workers(self) -> int:
        return len(getattr(self.target, "workers", [self.target]))

    def init(self, exporter):
        members = self.target.members() if hasattr(self.target, "members") else None
        if self.engine is not None and members == self._members and \
                self._bucket == exporter.bucket_bytes:
            return
        self.close()
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        host, port = free_address()
        self.source = ExporterSource(self.device)
        self.source.exporter = exporter
        info = NCCLTrainerInitInfo(master_address=host, master_port=port,
                                   world_size=1 + self._workers() * self.ranks, rank=0,
                                   packed=True, packed_buffer_size_bytes=exporter.bucket_bytes,
                                   packed_num_buffers=self.num_buffers)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client,
                                                                source=self.source)
        self._members, self._bucket = members, exporter.bucket_bytes

    def _send(self, exporter, version) -> int:
        self.init(exporter)
        self.source.exporter = exporter
        self.engine.send_weights()  # start, update concurrently with the broadcast, finish
        return len(nccl_chunks([t.nbytes for t in self.source.specs()], exporter.bucket_bytes))

    def close(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
