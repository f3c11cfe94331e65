"""`posttrain convert`: bitwise HF -> Orbax -> HF round trips, transformers/PEFT loading of what
we write, clear errors that leave nothing behind, and streaming memory. (vLLM serving a converted
directory: tests/rollout/test_engines.py::test_vllm_engine_greedy_logprobs_and_sync.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from posttrain.models.safetensors_io import SafetensorsReader
from posttrain.cli import main
from tests.helpers import (
    save_tiny_hf_model,
    save_tiny_model_with_tokenizer,
    torch_logits,
)

ARCHS = [("qwen3", dict(tie=True)), ("qwen3", dict(tie=False, kv=1)),
         ("llama3", dict(tie=False, rope_scaling=True))]


def convert(*args) -> int:
    return main(["convert", *map(str, args)])


def assert_bitwise_same(a: Path, b: Path) -> None:
    ra, rb = SafetensorsReader(a), SafetensorsReader(b)
    assert sorted(ra.names()) == sorted(rb.names())
    for name in ra.names():
        assert ra.shape(name) == rb.shape(name) and ra.dtype(name) == rb.dtype(name), name
        assert ra.get(name).tobytes() == rb.get(name).tobytes(), name


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize("arch,kw", ARCHS, ids=[f"{a}-{'-'.join(map(str, k.values()))}" for a, k in ARCHS])
@pytest.mark.parametrize("layout", [[], ["--scan-layers"], ["--scan-layers", "--mesh", "fsdp=2,tensor=2"]],
                         ids=["unrolled", "scanned", "scanned-sharded"])
def test_hf_orbax_hf_is_bitwise_identical(tmp_path, arch, kw, layout):
    save_tiny_hf_model(tmp_path / "hf", arch, **kw)
    assert convert("hf-to-orbax", tmp_path / "hf", tmp_path / "orbax", *layout) == 0
    assert convert("orbax-to-hf", tmp_path / "orbax", tmp_path / "back") == 0
    assert_bitwise_same(tmp_path / "hf", tmp_path / "back")
    src = json.loads((tmp_path / "hf" / "config.json").read_text())
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
                "head_dim", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert back[key] == src[key], key
    if "--mesh" in layout:  # chunks are the per-device shards of fsdp=2 x tensor=2
        from converters.convert import OrbaxParams

        store = OrbaxParams(tmp_path / "orbax" / "0" / "params")
        q = store.tree["model/layers/self_attn/q_proj/kernel/value"]
        assert q.shape == (2, 128, 256) and q.storage.chunk_shape == (2, 64, 128)


def test_bf16_round_trip_and_dtype_cast(tmp_path):
    import torch

    model = save_tiny_hf_model(tmp_path / "f32", "qwen3")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert convert("hf-to-orbax", tmp_path / "bf16", tmp_path / "orbax") == 0
    assert convert("orbax-to-hf", tmp_path / "orbax", tmp_path / "back") == 0
    assert_bitwise_same(tmp_path / "bf16", tmp_path / "back")
    # f32 -> bf16 on the way in equals torch's own rounding to bf16
    assert convert("hf-to-orbax", tmp_path / "f32", tmp_path / "orbax16", "--dtype", "bfloat16") == 0
    assert convert("orbax-to-hf", tmp_path / "orbax16", tmp_path / "back16") == 0
    assert_bitwise_same(tmp_path / "bf16", tmp_path / "back16")


def test_export_loads_in_transformers_with_the_same_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    ref = save_tiny_hf_model(tmp_path / "hf", "llama3", tie=False, rope_scaling=True)
    assert convert("hf-to-orbax", tmp_path / "hf", tmp_path / "orbax", "--verify") == 0
    assert convert("orbax-to-hf", tmp_path / "orbax", tmp_path / "back", "--verify") == 0
    assert "verify: max |logit difference|" in capsys.readouterr().err
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = np.random.default_rng(1).integers(0, 256, (2, 24))
    np.testing.assert_array_equal(torch_logits(back, ids), torch_logits(ref, ids))


def test_verify_rejects_a_wrong_conversion(tmp_path):
    import jax.numpy as jnp

    from converters.convert import VERIFY_FAILED, VerifyError, compare_logits
    from posttrain.models import from_pretrained

    save_tiny_hf_model(tmp_path / "hf", "qwen3")
    ours = from_pretrained(tmp_path / "hf")
    assert compare_logits(ours, tmp_path / "hf") <= 1e-4
    w = ours.model.layers.mlp.down_proj.kernel
    w.set_value(w[...] + 1e-2 * jnp.ones_like(w[...]))
    with pytest.raises(VerifyError) as e:
        compare_logits(ours, tmp_path / "hf")
    assert e.value.exit_code == VERIFY_FAILED


@pytest.mark.slow
def test_lora_export_loads_in_peft_and_merges(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from posttrain.models.loading import load_model_from_checkpoint
    from tests.train.e2e import run

    save_tiny_model_with_tokenizer(tmp_path / "base", "qwen3", tie=False)
    run("recipes/sft_tiny.yaml", tmp_path / "run",
        [f"model.path={tmp_path / 'base'}", "model.config=null", "model.lora.rank=8",
         "model.lora.alpha=16", "train.steps=6", "train.eval_every=0", "checkpoint.every=0",
         "data.seq_len=64", "data.generated.num_train=400", "optimizer.learning_rate=1e-2",
         "optimizer.warmup_steps=0"])
    assert convert("lora-to-hf", tmp_path / "run", tmp_path / "adapter", "--verify") == 0
    assert convert("lora-to-hf", tmp_path / "run", tmp_path / "merged", "--merge") == 0
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16 and cfg["base_model_name_or_path"] == str(tmp_path / "base")

    ids = np.random.default_rng(2).integers(0, 512, (2, 20))
    ours = load_model_from_checkpoint(tmp_path / "run")
    import jax.numpy as jnp

    want = np.asarray(ours(jnp.asarray(ids, jnp.int32)))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    before = torch_logits(base, ids)
    peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    lora_b = [p for n, p in peft.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # the run trained the adapters
    np.testing.assert_allclose(torch_logits(peft, ids), want, atol=1e-4, rtol=0)
    assert np.abs(before - want).max() > 1e-3  # ... and they matter
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(merged, ids), want, atol=1e-4, rtol=0)


def _unknown_arch(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))


def _missing_shard(d: Path):
    from posttrain.models.export import save_hf
    from posttrain.models import from_pretrained

    model = from_pretrained(d)
    shutil.rmtree(d)
    save_hf(model, d, max_shard_bytes=200_000)
    shards = sorted(d.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()


def _wrong_shape(d: Path):
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 192}))


def _truncated(d: Path):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size * 2 // 3])


@pytest.mark.parametrize("breakage,expect", [
    (_unknown_arch, ["config.json", "gpt2"]),
    (_missing_shard, ["model-00002-of-000", "missing"]),
    (_wrong_shape, ["model.safetensors", "model.layers.0.mlp.gate_proj.weight", "(256, 128)", "(192, 128)"]),
    (_truncated, ["model.safetensors", "truncated", "tensor model."]),
], ids=["unknown-architecture", "missing-shard", "shape-mismatch", "truncated-file"])
def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(tmp_path, capsys, breakage, expect):
    save_tiny_hf_model(tmp_path / "hf", "qwen3")
    breakage(tmp_path / "hf")
    capsys.readouterr()
    assert convert("hf-to-orbax", tmp_path / "hf", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("posttrain: error:")
    assert all(s in err for s in expect), err
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_existing_output_is_never_overwritten(tmp_path, capsys):
    save_tiny_hf_model(tmp_path / "hf", "qwen3")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    capsys.readouterr()
    assert convert("hf-to-orbax", tmp_path / "hf", tmp_path / "out") == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    assert convert("lora-to-hf", tmp_path / "hf", tmp_path / "x") == 2  # not one of our checkpoints
    assert no_leftovers(tmp_path)


@pytest.mark.slow
def test_peak_memory_is_about_two_tensors_plus_a_fixed_overhead(tmp_path):
    """1.2 GB checkpoint, largest tensor 250 MB: peak RSS (VmHWM of a fresh process) below
    2 x the largest tensor + 400 MB (imports ~216 MB, TensorStore's and the allocator's buffers)."""
    from benchmarks.convert_memory import FIXED_OVERHEAD, measure

    r = measure(tmp_path)
    assert r["checkpoint_bytes"] > 1e9
    for direction in ("hf_to_orbax", "orbax_to_hf"):
        assert r[f"tiny_{direction}"] < FIXED_OVERHEAD  # the imports alone
        assert r[f"big_{direction}"] < 2 * r["largest_tensor_bytes"] + FIXED_OVERHEAD, r


@pytest.mark.parametrize("layout", [[], ["--scan-layers"], ["--scan-layers", "--mesh", "expert=4,fsdp=2"]],
                         ids=["unrolled", "scanned", "scanned-expert-sharded"])
def test_moe_round_trip_is_bitwise_identical_and_verifies(tmp_path, layout):
    from tests.models.test_moe import save_tiny_moe

    save_tiny_moe(tmp_path / "hf", experts=8, top_k=2, norm=True)
    assert convert("hf-to-orbax", tmp_path / "hf", tmp_path / "orbax", "--verify", *layout) == 0
    assert convert("orbax-to-hf", tmp_path / "orbax", tmp_path / "back", "--verify") == 0
    assert_bitwise_same(tmp_path / "hf", tmp_path / "back")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["model_type"] == "qwen3_moe" and back["num_experts"] == 8
    if "--mesh" in layout:
        from converters.convert import OrbaxParams

        store = OrbaxParams(tmp_path / "orbax" / "0" / "params")
        up = store.tree["model/layers/mlp/experts/up_proj/value"]
        assert up.shape == (2, 8, 64, 32) and up.storage.chunk_shape == (2, 2, 32, 32)
