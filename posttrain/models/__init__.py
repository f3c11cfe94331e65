"""Model zoo: Qwen3 (dense) and Llama 3 over shared NNX layers; presets; `from_pretrained`."""

from posttrain.models.config import PRESETS, ModelConfig, RopeScaling
from posttrain.models.transformer import CausalLM, KVCache

__all__ = ["PRESETS", "CausalLM", "KVCache", "ModelConfig", "RopeScaling", "build_model",
           "from_pretrained"]


def build_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    from flax import nnx

    return CausalLM(cfg, nnx.Rngs(seed))


def from_pretrained(path, **overrides):
    """Load an HF safetensors directory or an Orbax checkpoint directory; returns a CausalLM."""
    from converters.loading import load_model

    return load_model(path, **overrides)
