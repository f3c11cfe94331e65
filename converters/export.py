"""Write our model as an HF checkpoint directory (config.json + safetensors shards + index)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from converters.hf import hf_shape, hf_tensor_names, nnx_to_hf, our_path
from converters.safetensors_io import SHARD_BYTES, write_sharded


def param_flat(model: nnx.Module) -> dict[tuple, np.ndarray]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def hf_specs(cfg, dtype_of) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of every HF tensor, known before any value is computed."""
    return [(n, hf_shape(cfg, n), np.dtype(dtype_of(n))) for n in hf_tensor_names(cfg)]


def write_hf_config(out: Path, cfg, dtype: str | None, extra: dict | None = None) -> None:
    hf_cfg = {**(extra or {}), **cfg.to_hf_config()}
    if dtype is not None:
        hf_cfg["torch_dtype"] = str(np.dtype(dtype))
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))


def save_hf(model: nnx.Module, out: Path, dtype: str | None = None,
            max_shard_bytes: int = SHARD_BYTES) -> None:
    """Stream `model` to `out` one tensor at a time (device -> host copies deferred to the write)."""
    cfg = model.cfg
    out.mkdir(parents=True, exist_ok=True)
    flat = param_flat(model)
    lazy = {p: _LazyArray(v) for p, v in flat.items()}
    layout = {n: our_path(cfg, n)[0] for n in hf_tensor_names(cfg)}
    cast = np.dtype(dtype) if dtype is not None else None

    def dtype_of(name):
        return cast if cast is not None else np.dtype(flat[layout[name]][...].dtype)

    def tensors():
        for name, arr in nnx_to_hf(cfg, lazy):
            arr = np.asarray(arr)
            yield name, arr if cast is None else arr.astype(cast)

    write_sharded(out, hf_specs(cfg, dtype_of), tensors(), max_bytes=max_shard_bytes)
    write_hf_config(out, cfg, dtype)


class _LazyArray:
    """Defers the device->host copy of one parameter until the exporter reaches it."""

    def __init__(self, var):
        self.var = var

    @property
    def T(self):
        return np.asarray(self.var[...]).T

    def __getitem__(self, i):
        return np.asarray(self.var[...][i])  # slice on the device, copy only the slice

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.var[...])
        return a if dtype is None else a.astype(dtype)
