"""Weights from the trainer to rollout engines, bucket by bucket, over a chosen transport.

The exporter (`Exporter`) turns the trainer's state into the tensors an engine loads: one per HF
tensor name, in `hf_tensor_names` order (the order both sides derive from the model config, so
it is agreed without a handshake), in the engine's layout, cast to the engine's dtype, packed
into buckets of `bucket_bytes` whose boundaries are fixed by metadata alone (`plan_buckets`).
What leaves is the weight the policy computes with: a LoRA kernel as W + (alpha / r) A B, an
int8 kernel dequantized, one layer (or expert) of a stacked parameter at a time
(`EffectiveParams.get`). The host never holds more than the bucket being packed plus one HF
tensor of work; the transports below keep at most one more bucket in flight.

Two layouts: `hf` ([out, in] torch `weight`s, what vLLM's `load_weights` takes) and `jax` (our
own orientation, [in, out] kernels under the same HF names: the JAX engine writes them into its
parameters with no transpose on either side).

Also here, below every engine and transport: the `Transport` interface the transports
implement, the digest that proves a delivery bitwise, and the gloo group helpers.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain import faults
from posttrain.models.config import ModelConfig
from posttrain.models.export import EffectiveParams, host_array
from posttrain.models.hf import hf_shape, hf_tensor_names, our_path

DEFAULT_BUCKET_BYTES = 256 << 20
ALIGN = 64  # every tensor starts on a cache line inside its bucket
LAYOUTS = ("hf", "jax")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # bytes into its bucket

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class BucketMeta:
    index: int
    nbytes: int
    tensors: tuple[TensorMeta, ...]


def plan_buckets(specs: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int,
                 align: int = ALIGN) -> list[BucketMeta]:
    """Greedy, in the order given: a bucket closes before the tensor that would overflow it; a
    tensor larger than `bucket_bytes` travels alone. Each tensor starts at a multiple of
    `align` bytes (1: back to back, vLLM's packed IPC layout)."""
    buckets, cur, size = [], [], 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = -(-size // align) * align
        if cur and start + nbytes > bucket_bytes:
            buckets.append(BucketMeta(len(buckets), size, tuple(cur)))
            cur, start = [], 0
        cur.append(TensorMeta(name, tuple(shape), str(np.dtype(dtype)), start))
        size = start + nbytes
    if cur:
        buckets.append(BucketMeta(len(buckets), size, tuple(cur)))
    return buckets


def unpack(meta: BucketMeta, buf) -> list[tuple[str, np.ndarray]]:
    """(name, array view) of every tensor in a packed bucket (no copy)."""
    buf = np.asarray(buf).reshape(-1).view(np.uint8)
    return [(t.name, np.frombuffer(buf, t.dtype, int(np.prod(t.shape, dtype=np.int64)),
                                   t.offset).reshape(t.shape)) for t in meta.tensors]


class Exporter:
    """The policy's effective weights as an engine loads them (see the module docstring)."""

    def __init__(self, state: nnx.State, cfg: ModelConfig, *, layout: str = "hf",
                 dtype: str | None = None, lora_scale: float | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, align: int = ALIGN):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
        self.cfg, self.layout, self.bucket_bytes = cfg, layout, bucket_bytes
        self.params = EffectiveParams(state, lora_scale)
        self.sources = {n: our_path(cfg, n) for n in hf_tensor_names(cfg)}
        cast = None if dtype in (None, "auto") else jnp.dtype(dtype)  # bfloat16 via ml_dtypes
        self.plan = plan_buckets([(n, self._shape(n), cast or self.params.dtype(src[0]))
                                  for n, src in self.sources.items()], bucket_bytes, align)
        self.nbytes = sum(b.nbytes for b in self.plan)
        # views of the trainer's buffers only: nothing computed, nothing cast
        self.views_only = self.params.plain and all(
            t.dtype == str(self.params.dtype(self.sources[t.name][0]))
            for b in self.plan for t in b.tensors)

    def _shape(self, name: str) -> tuple[int, ...]:
        shape = hf_shape(self.cfg, name)
        return shape[::-1] if self.layout == "jax" and self.sources[name][2] else shape

    def tensor(self, name: str):
        """One tensor in the export layout, on the trainer's device (a slice of a stacked
        parameter, a merged LoRA kernel: computed now), not yet cast; a view where possible."""
        path, index, transpose = self.sources[name]
        arr = self.params.get(path, index)
        return arr.T if transpose and self.layout == "hf" else arr

    def buckets(self, buffers: list[np.ndarray] | None = None) -> Iterator[tuple[BucketMeta, np.ndarray]]:
        """(meta, packed uint8 buffer) per bucket. Each is a new buffer, or, given `buffers`
        (each at least the largest bucket), the next of them in turn: memory already touched,
        so packing runs at copy speed instead of page-fault speed (a fresh page costs about
        as much as copying 16 of them on these machines); the caller must be done with a
        buffer by the time it comes round again."""
        for i, meta in enumerate(self.plan):
            faults.point("weight_sync")
            buf = (np.empty(meta.nbytes, np.uint8) if not buffers
                   else buffers[i % len(buffers)][:meta.nbytes])
            for (_, dst), t in zip(unpack(meta, buf), meta.tensors):
                np.copyto(dst, _host(self.tensor(t.name)), casting="unsafe")
            yield meta, buf

    def views(self) -> Iterator[tuple[BucketMeta, list[tuple[str, object]]]]:
        """(meta, [(name, tensor)]) per bucket, unpacked, for an engine in this process (the
        caller casts if it must): device arrays, or for the HF layout torch views over them
        (DLPack, then a transposed view: nothing copied where nothing had to be computed)."""
        for meta in self.plan:
            faults.point("weight_sync")
            yield meta, [(t.name, self._view(t.name)) for t in meta.tensors]

    def _view(self, name: str):
        path, index, transpose = self.sources[name]
        arr = self.params.get(path, index)
        if not (transpose and self.layout == "hf"):
            return arr
        import torch

        return torch.utils.dlpack.from_dlpack(arr).T

    def host_arrays(self) -> Iterator[tuple[BucketMeta, list[tuple[str, np.ndarray]]]]:
        """(meta, [(name, host array)]) per bucket, each contiguous, in the export dtype: views
        of the trainer's buffers where nothing had to be computed (a plain parameter on CPU),
        so a serializer that copies anyway (Ray's object store) makes the only copy."""
        for meta in self.plan:
            yield meta, [(t.name, np.ascontiguousarray(_host(self.tensor(t.name))).astype(
                t.dtype, copy=False)) for t in meta.tensors]

    def largest_bucket(self) -> int:
        return max(b.nbytes for b in self.plan)


def _host(arr) -> np.ndarray:
    return arr if isinstance(arr, np.ndarray) else host_array(arr)


class Digest:
    """A running hash over (name, dtype, shape, bytes) of tensors in order: what a receiving
    engine computes over what it loaded, to prove a transport bitwise."""

    def __init__(self):
        self.h = hashlib.blake2b(digest_size=16)

    def update(self, tensors) -> Digest:
        for name, arr in tensors:
            arr = np.ascontiguousarray(_to_numpy(arr))
            self.h.update(f"{name}|{arr.dtype}|{arr.shape}|".encode())
            self.h.update(arr.view(np.uint8).reshape(-1).data)
        return self

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _to_numpy(arr) -> np.ndarray:
    if hasattr(arr, "numpy") and type(arr).__module__.startswith("torch"):
        return arr.detach().cpu().numpy()
    return _host(arr)


def export_digest(exporter: Exporter) -> str:
    """The digest of everything `exporter` sends, as an engine would compute it."""
    d = Digest()
    for meta, buf in exporter.buckets():
        d.update(unpack(meta, buf))
    return d.hexdigest()


# ---- transports (trainer side) -----------------------------------------------------------------
class Transport:
    """Trainer side of weight syncs into one engine or one `WorkerGroup`. `send` runs one
    whole sync: `init` (channels: a no-op once they stand), `start`, `update` per bucket,
    `finish` (the engines confirm)."""

    name = "transport"
    requested = None  # the recipe's name for it ("auto" or a name)

    def __init__(self, target):
        self.target = target

    def init(self, exporter: Exporter) -> None:
        pass

    def start(self, version: int, check_digest: bool = False) -> None:
        raise NotImplementedError

    def update(self, meta: BucketMeta, payload) -> None:
        raise NotImplementedError

    def finish(self, version: int) -> None:
        raise NotImplementedError

    def send(self, exporter: Exporter, version: int, check_digest: bool = False) -> dict[str, float]:
        t0 = time.perf_counter()
        self.layout = exporter.layout
        self.init(exporter)
        self.start(version, check_digest)
        for meta, payload in self.payloads(exporter):
            self.update(meta, payload)
            del payload
        self.finish(version)
        seconds = time.perf_counter() - t0
        return {"sync/bytes": float(exporter.nbytes), "sync/seconds": seconds,
                "sync/buckets": float(len(exporter.plan))}

    def payloads(self, exporter: Exporter):
        return exporter.buckets()

    def close(self) -> None:
        pass


def collective_group(host: str, port: int, rank: int, world: int, timeout_s: float):
    """A gloo process group of its own (not torch's default group, which a vLLM worker in the
    same process already uses): a TCPStore at host:port, rank 0 its server."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


def broadcast(pg, buf: np.ndarray) -> None:
    """Broadcast `buf` from rank 0 of `pg` into every rank's `buf` (in place)."""
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([torch.from_numpy(buf)], opts).wait()


def free_address() -> tuple[str, int]:
    import ray

    host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]
