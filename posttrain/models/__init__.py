"""Model zoo: Qwen3 (dense) and Llama 3 over shared NNX layers; presets; `from_pretrained`."""

from posttrain.models.config import PRESETS, ModelConfig, RopeScaling
from posttrain.models.transformer import CausalLM, KVCache

__all__ = ["PRESETS", "CausalLM", "KVCache", "ModelConfig", "RopeScaling", "build_model",
           "from_pretrained", "qwix_apply"]


def build_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    from flax import nnx

    return CausalLM(cfg, nnx.Rngs(seed))


def from_pretrained(path, **overrides):
    """Load an HF safetensors directory or an Orbax checkpoint directory; returns a CausalLM."""
    from posttrain.models.loading import load_model

    return load_model(path, **overrides)


def qwix_apply(model: CausalLM, provider, rngs=None) -> CausalLM:
    """`model` under a qwix provider: LoRA adapters (`qwix.LoraProvider`, over an int8 base with
    its `weight_qtype`) or quantization (`qwix.QtProvider`). qwix creates its variables in a
    first call of the model; that call runs without remat (a layer under `jax.checkpoint` is a
    copy merged inside it, and variables created there would be lost), the model keeps its
    remat policy for every call after."""
    import jax.numpy as jnp
    import qwix

    cfg = model.model.cfg
    model.model.cfg = cfg.model_copy(update={"remat": "none"})
    x = jnp.zeros((1, 8), jnp.int32)
    try:
        if isinstance(provider, qwix.LoraProvider):
            out = qwix.apply_lora_to_model(model, provider, x, rngs=rngs)
        else:
            out = qwix.quantize_model(model, provider, x)
    finally:
        model.model.cfg = cfg
    out.model.cfg = cfg
    return out
