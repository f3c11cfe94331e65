"""Write our model as an HF checkpoint directory (config.json + safetensors shards + index)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from posttrain.models.hf import hf_shape, hf_tensor_names, nnx_to_hf, our_path
from posttrain.models.safetensors_io import SHARD_BYTES, write_sharded


def param_flat(model: nnx.Module) -> dict[tuple, np.ndarray]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _key_name(k) -> str:
    """One pytree path entry as checkpoints spell it (dict key, list index, dataclass field)."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


class EffectiveParams:
    """The plain parameters the policy computes with, by path, computed one at a time when asked
    for: a LoRA kernel merged, W + (alpha / rank) A B, an int8 kernel dequantized
    (`posttrain.train.checkpoint.canonical_param`, the rule checkpoints load by). A plain
    parameter is the trainer's array itself (no copy)."""

    def __init__(self, state: nnx.State, lora_scale: float | None):
        leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
        self._vars = {"/".join(map(_key_name, path)) + "/value": v for path, v in leaves}
        self._scale = lora_scale
        # every parameter is the trainer's own array (no LoRA merge, no dequantization)
        self.plain = not any("_lora_a/" in k or "/qvalue/" in k for k in self._vars)

    def __getitem__(self, path: tuple):
        return self.get(path)

    def get(self, path: tuple, index: tuple[int, ...] = ()):
        """`self[path][index]`, computing only that slice (one layer / expert of a stacked
        parameter: a LoRA merge or int8 dequantization of one layer, a device slice of a plain
        one), so an exporter never holds more than one HF tensor of work."""
        from posttrain.train.checkpoint import canonical_param

        stem = "/".join(map(str, path))
        if f"{stem}/value" in self._vars and f"{stem}_lora_a/value" not in self._vars:
            v = self._vars[f"{stem}/value"]
            return v[index] if index else v
        if f"{stem}_lora_a/value" in self._vars and self._scale is None:
            raise ValueError(f"{stem}: a LoRA kernel, but no lora_scale (alpha / rank) given")
        return canonical_param(lambda k: _take(self._vars[k], index), self._vars, stem, self._scale)

    def dtype(self, path: tuple) -> np.dtype:
        """The dtype `self[path]` will have, without computing it (int8 dequantizes to f32)."""
        stem = "/".join(map(str, path))
        if f"{stem}/value" in self._vars:
            return np.dtype(self._vars[f"{stem}/value"].dtype)
        return np.dtype(np.float32)


def host_array(x) -> np.ndarray:
    """`x` on the host. An array spread over several processes (a multi-host trainer) is
    gathered: every process must then call this for the same arrays in the same order."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _take(arr, index: tuple[int, ...]):
    """`arr[index]` over the leading stacking axes; an axis of size 1 broadcasts (an int8
    scale shared by all layers keeps its single row)."""
    return arr[tuple(i if n > 1 else 0 for i, n in zip(index, arr.shape))] if index else arr


def hf_specs(cfg, dtype_of) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every HF tensor, known before any value is computed."""
    return [(n, hf_shape(cfg, n), np.dtype(dtype_of(n))) for n in hf_tensor_names(cfg)]


def write_hf_config(out: Path, cfg, dtype: str | None, extra: dict | None = None) -> None:
    hf_cfg = {**(extra or {}), **cfg.to_hf_config()}
    if dtype is not None:
        hf_cfg["torch_dtype"] = str(np.dtype(dtype))
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))


def save_hf(model: nnx.Module, out: Path, dtype: str | None = None,
            max_shard_bytes: int = SHARD_BYTES, lora_scale: float | None = None,
            write: bool = True) -> None:
    """Stream `model` to `out` one tensor at a time (device -> host copies deferred to the
    write); LoRA adapters merged (`lora_scale` = alpha / rank) and int8 kernels dequantized.
    In a multi-host trainer every process calls this (each tensor is gathered) and one
    writes (`write`)."""
    cfg = model.cfg
    out.mkdir(parents=True, exist_ok=True)
    flat = EffectiveParams(nnx.state(model), lora_scale)
    layout = {n: our_path(cfg, n)[0] for n in hf_tensor_names(cfg)}
    lazy = {p: _LazyArray(flat, p) for p in set(layout.values())}
    cast = np.dtype(dtype) if dtype is not None else None

    def dtype_of(name):
        return cast if cast is not None else flat.dtype(layout[name])

    def tensors():
        for name, arr in nnx_to_hf(cfg, lazy):
            arr = np.asarray(arr)
            yield name, arr if cast is None else arr.astype(cast)

    if not write:
        for _ in tensors():
            pass
        return
    write_sharded(out, hf_specs(cfg, dtype_of), tensors(), max_bytes=max_shard_bytes)
    write_hf_config(out, cfg, dtype)


class _LazyArray:
    """Defers the device->host copy of one parameter until the exporter reaches it."""

    def __init__(self, params, path):
        self.params, self.path = params, path

    @property
    def T(self):
        return host_array(self.params[self.path]).T

    def __getitem__(self, i):
        return host_array(self.params[self.path][i])  # slice on the device, copy only the slice

    def __array__(self, dtype=None, copy=None):
        a = host_array(self.params[self.path])
        return a if dtype is None else a.astype(dtype)
