"""Runs in its own process (see test_vllm_transfer.py): a vLLM engine built with a weight-transfer
backend, its model in processes of its own, three syncs and a corrupted one; prints JSON."""

import json
import os
import sys
from pathlib import Path

import numpy as np


def reload_matches(worker, hf: dict) -> list[str]:
    """In vLLM's worker: every parameter as the transfer engine left it, against the same HF
    tensors loaded again the in-process way (vLLM's layerwise reload and `load_weights`, the
    path tested against transformers); the names that differ."""
    import torch

    from rollout.vllm_engine import _finish_reload, _start_reload

    model = worker.model_runner.get_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        _start_reload(worker)
        model.load_weights(iter([(n, torch.from_numpy(np.frombuffer(b, dt).reshape(shape).copy()))
                                 for n, (dt, shape, b) in hf.items()]))
        _finish_reload(worker)
    after = dict(model.named_parameters())
    bad = [n for n, t in before.items() if not torch.equal(t, after[n].detach())]
    return bad if len(before) > 5 else ["(too few parameters)"]


def bitwise(eng, model, scale) -> bool:
    from flax import nnx

    from rollout.weight_sync import hf_numpy

    hf = hf_numpy(nnx.state(model), model.cfg, scale)
    wire = {n: (str(a.dtype), list(a.shape), a.tobytes()) for n, a in hf.items()}  # msgpack-safe
    (bad,) = eng.llm.collective_rpc(reload_matches, args=(wire,))
    if bad:
        print("differ:", bad[:5], file=sys.stderr)
    return not bad


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
    print("@@JSON@@" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    os._exit(0)
