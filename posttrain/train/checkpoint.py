"""Orbax checkpoints: `RUN_DIR/checkpoints/STEP/{params,train,meta}`.

- `params`: every model variable (trainable and frozen) keyed by its path; enough for
  `from_pretrained` and `posttrain convert` without knowing the optimizer.
- `train`: optimizer state, step and RNG (resume only).
- `meta`: JSON with the model config, the data iterator position and the policy version.

Saves are asynchronous (training continues while the previous step is written), the last
`checkpoint.keep` are kept, and `resume` picks the latest automatically.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from posttrain.errors import UserError


def flatten(tree: Any) -> dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): v for p, v in leaves}


def unflatten_like(target: Any, flat: dict[str, Any]) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    return jax.tree_util.tree_unflatten(
        treedef, [flat[jax.tree_util.keystr(p, simple=True, separator="/")] for p, _ in paths])


def _abstract(tree: Any) -> Any:
    def one(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(one, tree)


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=async_save),
            item_names=("params", "train", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, train: Any, meta: dict, *, force: bool = False) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(flatten(params)),
            train=ocp.args.StandardSave(flatten(train)),
            meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, params_target: Any, train_target: Any) -> tuple[Any, Any, dict]:
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(flatten(params_target))),
            train=ocp.args.StandardRestore(_abstract(flatten(train_target))),
            meta=ocp.args.JsonRestore()))
        return (unflatten_like(params_target, out["params"]),
                unflatten_like(train_target, out["train"]), dict(out["meta"]))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def save_train_state(ckpt: Checkpointer, step: int, graphdef, state, model_cfg, data_state: dict,
                     lora: dict, **extra_meta) -> None:
    """Save a TrainState: the full model (trainable + frozen) as `params`, the rest as `train`."""
    full = nnx.state(nnx.merge(graphdef, state.params, state.frozen))
    meta = {"model_config": model_cfg.model_dump(mode="json"), "data_state": data_state,
            "step": step, "lora": lora, **extra_meta}
    train = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
    ckpt.save(step, full, train, meta, force=True)


def restore_train_state(ckpt: Checkpointer, step: int, graphdef, state, trainable):
    """The inverse of `save_train_state`, restored into `state`'s structure and shardings."""
    from posttrain.train.step import TrainState

    full = nnx.state(nnx.merge(graphdef, state.params, state.frozen))
    train = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
    full, train, meta = ckpt.restore(step, full, train)
    _, params, frozen = nnx.split(nnx.merge(graphdef, full), trainable, ...)
    return TrainState(params, frozen, train["opt_state"], train["step"], train["rng"]), meta


def find_checkpoint(path: str | Path) -> tuple[Path, int]:
    """Accept a run dir, its checkpoints dir, or one step dir; return (checkpoints dir, step)."""
    path = Path(path).absolute()
    for cand in (path / "checkpoints", path):
        if cand.is_dir():
            steps = sorted(int(p.name) for p in cand.iterdir() if p.name.isdigit()
                           and (p / "meta").exists())
            if steps:
                return cand, steps[-1]
    if path.name.isdigit() and (path / "meta").exists():
        return path.parent, int(path.name)
    raise UserError(f"{path}: no Orbax checkpoint found (expected STEP/meta inside)")


def read_meta(ckpt_dir: Path, step: int) -> dict:
    meta_dir = ckpt_dir / str(step) / "meta"
    files = list(meta_dir.glob("*")) if meta_dir.is_dir() else []
    for f in files:
        if f.is_file():
            try:
                return json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
    raise UserError(f"{meta_dir}: checkpoint metadata missing or unreadable")


def restore_params_flat(ckpt_dir: Path, step: int) -> dict[str, np.ndarray]:
    """Every saved variable as a host array, whatever mesh or host count saved it."""
    path = ckpt_dir / str(step) / "params"
    ckptr = ocp.StandardCheckpointer()
    tree = ocp.StandardCheckpointHandler().metadata(path)
    on_host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    target = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=on_host) for k, m in tree.items()}
    return {k: np.asarray(v) for k, v in ckptr.restore(path, target).items()}


def _path(stem: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in stem.split("/"))


def param_stems(keys) -> list[str]:
    """Saved variable keys -> the plain parameters they make (`.../q_proj/kernel`): int8 kernels
    (`kernel/array/{qvalue,scale}`) and LoRA adapters (`kernel_lora_{a,b}`) fold into theirs."""
    stems = []
    for key in keys:
        parts = key.split("/")
        if parts[-1] != "value":
            continue
        parts = parts[:-1]
        if parts[-3:] == ["kernel", "array", "qvalue"]:
            parts = parts[:-2]
        elif parts[-3:-1] == ["kernel", "array"] or parts[-1].startswith("kernel_lora_"):
            continue
        stems.append("/".join(parts))
    return stems


def canonical_param(read: Callable[[str], np.ndarray], keys, stem: str,
                    lora_scale: float | None) -> np.ndarray:
    """One plain parameter: an int8 (qwix QArray) kernel dequantized, a LoRA adapter merged,
    W' = W + (alpha / rank) A B. `read(key)` fetches one saved variable."""
    if f"{stem}/value" in keys:
        value = np.asarray(read(f"{stem}/value"))
    else:
        value = (np.asarray(read(f"{stem}/array/qvalue/value"), np.float32)
                 * np.asarray(read(f"{stem}/array/scale/value"), np.float32))
    lora = stem[: -len("kernel")] + "kernel_lora_"
    if stem.endswith("kernel") and f"{lora}a/value" in keys:
        a, b = np.asarray(read(f"{lora}a/value")), np.asarray(read(f"{lora}b/value"))
        value = (value.astype(np.float32) + lora_scale * (a @ b)).astype(value.dtype)
    return value


def canonical_params(flat: dict[str, np.ndarray], lora_scale: float | None) -> dict[tuple, np.ndarray]:
    """Saved variables -> plain parameters keyed by path tuples (see `canonical_param`), so
    that any checkpoint of ours loads as an ordinary model."""
    return {_path(stem): canonical_param(flat.__getitem__, flat, stem, lora_scale)
            for stem in param_stems(flat)}


def load_model_from_checkpoint(path: str | Path, **overrides) -> nnx.Module:
    """An ordinary model from one of our checkpoints, whatever its layer layout, LoRA or int8."""
    from converters.hf import hf_to_nnx, nnx_to_hf
    from converters.loading import abstract_model, set_params
    from posttrain.models.config import ModelConfig

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
