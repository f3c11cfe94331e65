"""Write our model as an HF checkpoint directory (config.json + safetensors shards + index)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from converters.hf import nnx_to_hf

SHARD_BYTES = 2 * 1024**3


def param_flat(model: nnx.Module) -> dict[tuple, np.ndarray]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def save_hf(model: nnx.Module, out: Path, dtype: str | None = None) -> None:
    from safetensors.numpy import save_file

    cfg = model.cfg
    out.mkdir(parents=True, exist_ok=True)
    flat = {p: v for p, v in param_flat(model).items()}
    lazy = {p: _LazyArray(v) for p, v in flat.items()}
    shards, current, size = [], {}, 0
    for name, arr in nnx_to_hf(cfg, lazy):
        arr = np.asarray(arr)
        if dtype is not None:
            arr = arr.astype(dtype)
        if current and size + arr.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(arr)
        size += arr.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else \
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": weight_map}, indent=2))
    hf_cfg = cfg.to_hf_config()
    if dtype is not None:
        hf_cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))


class _LazyArray:
    """Defers the device->host copy of one parameter until the exporter reaches it."""

    def __init__(self, var):
        self.var = var

    @property
    def T(self):
        return np.asarray(self.var[...]).T

    def __getitem__(self, i):
        return np.asarray(self.var[...])[i]

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.var[...])
        return a if dtype is None else a.astype(dtype)
