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
    if cfg.scan_layers and isinstance(provider, qwix.LoraProvider):
        return mark_lora_scale(_scanned_lora(model, provider, rngs), provider)
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
    return mark_lora_scale(out, provider)


def mark_lora_scale(model, provider):
    """Gives every Linear that qwix adapted the provider's LoRA scale (alpha / rank) as
    `lora_scale`, so that `layers.dense_heads` can apply its adapters head-major itself; not
    with LoRA dropout, or rules of other scales (qwix then applies them in the Linear's call)."""
    import qwix
    from flax import nnx

    rules = provider._rules  # (qwix keeps them private)
    if (not isinstance(provider, qwix.LoraProvider) or len({(r.alpha, r.rank) for r in rules}) != 1
            or any(r.dropout for r in rules)):
        return model
    for _, m in nnx.iter_modules(model):
        if isinstance(m, nnx.Linear) and hasattr(m, "kernel_lora_a"):
            m.lora_scale = rules[0].alpha / rules[0].rank
    return model


def _scanned_lora(model: CausalLM, provider, rngs) -> CausalLM:
    """LoRA over a scanned model: the adapters of each layer (and, with the provider's
    `weight_qtype`, its int8 base) made by qwix on that layer (a first call of it, as
    `qwix_apply` does for a whole model) inside the `nnx.vmap` that stacks them, so every
    adapter is [L, ...] beside its stacked kernel and the scan slices both; the layer's class
    carries qwix's interception into every call of the scan's body. The compiled program then
    holds one layer, not L (the 0.6B LoRA update compiles for a v5e in 39 s instead of 150 s). qwix matches its rules on module paths; a layer's modules take
    the path of layer 0 (`model/layers/0/self_attn/q_proj`), after checking that the rules
    select the same modules in every layer (a rule for some layers only needs unrolled
    layers: `model.scan_layers: false`)."""
    import re

    import jax.numpy as jnp
    import qwix
    from flax import nnx

    from posttrain.models.layers import DTYPES, rope_inv_freq, rope_tables

    cfg = model.model.cfg
    model = nnx.clone(model)
    graphdef, state = nnx.split(model.model.layers)
    rules = [r.module_path for r in provider._rules]  # (qwix keeps them private)
    rel = [tuple(map(str, p)) for p, node in nnx.graph.iter_graph(model.model.layers)
           if isinstance(node, nnx.Module)]

    def chosen(i):
        return [any(re.fullmatch(r, "/".join(("model", "layers", str(i)) + p)) for r in rules)
                for p in rel]

    if any(chosen(i) != chosen(0) for i in range(1, cfg.num_hidden_layers)):
        raise ValueError("model.lora.target_modules selects modules in some layers only: a "
                         "scanned model adapts every layer alike (set model.scan_layers: false)")
    t = 8
    x = jnp.zeros((1, t, cfg.hidden_size), DTYPES[cfg.compute_dtype])
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    rope = rope_tables(pos, rope_inv_freq(cfg), t)

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def adapted(st, r):
        # qwix's wrap (its interception in the layer's class) without its first call, which
        # would match the rules on paths relative to the layer
        layer = qwix.quantize_model(nnx.merge(graphdef, st), provider, skip_nnx_init=True)
        for path, m in nnx.iter_modules(layer):
            m.qwix_path = ("model", "layers", "0") + tuple(map(str, path))
            m.qwix_rngs, m.disable_quant_stats_update = nnx.data(r), True
        layer(x, pos, jnp.ones_like(pos), rope)  # qwix makes the adapters here
        layer.set_attributes(disable_quant_stats_update=False, qwix_rngs=None)
        return layer

    model.model.layers = adapted(state, rngs)
    return model
