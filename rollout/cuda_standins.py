"""CPU stand-ins for the few calls of vLLM's weight-transfer path that need CUDA or NCCL, so that
the rest of it -- our transports and vLLM's own engines, packing, chunking, layerwise reload and
loading -- runs unchanged on a CPU machine: in the tests, and in the GPU script's dry run. Never
installed on a GPU.

- CUDA IPC: a staging buffer lives in POSIX shared memory; its "IPC handle" is the tuple vLLM
  passes to `rebuild_cuda_tensor` (same length, the device index at position 6, which vLLM's
  consumer overwrites), carrying the shared-memory name; the consumer's `rebuild_cuda_tensor`
  opens that memory. It works across processes, as CUDA IPC does (vLLM's engine core is one).
- GPU UUIDs: one fixed UUID for the CPU "device".
- NCCL: vLLM's `PyNcclCommunicator` (trainer endpoint and worker group) is replaced by a gloo
  process group with the same ranks, over the same master address and port.
- CUDA streams: vLLM's packed producer/consumer double-buffer on CUDA streams; here streams whose
  synchronize is a no-op (CPU work is synchronous), and device index 0.

`install()` patches the process it runs in; `install_in_engine(engine)` runs it in every worker
process of a vLLM engine (through `collective_rpc`), `install_in_group(group)` in every Ray
worker (and their vLLM processes).
"""

from __future__ import annotations

import atexit
import builtins
from multiprocessing import resource_tracker, shared_memory

UUID = "GPU-00000000-cpu-standin"
_segments: dict[str, shared_memory.SharedMemory] = {}  # this process's open segments
_created: set[str] = set()  # those it made (and unlinks at exit)


class _Props:
    uuid = UUID
    name = "cpu standin"


class _Stream:
    def synchronize(self) -> None:
        pass


def _staging(nbytes: int, device):
    import torch

    shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    _untrack(shm)  # unlinked by `_unlink`, not by the resource tracker the workers share
    _segments[shm.name] = shm
    _created.add(shm.name)
    return torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)


def _share(tensor) -> tuple:
    """The stand-in IPC handle of a staging buffer: 8 fields like reduce_tensor's CUDA args."""
    import numpy as np

    for name, shm in _segments.items():
        base = np.frombuffer(shm.buf, np.uint8).ctypes.data
        if base == tensor.data_ptr():
            return ("posttrain-shm", name, tensor.numel(), 0, 0, 0, 0, 0)
    raise ValueError("not a staging buffer of rollout.cuda_standins")


def _rebuild(kind, name, nbytes, *_):
    import torch

    assert kind == "posttrain-shm", kind
    if name not in _segments:
        shm = shared_memory.SharedMemory(name=name)
        _untrack(shm)  # the trainer owns (and unlinks) the segment
        _segments[name] = shm
    return torch.frombuffer(_segments[name].buf, dtype=torch.uint8, count=nbytes)


def _untrack(shm) -> None:
    try:
        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:
        pass


class GlooComm:
    """`PyNcclCommunicator`'s broadcast and destroy over a gloo group."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float = 300.0):
        from rollout.buckets import collective_group

        self.pg, self.rank, self.world = collective_group(host, port, rank, world, timeout_s), rank, world

    def broadcast(self, tensor, src: int, stream=None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def destroy(self) -> None:
        self.pg = None


def _trainer_endpoint(init_info, rank: int = 0):
    return GlooComm(init_info.master_address, init_info.master_port, rank, init_info.world_size)


def _worker_group(init_info, parallel_config):
    # vLLM's rank rule (nccl_common.worker_init_process_group)
    rank = (parallel_config.data_parallel_index * parallel_config.world_size
            + parallel_config.rank + init_info.rank_offset)
    return GlooComm(init_info.master_address, init_info.master_port, rank, init_info.world_size)


def install(_worker=None, setattr=setattr) -> None:
    """Patch this process (the trainer's, or a vLLM worker's: `_worker` is what collective_rpc
    passes); `setattr`: how (a test passes pytest's monkeypatch.setattr, undone after it).
    Idempotent per process when patching for good."""
    import torch
    import torch.multiprocessing.reductions as reductions
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    from rollout.vllm_transfer import _cuda

    if getattr(torch, "_posttrain_standins", False):
        return
    if setattr is builtins.setattr:
        torch._posttrain_standins = True
        atexit.register(_unlink)
    setattr(_cuda, "device_uuid", staticmethod(lambda device: UUID))
    setattr(_cuda, "staging", staticmethod(_staging))
    setattr(_cuda, "ipc_share", staticmethod(_share))
    setattr(reductions, "rebuild_cuda_tensor", _rebuild)
    setattr(torch.cuda, "get_device_properties", lambda *a, **k: _Props())
    setattr(torch.accelerator, "current_device_index", lambda: 0)
    setattr(packed_tensor, "_get_streams",
            lambda device_idx, num_buffers: tuple(_Stream() for _ in range(num_buffers)))
    setattr(nccl_engine, "open_trainer_endpoint", _trainer_endpoint)
    setattr(nccl_engine, "worker_init_process_group", _worker_group)


def _unlink() -> None:
    import _posixshmem

    for name in list(_created):
        try:
            _posixshmem.shm_unlink(_segments[name]._name)
        except Exception:
            pass


def install_in_engine(engine) -> None:
    """In this process and in every worker process of a `VllmEngine`."""
    install()
    engine.llm.collective_rpc(install)


def install_in_group(group) -> None:
    """In every Ray worker of a `WorkerGroup` and in their engines' worker processes."""
    group.call_all("call", install_in_engine)
