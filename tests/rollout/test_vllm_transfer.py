"""Weights through vLLM's own weight-transfer engines (`rollout.vllm_transfer`), on CPU.

Everything is vLLM's real code -- its packed NCCL producer and consumer, its IPC update info and
packed IPC consumer, the IPC and NCCL worker engines inside a vLLM engine whose model runs in
processes of its own, vLLM's NCCL trainer engine -- except the calls that need CUDA or NCCL,
which `rollout.cuda_standins` replaces (CUDA IPC by shared memory, NCCL by gloo, CUDA streams
by no-ops). What is checked: the cut points both sides agree on, the order of vLLM's calls,
the tensors vLLM's model loads equal bit for bit to those exported, the probe, and that a
chunk corrupted in flight is caught."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout import cuda_standins
from rollout.buckets import Exporter, unpack
from rollout.vllm_transfer import VllmIPC, nccl_chunks, update_info
from tests.helpers import save_tiny_model_with_tokenizer

ROOT = Path(__file__).resolve().parents[2]
BUCKET = 1 << 17  # 128 KiB: many chunks; the embedding (256 KiB) is larger than one


@pytest.fixture
def standins(monkeypatch):
    cuda_standins.install(setattr=monkeypatch.setattr)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_transfer") / "dense"
    save_tiny_model_with_tokenizer(d, "qwen3")
    return d


def exporter(d, seed=1, **kw):
    from flax import nnx

    from posttrain.models import from_pretrained
    from tests.rollout.test_transfer import perturbed

    model = perturbed(from_pretrained(d, scan_layers=False), seed)
    return model, Exporter(nnx.state(model), model.cfg, bucket_bytes=BUCKET, **kw)


def test_nccl_chunks_are_vllms_cut_points_on_both_sides(tiny, standins):
    """vLLM's packed producer (the trainer's side) and consumer (each worker's) cut the stream
    where `nccl_chunks` says, and the consumer unpacks exactly the exported tensors."""
    from vllm.distributed.weight_transfer.packed_tensor import (packed_nccl_broadcast_consumer,
                                                                packed_nccl_broadcast_producer)

    from rollout.vllm_transfer import ExporterSource

    import jax

    _, ex = exporter(tiny)
    src = ExporterSource(jax.local_devices()[0])
    src.exporter = ex
    sizes = [t.nbytes for t in src.specs()]
    sent = []

    class Producer:
        def broadcast(self, tensor, src, stream=None):
            sent.append(tensor.clone())

    packed_nccl_broadcast_producer(iter(src), Producer(), 0, lambda item: item[1], BUCKET, 2)
    chunks = nccl_chunks(sizes, BUCKET)
    assert [int(t.numel()) for t in sent] == [
        sum(sizes[sum(chunks[:i]):sum(chunks[:i + 1])]) for i in range(len(chunks))]
    assert len(chunks) > 3 and sum(chunks) == len(sizes)

    got, queue = [], list(sent)

    class Consumer:
        def broadcast(self, tensor, src, stream=None):
            tensor.copy_(queue.pop(0))  # the consumer sized its buffer itself: must match

    meta = ((m.name, (list(m.shape), m.dtype)) for m in src.metadata())
    packed_nccl_broadcast_consumer(meta, Consumer(), 0, got.extend, BUCKET, 2, device="cpu")
    assert not queue and [n for n, _ in got] == [t.name for t in src.specs()]
    for (name, t), spec in zip(got, src.specs()):
        want = np.asarray(jax.device_get(ex.tensor(name)))
        assert np.array_equal(t.numpy(), want), name
        assert tuple(t.shape) == spec.shape


def test_ipc_chunks_are_vllms_packed_format(tiny, standins):
    """Each bucket of `VllmIPC` is a valid `IPCWeightTransferUpdateInfo` whose tensors vLLM's
    `packed_ipc_consumer` unpacks bitwise from the staging buffer, packed back to back (no
    padding: vLLM splits at `tensor_sizes`), each chunk within the bucket size unless one tensor
    is larger."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.packed_tensor import PackedBufferImporter, packed_ipc_consumer

    import jax

    from rollout.vllm_transfer import _cuda, tensor_on, torch_device

    _, ex = exporter(tiny)
    tr = VllmIPC.__new__(VllmIPC)
    plan = tr.plan(ex)
    dev = jax.local_devices()[0]
    staging = _cuda.staging(max(b.nbytes for b in plan), torch_device(dev))
    handles = {_cuda.device_uuid(torch_device(dev)): _cuda.ipc_share(staging)}
    importer, seen = PackedBufferImporter(), []
    for meta in plan:
        assert [t.offset for t in meta.tensors] == list(np.cumsum([0] + [t.nbytes for t in meta.tensors])[:-1])
        assert meta.nbytes <= BUCKET or len(meta.tensors) == 1
        for t in meta.tensors:
            staging[t.offset:t.offset + t.nbytes].copy_(
                tensor_on(ex, t.name, t.dtype, dev).reshape(-1).view(torch.uint8))
        info = IPCWeightTransferUpdateInfo(**update_info(meta, handles))
        out = packed_ipc_consumer(info.ipc_handles, info.names, info.shapes, info.dtype_names,
                                  info.tensor_sizes, device_index=None, importer=importer)
        for (name, t), (_, want) in zip(out, unpack(meta, staging.numpy()[:meta.nbytes])):
            assert np.array_equal(t.numpy(), want) and np.array_equal(
                want, np.asarray(jax.device_get(ex.tensor(name)))), name
        seen += info.names
    assert seen == [t.name for b in ex.plan for t in b.tensors]


def run_engine_check(d, backend: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.rollout.vllm_transfer_check", str(d), backend],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""},
                       capture_output=True, text=True, timeout=600, start_new_session=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(r.stdout.split("@@JSON@@")[1].splitlines()[0])


@pytest.mark.slow
# ipc here; NCCL's chunks are checked against vLLM's cut points above, and whole GRPO runs take
# every sync through it, probed, in tests/test_grpo_e2e.py (vllm_nccl: two workers). The nccl
# variant of this check runs with `python -m tests.rollout.vllm_transfer_check DIR nccl`.
@pytest.mark.parametrize("backend", ["ipc"])
def test_vllm_engine_in_its_own_processes_takes_weights_through_its_transfer_engine(tiny, backend):
    """A vLLM engine whose model runs in its engine-core and worker processes (as on GPUs) gets
    three syncs (two dense policies, one with LoRA merged) through vLLM's `backend` engine:
    vLLM's calls in order (init once; start, update per chunk or once, finish), what vLLM's
    model loaded bitwise what the exporter sent (a hash of every tensor its `load_weights` was
    given), the probe within vLLM's fp32 tolerance; then a chunk corrupted in flight stops the
    sync at the probe, and the hash differs."""
    out = run_engine_check(tiny, backend)
    for sync in out["syncs"]:
        assert sync["bitwise"], sync
        assert sync["probe_gap"] <= 1e-3, sync
    calls = out["calls"]
    assert calls[0] == "init" and calls.count("init") == 1
    assert calls.count("start") == calls.count("finish") == 3
    per_sync = " ".join(calls[1:]).split("finish")
    updates = [s.split().count("update") for s in per_sync if s.strip()]
    assert updates == ([out["syncs"][0]["buckets"]] * 3 if backend == "ipc" else [1, 1, 1])
    assert out["syncs"][0]["buckets"] > 3
    assert out["corrupted"].startswith("WeightSyncError"), out["corrupted"]
    assert not out["corrupted_bitwise"]
