"""Bucketed weight transfer (`rollout.transfer`): the bucket plan is fixed by metadata, the
exporter yields the effective weights (dense, scanned, MoE, LoRA over a plain or int8 base)
bit for bit and holds at most a bucket or two, and every transport (in-process, object store,
gloo collective) delivers them bitwise (the engine's hash of what it loaded equals the
exporter's) into both engine kinds, the probe check passing after each sync; a corrupted bucket
is caught."""

import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models import from_pretrained
from posttrain.models.hf import hf_tensor_names
from rollout.buckets import ALIGN, Exporter, export_digest, plan_buckets, unpack
from rollout.jax_engine import JaxEngine
from rollout.transfer import Collective, InProcess, ObjectStore
from rollout.weight_sync import WeightSyncError, check_probe, hf_numpy, probe_sequences, push
from tests.helpers import save_tiny_model_with_tokenizer, with_lora

BUCKET = 1 << 17  # 128 KiB: several buckets, and the embedding (256 KiB) travels alone
LORA_SCALE = 8.0 / 4


def perturbed(model, seed):
    """The policy after training: every parameter moved (a sync that delivers nothing fails)."""
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        v = var[...]
        if jnp.issubdtype(v.dtype, jnp.floating):
            var[...] = v + 0.02 * jax.random.normal(jax.random.key(seed * 1000 + i), v.shape, v.dtype)
    return model


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from tests.models.test_moe import save_tiny_moe

    d = tmp_path_factory.mktemp("transfer")
    save_tiny_model_with_tokenizer(d / "dense", "qwen3")
    save_tiny_moe(d / "moe", experts=4, top_k=2, norm=True, head_dim=64)
    return d


POLICIES = ["dense", "scanned", "moe", "lora", "lora_int8"]


def policy(dirs, kind):
    """(policy model, lora_scale, engine model dir)."""
    if kind == "moe":
        return perturbed(from_pretrained(dirs / "moe", scan_layers=True), 1), None, dirs / "moe"
    d = dirs / "dense"
    if kind.startswith("lora"):
        return with_lora(from_pretrained(d, scan_layers=False), kind == "lora_int8"), LORA_SCALE, d
    return perturbed(from_pretrained(d, scan_layers=kind == "scanned"), 2), None, d


def test_bucket_plan_is_fixed_ordered_bounded_and_aligned():
    specs = [(f"t{i}", (n,), "float32") for i, n in enumerate([10, 30000, 5, 40000, 7, 1, 9000])]
    plan = plan_buckets(specs, 1 << 17)
    assert plan == plan_buckets(specs, 1 << 17)
    assert [t.name for b in plan for t in b.tensors] == [s[0] for s in specs]  # the given order
    for b in plan:
        ends = [t.offset + t.nbytes for t in b.tensors]
        assert all(t.offset % ALIGN == 0 for t in b.tensors)
        assert all(e <= t.offset for e, t in zip(ends, b.tensors[1:]))  # no overlap
        assert b.nbytes == ends[-1] and (b.nbytes <= 1 << 17 or len(b.tensors) == 1)
    # 40 + 120000 + 20 bytes fit in 128 KiB; 160000 bytes travel alone; then 28 + 4 + 36000
    assert [len(b.tensors) for b in plan] == [3, 1, 3]
    assert [t.offset for t in plan[0].tensors] == [0, 64, 120064]


@pytest.mark.parametrize("kind", POLICIES)
def test_exporter_yields_the_effective_weights_bitwise(dirs, kind):
    model, scale, _ = policy(dirs, kind)
    cfg, state = model.cfg, nnx.state(model)
    want = hf_numpy(state, cfg, scale)  # the whole-model export (one full merge per parameter)
    hf = Exporter(state, cfg, layout="hf", lora_scale=scale, bucket_bytes=BUCKET)
    ours = Exporter(state, cfg, layout="jax", lora_scale=scale, bucket_bytes=BUCKET)
    assert [t.name for b in hf.plan for t in b.tensors] == hf_tensor_names(cfg)
    assert len(hf.plan) > 2
    for (m1, b1), (m2, b2) in zip(hf.buckets(), ours.buckets()):
        for (name, a), (_, o) in zip(unpack(m1, b1), unpack(m2, b2)):
            assert a.dtype == np.float32 and np.array_equal(a, want[name]), name
            assert np.array_equal(o, want[name].T if hf.sources[name][2] else want[name]), name
    if kind.startswith("lora"):  # independently: W + (alpha / r) A B for one adapted kernel
        lyr = model.model.layers[1].self_attn.q_proj
        w = lyr.kernel[...]
        w = (np.asarray(w.array.qvalue, np.float32) * np.asarray(w.array.scale, np.float32)
             if kind == "lora_int8" else np.asarray(w))
        merged = w + LORA_SCALE * np.asarray(lyr.kernel_lora_a[...]) @ np.asarray(lyr.kernel_lora_b[...])
        np.testing.assert_allclose(want["model.layers.1.self_attn.q_proj.weight"], merged.T,
                                   rtol=1e-6, atol=1e-7)


