"""Load a model from an HF safetensors directory or one of our Orbax checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from converters.hf import hf_to_nnx
from posttrain.errors import UserError
from posttrain.models.config import ModelConfig
from posttrain.models.transformer import CausalLM


def abstract_model(cfg: ModelConfig) -> CausalLM:
    """A model whose parameters are shape-only (no memory), ready to receive real values."""
    return nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0)))


def param_paths(model: nnx.Module) -> dict[tuple, nnx.Variable]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def set_params(model: nnx.Module, flat: dict[tuple, np.ndarray]) -> nnx.Module:
    """Write `flat` (our path -> array) into `model`; every parameter must be given, shapes must match."""
    state = nnx.state(model, nnx.Param)
    leaves = {tuple(p): v for p, v in nnx.to_flat_state(state)}
    missing = [p for p in leaves if tuple(p) not in flat]
    if missing:
        raise UserError(f"checkpoint lacks parameters: {['.'.join(map(str, p)) for p in missing[:5]]}")
    for path, var in leaves.items():
        arr = flat[tuple(path)]
        if tuple(arr.shape) != tuple(var.shape):
            raise UserError(f"parameter {'.'.join(map(str, path))}: shape {tuple(arr.shape)} "
                            f"does not match the config's {tuple(var.shape)}")
        var.set_value(jnp.asarray(arr, dtype=var.dtype))
    nnx.update(model, state)
    return model


def read_hf_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path}: no config.json (not an HF model directory)")
    return json.loads(cfg_file.read_text())


class SafetensorsReader:
    """Memory-mapped access to every tensor of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = path / "model.safetensors"
            if not single.is_file():
                raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json")
            with safe_open(single, framework="numpy") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        self.path, self.weight_map, self._open = path, weight_map, {}
        for shard in set(weight_map.values()):
            if not (path / shard).is_file():
                raise UserError(f"{path / shard}: shard listed in the index is missing")
        self._safe_open = safe_open

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> np.ndarray:
        shard = self.weight_map.get(name)
        if shard is None:
            raise UserError(f"{self.path}: tensor {name} is missing")
        if shard not in self._open:
            # numpy cannot hold bf16 from safetensors' numpy view; torch-free path via "flax".
            self._open[shard] = self._safe_open(self.path / shard, framework="flax")
        return np.asarray(self._open[shard].get_tensor(name))


def load_hf(path: str | Path, **overrides) -> CausalLM:
    path = Path(path)
    cfg = ModelConfig.from_hf_config(read_hf_config(path), **overrides)
    reader = SafetensorsReader(path)
    model = abstract_model(cfg)
    return set_params(model, hf_to_nnx(cfg, reader.get))


def resolve_model_path(path: str | Path) -> Path:
    """A local directory, or an HF hub id (`org/name`) fetched into / read from the local cache."""
    p = Path(path)
    if p.exists():
        return p
    if str(path).count("/") == 1 and not str(path).startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors",
                                                                     "*.txt", "*.model", "*.jinja"]))
        except Exception as e:
            raise UserError(f"{path}: not a local directory, and fetching it from the hub failed: "
                            f"{type(e).__name__}: {e}") from None
    raise UserError(f"{path}: no such model directory")


def load_model(path: str | Path, **overrides) -> CausalLM:
    path = resolve_model_path(path)
    if (path / "config.json").is_file():
        return load_hf(path, **overrides)
    from posttrain.train.checkpoint import load_model_from_checkpoint

    return load_model_from_checkpoint(path, **overrides)
