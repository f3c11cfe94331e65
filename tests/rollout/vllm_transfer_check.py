"""Runs in its own process (see test_vllm_transfer.py): a vLLM engine built with a weight-transfer
backend, its model in processes of its own, three syncs and a corrupted one; prints JSON."""

import json
import os
import sys
from pathlib import Path


def record_loads(worker) -> None:
    """In vLLM's worker: hash every (name, tensor) its model's `load_weights` is given, in order
    (what vLLM's transfer engine hands the model). The CPU backend prepacks linear weights and
    leaves the parameters empty, so the parameters themselves cannot be compared."""
    from rollout.buckets import Digest

    model = worker.model_runner.get_model()
    inner = model.load_weights
    worker._posttrain_loads = Digest()

    def load_weights(weights):
        weights = list(weights)
        worker._posttrain_loads.update(weights)
        return inner(weights)

    model.load_weights = load_weights


def loads_digest(worker) -> str:
    from rollout.buckets import Digest

    out, worker._posttrain_loads = worker._posttrain_loads.hexdigest(), Digest()
    return out


def bitwise(eng, model, scale) -> bool:
    """What vLLM's model loaded during the last sync equals, tensor for tensor and byte for
    byte, what the exporter sends (names, dtypes, shapes, bytes, order)."""
    from flax import nnx

    from rollout.buckets import Exporter, export_digest

    want = export_digest(Exporter(nnx.state(model), model.cfg, lora_scale=scale,
                                  dtype=eng.weight_dtype))
    (got,) = eng.llm.collective_rpc(loads_digest)
    return got == want


def main(d: Path, backend: str) -> None:
    from rollout.vllm_engine import VllmEngine

    eng = VllmEngine(str(d), max_model_len=256, gpu_memory_utilization=0.1, enforce_eager=True,
                     weight_transfer=backend)
    try:
        checks(eng, d, backend)
    finally:
        eng.shutdown()


def checks(eng, d: Path, backend: str) -> None:
    from flax import nnx

    from posttrain.models import from_pretrained
    from rollout import cuda_standins, vllm_transfer
    from rollout.weight_sync import WeightSyncError, probe_sequences, push
    from tests.rollout.test_transfer import LORA_SCALE, perturbed, with_lora

    cuda_standins.install_in_engine(eng)
    eng.llm.collective_rpc(record_loads)
    policies = [(perturbed(from_pretrained(d, scan_layers=False), 1), None),
                (perturbed(from_pretrained(d, scan_layers=False), 2), None),
                (with_lora(from_pretrained(d, scan_layers=False), False), LORA_SCALE)]
    out = {"syncs": []}
    for v, (model, scale) in enumerate(policies, start=1):
        m = push([eng], nnx.state(model), model.cfg, v, probe=probe_sequences(model.cfg.vocab_size),
                 model=model, lora_scale=scale, bucket_bytes=1 << 17)
        out["syncs"].append({"probe_gap": m["sync/probe_gap"], "buckets": m["sync/buckets"],
                             "bitwise": bitwise(eng, model, scale), "version": eng.version})
    out["calls"] = list(eng._posttrain_transport.client.calls)

    # a chunk corrupted in flight: its first tensors' bytes zeroed before the engine reads them
    if backend == "ipc":
        sync, n = vllm_transfer._cuda.synchronize, [0]

        def corrupting(device):
            n[0] += 1
            if n[0] == 3:
                for buf in eng._posttrain_transport._staging.values():
                    buf[:4096] = 0
            sync(device)
        vllm_transfer._cuda.synchronize = staticmethod(corrupting)
    else:
        send, n = cuda_standins.GlooComm.broadcast, [0]

        def corrupting(self, tensor, src, stream=None):
            n[0] += 1
            if self.rank == 0 and n[0] == 3:
                tensor = tensor.clone()
                tensor[:4096] = 0
            send(self, tensor, src, stream)
        cuda_standins.GlooComm.broadcast = corrupting
    model, _ = policies[0]
    try:
        push([eng], nnx.state(model), model.cfg, 9, probe=probe_sequences(model.cfg.vocab_size),
             model=model, bucket_bytes=1 << 17)
        out["corrupted"] = "not caught"
    except WeightSyncError as e:
        out["corrupted"] = f"WeightSyncError: {e}"
    out["corrupted_bitwise"] = bitwise(eng, model, None)  # the same check, now failing
    eng.llm.collective_rpc(loads_digest)  # (reset)
    print("@@JSON@@" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    os._exit(0)