def test_export_holds_at_most_two_buckets_of_host_memory(dirs):
    """Host (numpy) memory while exporting and sending bucket by bucket: the bucket being packed,
    the one before it (in flight), and one tensor of work -- never the model."""
    model, scale, _ = policy(dirs, "lora_int8")
    ex = Exporter(nnx.state(model), model.cfg, lora_scale=scale, bucket_bytes=BUCKET)
    biggest = max(b.nbytes for b in ex.plan)
    largest_tensor = max(t.nbytes for b in ex.plan for t in b.tensors)
    assert ex.nbytes > 4 * biggest
    for payloads in (ex.buckets, ex.host_arrays):  # packed, or one object per bucket
        tracemalloc.start()
        try:
            prev = None
            for meta, bucket in payloads():
                prev = bucket  # a transport keeps the previous bucket until the engines have it
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del prev
        assert peak <= 2 * biggest + 2 * largest_tensor, (payloads, peak, biggest, largest_tensor)
    # reused buffers: packing allocates only the work of one tensor (a LoRA merge over int8:
    # the dequantized W, A B and their sum)
    ring = [np.zeros(biggest, np.uint8) for _ in range(2)]
    tracemalloc.start()
    try:
        for meta, bucket in ex.buckets(ring):
            assert bucket.base is ring[meta.index % 2]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 3 * largest_tensor, peak


def test_streamed_update_is_all_or_nothing(dirs):
    model, _, d = policy(dirs, "dense")
    eng = JaxEngine(from_pretrained(d))
    ex = Exporter(nnx.state(model), model.cfg, layout="jax", bucket_bytes=BUCKET)
    eng.start_weight_update(1)
    for meta, buf in list(ex.buckets())[:-1]:  # the last bucket never arrives
        eng.load_weights(unpack(meta, buf), "jax")
    with pytest.raises(RuntimeError, match="incomplete: .* not received"):
        eng.finish_weight_update(1)
    assert eng.version == 0  # still serving the old weights, whole


@pytest.mark.parametrize("kind", POLICIES)
def test_in_process_transport_into_the_jax_engine(dirs, kind):
    """The streamed path a JAX engine in another process runs (the colocated one takes the
    trainer's NNX state itself: `test_probe`), here in process, bucket by bucket."""
    model, scale, d = policy(dirs, kind)
    eng = JaxEngine(from_pretrained(d, scan_layers=kind != "scanned"))  # either layout receives
    ex = Exporter(nnx.state(model), model.cfg, layout="jax", lora_scale=scale, bucket_bytes=BUCKET)
    m = InProcess(eng).send(ex, 1, check_digest=True)
    assert m["sync/buckets"] > 2 and eng.version == 1
    assert eng.last_digest == export_digest(ex)
    m = check_probe([eng], model, probe_sequences(model.cfg.vocab_size), 1)
    assert m["sync/probe_gap"] <= (0.0 if scale is None else 1e-4)
    assert m["sync/probe_sampled_gap"] <= 1e-4  # prefill, cache and sampler: the trainer's model


