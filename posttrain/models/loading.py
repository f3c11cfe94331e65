"""Load a model from an HF safetensors directory or one of our Orbax checkpoints (the core's one
way in: training, engines, evaluation and the converters all load through `load_model`)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import ValidationError

from posttrain.errors import UserError
from posttrain.models.config import ModelConfig
from posttrain.models.hf import check_hf_tensors, hf_to_nnx, nnx_to_hf
from posttrain.models.safetensors_io import SafetensorsReader
from posttrain.models.transformer import CausalLM
from posttrain.train.checkpoint import canonical_params, find_checkpoint, read_meta, restore_params_flat


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
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_file}: not valid JSON ({e})") from None


def hf_model_config(path: Path, **overrides) -> ModelConfig:
    """Our ModelConfig from an HF directory's config.json; an unknown architecture or a
    missing field is a UserError naming the file."""
    hf = read_hf_config(path)
    try:
        return ModelConfig.from_hf_config(hf, **overrides)
    except KeyError as e:
        raise UserError(f"{path / 'config.json'}: missing field {e}") from None
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}"
                        for err in e.errors())
        raise UserError(f"{path / 'config.json'}: {why}") from None
    except ValueError as e:
        raise UserError(f"{path / 'config.json'}: {e}") from None


def open_hf_checkpoint(path: Path, cfg: ModelConfig) -> SafetensorsReader:
    """The checkpoint's tensors, checked against the config before anything is read."""
    reader = SafetensorsReader(path)
    check_hf_tensors(cfg, reader.names(), reader.shape, lambda n: str(reader.file(n)), str(path))
    return reader


def load_hf(path: str | Path, **overrides) -> CausalLM:
    path = Path(path)
    cfg = hf_model_config(path, **overrides)
    reader = open_hf_checkpoint(path, cfg)
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


def tokenizer_next_to(p: Path) -> Path | None:
    """The tokenizer of a model directory or checkpoint: in it, or in a run's `tokenizer/`."""
    for cand in (p, p / "tokenizer", p.parent / "tokenizer", p.parent.parent / "tokenizer"):
        if (cand / "tokenizer.json").is_file():
            return cand
    return None


def load_model(path: str | Path, **overrides) -> CausalLM:
    path = resolve_model_path(path)
    if (path / "config.json").is_file():
        return load_hf(path, **overrides)
    return load_model_from_checkpoint(path, **overrides)


def load_model_from_checkpoint(path: str | Path, **overrides) -> nnx.Module:
    """An ordinary model from one of our checkpoints, whatever its layer layout, LoRA or int8."""
    ckpt_dir, step = find_checkpoint(path)
    meta = read_meta(ckpt_dir, step)
    saved = ModelConfig.model_validate(meta["model_config"])
    cfg = saved.model_copy(update=overrides)
    lora = meta.get("lora") or {}
    scale = lora["alpha"] / lora["rank"] if lora.get("rank") else None
    params = canonical_params(restore_params_flat(ckpt_dir, step), scale)
    if cfg.scan_layers != saved.scan_layers:  # re-layout through the HF names
        hf = dict(nnx_to_hf(saved, params))
        params = hf_to_nnx(cfg, hf.__getitem__)
    return set_params(abstract_model(cfg), params)
