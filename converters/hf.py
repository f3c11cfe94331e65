"""HF checkpoint names and layouts <-> our NNX parameter state, one map per architecture.

Our parameter paths already mirror HF's (`model.layers.3.self_attn.q_proj`); the differences are
layouts: a Linear `kernel` is [in, out] where torch stores `weight` as [out, in], and with
`scan_layers` every per-layer tensor is stacked on a leading layer axis. `hf_tensor_names` lists a
model's HF tensors, `hf_to_nnx` / `nnx_to_hf` move one tensor at a time so conversions stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from posttrain.models.config import ModelConfig

LAYER_TENSORS = {
    # HF suffix                                 our path suffix                    transpose
    "self_attn.q_proj.weight": (("self_attn", "q_proj", "kernel"), True),
    "self_attn.k_proj.weight": (("self_attn", "k_proj", "kernel"), True),
    "self_attn.v_proj.weight": (("self_attn", "v_proj", "kernel"), True),
    "self_attn.o_proj.weight": (("self_attn", "o_proj", "kernel"), True),
    "self_attn.q_norm.weight": (("self_attn", "q_norm", "weight"), False),
    "self_attn.k_norm.weight": (("self_attn", "k_norm", "weight"), False),
    "mlp.gate_proj.weight": (("mlp", "gate_proj", "kernel"), True),
    "mlp.up_proj.weight": (("mlp", "up_proj", "kernel"), True),
    "mlp.down_proj.weight": (("mlp", "down_proj", "kernel"), True),
    "input_layernorm.weight": (("input_layernorm", "weight"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), False),
}
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": (("model", "embed_tokens", "embedding"), False),
    "model.norm.weight": (("model", "norm", "weight"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def layer_suffixes(cfg: ModelConfig) -> list[str]:
    qk = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    return [s for s in LAYER_TENSORS if cfg.qk_norm or s not in qk]


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(cfg.num_hidden_layers):
        names += [f"model.layers.{i}.{s}" for s in layer_suffixes(cfg)]
    names.append("model.norm.weight")
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def hf_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    suffix = _LAYER_RE.match(name).group(2) if _LAYER_RE.match(name) else name
    return {
        "model.embed_tokens.weight": (v, e), "lm_head.weight": (v, e), "model.norm.weight": (e,),
        "self_attn.q_proj.weight": (h * d, e), "self_attn.k_proj.weight": (k * d, e),
        "self_attn.v_proj.weight": (k * d, e), "self_attn.o_proj.weight": (e, h * d),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e), "mlp.down_proj.weight": (e, f),
        "input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
    }[suffix]


def our_path(cfg: ModelConfig, hf_name: str) -> tuple[tuple, int | None, bool]:
    """HF name -> (our param path, layer index if per-layer, transpose?)."""
    if hf_name in GLOBAL_TENSORS:
        path, transpose = GLOBAL_TENSORS[hf_name]
        return path, None, transpose
    m = _LAYER_RE.match(hf_name)
    if not m or m.group(2) not in LAYER_TENSORS:
        raise KeyError(hf_name)
    suffix, transpose = LAYER_TENSORS[m.group(2)]
    layer = int(m.group(1))
    if cfg.scan_layers:
        return ("model", "layers") + suffix, layer, transpose
    return ("model", "layers", layer) + suffix, None, transpose


def hf_to_nnx(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[tuple, np.ndarray]:
    """Build our flat param dict from HF tensors fetched one at a time by `get(name)`."""
    flat: dict[tuple, np.ndarray] = {}
    stacked: dict[tuple, list] = {}
    for name in hf_tensor_names(cfg):
        path, layer, transpose = our_path(cfg, name)
        arr = get(name)
        arr = arr.T if transpose else arr
        if layer is None:
            flat[path] = arr
        else:
            stacked.setdefault(path, [None] * cfg.num_hidden_layers)[layer] = arr
    for path, arrs in stacked.items():
        flat[path] = np.stack(arrs)
    return flat


def nnx_to_hf(cfg: ModelConfig, flat: dict[tuple, np.ndarray],
              contiguous: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array in HF layout) one tensor at a time. With `contiguous=False` the
    arrays are views (a layer slice, a transpose) of whatever array type `flat` holds, e.g. torch
    tensors over JAX buffers via DLPack: the handover to vLLM then copies nothing."""
    for name in hf_tensor_names(cfg):
        path, layer, transpose = our_path(cfg, name)
        arr = flat[path]
        if layer is not None:
            arr = arr[layer]
        if transpose:
            arr = np.ascontiguousarray(arr.T) if contiguous else arr.T
        yield name, arr