def vllm_in_process(root, model: str) -> None:
    """Every policy of `model`'s architecture into one vLLM engine in this process."""
    from rollout.vllm_engine import VllmEngine

    eng = VllmEngine(str(root / model), max_model_len=256, gpu_memory_utilization=0.1,
                     enforce_eager=True)
    for v, kind in enumerate([k for k in POLICIES if (k == "moe") == (model == "moe")], start=1):
        pol, scale, _ = policy(root, kind)
        m = push([eng], nnx.state(pol), pol.cfg, v, probe=probe_sequences(pol.cfg.vocab_size),
                 model=pol, lora_scale=scale, bucket_bytes=BUCKET, check_digest=True)
        # plain weights go as views in one call; computed ones (LoRA merges) bucket by bucket
        assert m["sync/buckets"] == 1 if scale is None else m["sync/buckets"] > 2, (kind, m)
        assert m["sync/probe_gap"] <= 1e-3, (kind, m)
        print(kind, "ok", m["sync/probe_gap"])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_in_process_transport_into_vllm(dirs, model):
    """vLLM keeps one engine per process (its parallel state is global): each model runs in a
    child process of its own."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "tests.rollout.test_transfer", str(dirs), model],
                       cwd=root, env={**os.environ, "PYTHONPATH": str(root), "XLA_FLAGS": ""},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count(" ok ") == (1 if model == "moe" else 4)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}})
    yield
    ray.shutdown()


def group_spec(engine, d):
    if engine == "jax":
        return {"kind": "jax", "model_dir": str(d), "scan_layers": False}
    return {"kind": "vllm", "model_dir": str(d),
            "vllm": {"max_model_len": 256, "gpu_memory_utilization": 0.1, "enforce_eager": True}}


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["jax", "vllm"])
def test_ray_transports_deliver_bitwise(dirs, ray_cluster, engine):
    """Two JAX workers for the dense model (the broadcast reaches more than one receiver), one
    otherwise (vLLM's CPU start is slow; CI time); every policy over both transports,
    alternating, so each sync must replace the previous one's weights."""
    from rollout.worker import WorkerGroup

    sizes = {"dense": 2 if engine == "jax" else 1, "moe": 1}
    groups = {k: WorkerGroup(group_spec(engine, dirs / k), n) for k, n in sizes.items()}
    try:
        v = 0
        for kind in POLICIES:
            model, scale, d = policy(dirs, kind)
            for transport in ("object_store", "collective"):
                v += 1
                m = push([groups[d.name]], nnx.state(model), model.cfg, v,
                         probe=probe_sequences(model.cfg.vocab_size), model=model, lora_scale=scale,
                         transport=transport, bucket_bytes=BUCKET, check_digest=True)
                tol = 1e-3 if engine == "vllm" else (0.0 if scale is None else 1e-4)
                assert m["sync/probe_gap"] <= tol, (kind, transport, m)
                assert groups[d.name].versions() == [v] * sizes[d.name]

        # a bucket corrupted in flight: the engine's hash and the probe both catch it
        model, _, d = policy(dirs, "dense")
        group = groups["dense"]

        def corrupting(update):
            def patched(self, meta, payload):
                if meta.index == 2:  # a packed buffer (collective) or the bucket's arrays
                    if isinstance(payload, list):
                        (name, arr), *rest = payload
                        payload = [(name, np.zeros_like(arr)), *rest]
                    else:
                        payload = payload.copy()
                        payload[meta.tensors[0].offset:meta.tensors[0].offset + 64] = 0
                return update(self, meta, payload)
            return patched

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ObjectStore, "update", corrupting(ObjectStore.update))
            mp.setattr(Collective, "update", corrupting(Collective.update))
            with pytest.raises(WeightSyncError, match="differ from those sent"):
                push([group], nnx.state(model), model.cfg, v + 1, transport="object_store",
                     bucket_bytes=BUCKET, check_digest=True)
            with pytest.raises(WeightSyncError, match=r"rollout worker 0 .* version %d" % (v + 2)):
                push([group], nnx.state(model), model.cfg, v + 2, transport="collective",
                     bucket_bytes=BUCKET, probe=probe_sequences(model.cfg.vocab_size), model=model)
    finally:
        for g in groups.values():
            g.shutdown()


if __name__ == "__main__":
    import os
    import sys
    from pathlib import Path

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    vllm_in_process(Path(sys.argv[1]), sys.argv[2])
    os._exit(0)


def test_exporter_casts_to_the_engine_dtype(dirs):
    """A bf16 engine gets bf16 tensors (rounded once, on the trainer), and they reach torch
    with the same bits (vLLM's side of `_to_torch`)."""
    import ml_dtypes
    import torch

    from rollout.vllm_engine import _to_torch

    model, _, _ = policy(dirs, "scanned")
    want = hf_numpy(nnx.state(model), model.cfg)
    ex = Exporter(nnx.state(model), model.cfg, dtype="bfloat16", bucket_bytes=BUCKET)
    assert ex.nbytes * 2 == sum(a.nbytes for a in want.values())
    for meta, buf in ex.buckets():
        for name, a in unpack(meta, buf):
            assert a.dtype == ml_dtypes.bfloat16
            assert np.array_equal(a.view(np.uint16), want[name].astype(ml_dtypes.bfloat16).view(np.uint16))
            t = _to_torch(a)
            assert t.dtype == torch.bfloat16 and np.array_equal(t.view(torch.int16).numpy(), a.view(np.int16))
