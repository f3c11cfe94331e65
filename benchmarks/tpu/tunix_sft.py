"""The peer of `benchmarks.tpu.train_step`: Tunix 0.1.7's SFT trainer on the same shape and batch.

    PYTHONPATH=$TUNIX_PATH:$PYTHONPATH python -m benchmarks.tpu.tunix_sft --config 0.6b:2x2048

Run by `benchmarks.tpu.train_step --peer tunix` in a process of its own (only Tunix's process
gets Tunix on its path, and one process holds the chip at a time). Tunix as its docs set it up
for a TPU, trained by its `PeftTrainer` with AdamW, every position a real token:
- its own Qwen3 (`tunix.models.qwen3.model.Qwen3`, random weights of the 0.6B preset), bf16
  compute over f32 parameters, its splash attention (`use_flash_attention`), its remat of the
  whole decoder layer, full fine-tuning;
- for `llama1b` its Llama 3 (3.2-1B preset; no splash or dtype option in it: f32, or bf16
  parameters with `+bf16`), remat of the decoder layer;
- with `+loraR[+int8]` its Qwen3 (8B preset, bf16) with qwix LoRA adapters of rank R on every
  projection over an int8 base where its modules allow it (`tunix_qwen3_lora`); adapters only.
Prints `@@` + JSON: median step seconds and tokens/s after 2 warm-up steps, peak HBM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

WARMUP = 2


def qwen3_config(tiny: bool, tiny_vocab: int, preset: str, param_dtype, remat: str):
    """Tunix's Qwen3 config: `preset` (a `ModelConfig` class method) or a tiny shape; bf16
    compute, `remat` (a `RematConfig` name), its splash attention on a TPU."""
    import jax
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3

    if tiny:
        cfg = qwen3.ModelConfig(num_layers=2, vocab_size=tiny_vocab, embed_dim=64, hidden_dim=128,
                                num_heads=2, head_dim=32, num_kv_heads=1, rope_theta=10000,
                                norm_eps=1e-6, use_tied_embedding=True)
    else:
        cfg = getattr(qwen3.ModelConfig, preset)()
    cfg.dtype, cfg.param_dtype = jnp.bfloat16, param_dtype
    cfg.remat_config = getattr(qwen3.RematConfig, remat)
    cfg.use_flash_attention = jax.default_backend() == "tpu"
    return cfg


def tunix_qwen3(tiny: bool, tiny_vocab: int, param_dtype, remat: str):
    """Tunix's own Qwen3 with random weights (the 0.6B preset, or a tiny shape), bf16 compute,
    its splash attention on a TPU, on a 1x1 ("fsdp", "tp") mesh: (model, config, mesh)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.utils import mesh as mesh_lib

    cfg = qwen3_config(tiny, tiny_vocab, "qwen3_0p6b", param_dtype, remat)
    mesh = mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
    with mesh:
        return qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)), cfg, mesh


