"""HF checkpoint names and layouts <-> our NNX parameter state, one map per architecture.

Our parameter paths already mirror HF's (`model.layers.3.self_attn.q_proj`); the differences are
layouts: a Linear `kernel` is [in, out] where torch stores `weight` as [out, in], and with
`scan_layers` every per-layer tensor is stacked on a leading layer axis. `hf_tensor_names` lists a
model's HF tensors, `hf_to_nnx` / `nnx_to_hf` move one tensor at a time so conversions stream.
MoE experts are one HF tensor per expert (`mlp.experts.{j}.gate_proj.weight`) and one stacked
[X, in, out] parameter of ours (`mlp.experts.gate_proj`), indexed like the layer axis of scan.
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
    "mlp.gate.weight": (("mlp", "gate", "kernel"), True),  # MoE router
    "input_layernorm.weight": (("input_layernorm", "weight"), False),
    "post_attention_layernorm.weight": (("post_attention_layernorm", "weight"), False),
}
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")  # HF: mlp.experts.{j}.{proj}.weight
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": (("model", "embed_tokens", "embedding"), False),
    "model.norm.weight": (("model", "norm", "weight"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def layer_suffixes(cfg: ModelConfig) -> list[str]:
    qk = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    out = [s for s in LAYER_TENSORS if (cfg.qk_norm or s not in qk)
           and (s not in DENSE_MLP or not cfg.is_moe) and (s != "mlp.gate.weight" or cfg.is_moe)]
    if cfg.is_moe:
        out += [f"mlp.experts.{j}.{p}.weight" for p in EXPERT_PROJS for j in range(cfg.num_experts)]
    return out


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
    fx = cfg.moe_intermediate_size
    suffix = _LAYER_RE.match(name).group(2) if _LAYER_RE.match(name) else name
    expert = _EXPERT_RE.fullmatch(suffix)
    if expert:
        return (e, fx) if expert.group(2) == "down_proj" else (fx, e)
    return {
        "model.embed_tokens.weight": (v, e), "lm_head.weight": (v, e), "model.norm.weight": (e,),
        "self_attn.q_proj.weight": (h * d, e), "self_attn.k_proj.weight": (k * d, e),
        "self_attn.v_proj.weight": (k * d, e), "self_attn.o_proj.weight": (e, h * d),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e), "mlp.down_proj.weight": (e, f),
        "mlp.gate.weight": (cfg.num_experts, e),
        "input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
    }[suffix]


def our_path(cfg: ModelConfig, hf_name: str) -> tuple[tuple, tuple[int, ...], bool]:
    """HF name -> (our param path, index into it (layer when stacked for scan, expert for MoE
    experts; () for a whole parameter), transpose?)."""
    if hf_name in GLOBAL_TENSORS:
        path, transpose = GLOBAL_TENSORS[hf_name]
        return path, (), transpose
    m = _LAYER_RE.match(hf_name)
    expert = _EXPERT_RE.fullmatch(m.group(2)) if m else None
    if expert and cfg.is_moe:
        suffix, index, transpose = ("mlp", "experts", expert.group(2)), (int(expert.group(1)),), True
    elif m and m.group(2) in LAYER_TENSORS:
        (suffix, transpose), index = LAYER_TENSORS[m.group(2)], ()
    else:
        raise KeyError(hf_name)
    layer = int(m.group(1))
    if cfg.scan_layers:
        return ("model", "layers") + suffix, (layer,) + index, transpose
    return ("model", "layers", layer) + suffix, index, transpose


def our_tensors(cfg: ModelConfig) -> dict[tuple, tuple[list[str], bool, tuple[int, ...]]]:
    """Our param path -> (the HF tensors it is built from, in row-major order of the stacking
    axes; transpose?; stacking shape: () whole, (L,) per layer, (X,) / (L, X) experts)."""
    out: dict[tuple, tuple[list[str], bool, list]] = {}
    for name in hf_tensor_names(cfg):
        path, index, transpose = our_path(cfg, name)
        names, _, shape = out.setdefault(path, ([], transpose, [0] * len(index)))
        names.append(name)
        for axis, i in enumerate(index):
            shape[axis] = max(shape[axis], i + 1)
    return {p: (n, t, tuple(s)) for p, (n, t, s) in out.items()}


def build_param(names: list[str], transpose: bool, stack: tuple[int, ...],
                get: Callable[[str], np.ndarray], dtype=None) -> np.ndarray:
    """One of our parameters from its HF tensors; a stacked one is filled one HF tensor at a
    time, so the peak is the result plus one HF tensor."""
    def one(name):
        arr = get(name)
        arr = arr.T if transpose else arr
        return arr if dtype is None else arr.astype(dtype, copy=False)

    if not stack:
        return one(names[0])  # possibly a transposed view: writers copy it in bounded slabs
    first = one(names[0])
    out = np.empty(stack + first.shape, first.dtype)
    rows = out.reshape((-1,) + first.shape)
    rows[0] = first
    del first
    for i, name in enumerate(names[1:], 1):
        rows[i] = one(name)
    return out


def hf_to_nnx(cfg: ModelConfig, get: Callable[[str], np.ndarray]) -> dict[tuple, np.ndarray]:
    """Build our flat param dict from HF tensors fetched one at a time by `get(name)`."""
    return {path: build_param(names, transpose, stack, get)
            for path, (names, transpose, stack) in our_tensors(cfg).items()}


IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some old exports carry


def check_hf_tensors(cfg: ModelConfig, names: list[str], shape_of: Callable[[str], tuple],
                     where: Callable[[str], str], src: str) -> None:
    """Every tensor the config implies exists with the implied shape, and nothing else is there
    (a tensor we would silently drop means the architecture is not the one we think)."""
    from posttrain.errors import UserError

    have = set(names)
    for name in hf_tensor_names(cfg):
        if name not in have:
            raise UserError(f"{src}: tensor {name} is missing (config.json implies it)")
        if tuple(shape_of(name)) != hf_shape(cfg, name):
            raise UserError(f"{where(name)}: tensor {name} has shape {tuple(shape_of(name))} but "
                            f"config.json implies {hf_shape(cfg, name)}")
    expected = set(hf_tensor_names(cfg))
    if cfg.tie_word_embeddings:
        expected.add("lm_head.weight")  # some exports store the tied head anyway
    extra = sorted(n for n in have - expected if not IGNORED.match(n))
    if extra:
        raise UserError(f"{where(extra[0])}: unexpected tensor {extra[0]} (not part of a {cfg.arch} "
                        f"model with this config.json; {len(extra)} such tensor(s))")


def nnx_to_hf(cfg: ModelConfig, flat: dict[tuple, np.ndarray],
              contiguous: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, array in HF layout) one tensor at a time. With `contiguous=False` the
    arrays are views (a layer slice, a transpose) of whatever array type `flat` holds, e.g. torch
    tensors over JAX buffers via DLPack: the handover to vLLM then copies nothing."""
    for name in hf_tensor_names(cfg):
        path, index, transpose = our_path(cfg, name)
        arr = flat[path]
        if index:
            arr = arr[index]
        if transpose:
            arr = np.ascontiguousarray(arr.T) if contiguous else arr.T
        yield name, arr