def tunix_llama3(tiny: bool, tiny_vocab: int, remat: str, bf16_params: bool):
    """Tunix's own Llama 3 (the 3.2-1B preset, or a tiny shape) with random weights. Its model
    has no dtype setting: it computes in its parameters' dtype, f32 as made, or bf16 with
    `bf16_params` (the parameters cast after init: our `+bf16` rows' setting, Adam's moments
    then in bf16 too, as optax keeps them in the parameters' dtype)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.llama3 import model as llama3
    from tunix.utils import mesh as mesh_lib

    if tiny:
        cfg = llama3.ModelConfig(num_layers=2, vocab_size=tiny_vocab, embed_dim=64,
                                 hidden_dim=128, num_heads=2, head_dim=32, num_kv_heads=1,
                                 rope_theta=500_000, norm_eps=1e-5, weight_tying=True)
    else:
        cfg = llama3.ModelConfig.llama3p2_1b()
    cfg = dataclasses.replace(cfg, remat_config=getattr(llama3.RematConfig, remat))
    mesh = mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
    with mesh:
        model = llama3.Llama3(cfg, rngs=nnx.Rngs(0))
        if bf16_params:
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    return model, cfg, mesh


def tunix_qwen3_lora(tiny: bool, tiny_vocab: int, rank: int, int8: bool):
    """Tunix's Qwen3 (the 8B preset, or a tiny shape; bf16 parameters) with qwix LoRA adapters
    on every projection, over an int8 frozen base with `int8`, as Tunix's own LoRA recipes make
    it (`qwix.apply_lora_to_model`). Made in host memory and then sent: an 8B's bf16 weights
    (16.4 GB) do not fit the chip beside their int8 copy (ours are made the same way)."""
    import jax
    import jax.numpy as jnp
    import qwix
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.utils import mesh as mesh_lib

    cfg = qwen3_config(tiny, tiny_vocab, "qwen3_8b", jnp.bfloat16, "DECODER")
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu), mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=[cpu]):
        base = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
        # its attention projections are Einsum modules that cast their weight before the
        # einsum, which a qwix int8 weight does not allow: their base stays bf16 (the MLP's
        # nnx.Linear layers, 2/3 of the layer's weights, go int8)
        q = "int8" if int8 else None
        provider = qwix.LoraProvider([
            qwix.LoraRule(module_path=".*(gate_proj|up_proj|down_proj)", rank=rank,
                          alpha=2.0 * rank, weight_qtype=q),
            qwix.LoraRule(module_path=".*(q_proj|k_proj|v_proj|o_proj)", rank=rank,
                          alpha=2.0 * rank)])
        model = qwix.apply_lora_to_model(base, provider, **base.get_model_input())
    mesh = mesh_lib.create_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
    nnx.update(model, jax.device_put(nnx.state(model), jax.devices()[0]))
    return model, cfg, mesh


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="0.6b:2x2048")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape on CPU (the dry run)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from tunix.sft import peft_trainer

    from benchmarks.peers.tunix_bench import gen_model_input_fn, step_clock

    head, *opts = args.config.split("+")
    shape, bs = head.split(":")
    batch, seq = map(int, bs.split("x"))
    lora = next((int(o[4:] or 16) for o in opts if o.startswith("lora")), 0)
    if lora:
        model, cfg, mesh = tunix_qwen3_lora(args.tiny, 512, lora, "int8" in opts)
    elif shape.startswith("llama"):  # no splash option in its Llama 3: XLA attention
        model, cfg, mesh = tunix_llama3(args.tiny, 512, "DECODER", "bf16" in opts)
    else:
        model, cfg, mesh = tunix_qwen3(args.tiny, 512, jnp.float32, "DECODER")

    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_steps=args.steps, checkpoint_root_directory=None,
        metrics_logging_options=None, pbar_description=None)
    trainer = peft_trainer.PeftTrainer(model, optax.adamw(1e-4), config)

    trainer = trainer.with_gen_model_input_fn(gen_model_input_fn)
    clock = step_clock()
    trainer.with_training_hooks(clock)
    rng = np.random.default_rng(0)
    data = [peft_trainer.TrainingInput(
        input_tokens=rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int32),
        input_mask=np.ones((batch, seq), np.int32)) for _ in range(args.steps)]
    with mesh:
        trainer.train(data)
    ends = clock.ends
    steps = [b - a for a, b in zip([clock.start] + ends[:-1], ends)][WARMUP:]
    dt = statistics.median(steps)
    stats = jax.devices()[0].memory_stats() or {}
    print("@@" + json.dumps({"peer": "tunix", "shape": shape, "batch": batch, "seq": seq,
                             "step_s": dt, "tokens_per_s": batch * seq / dt,
                             "peak_bytes": stats.get("peak_bytes_in_use"),
                             "splash": getattr(cfg, "use_flash_attention", False),
                             "params": "bf16" if "bf16" in opts or lora else "f32",
                             "lora_rank": lora, "int8_base": lora > 0 and "int8" in opts}))


if __name__ == "__main__":
    main()
