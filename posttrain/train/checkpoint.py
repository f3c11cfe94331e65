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
    ckptr = ocp.StandardCheckpointer()
    return ckptr.restore(ckpt_dir / str(step) / "params")


def load_model_from_checkpoint(path: str | Path, **overrides) -> nnx.Module:
    from converters.loading import abstract_model
    from posttrain.models.config import ModelConfig

    ckpt_dir, step = find_checkpoint(path)
    meta = read_meta(ckpt_dir, step)
    cfg = ModelConfig.model_validate(meta["model_config"]).model_copy(update=overrides)
    model = abstract_model(cfg)
    flat = restore_params_flat(ckpt_dir, step)
    state = nnx.state(model)
    # Orbax stores what we saved: the model's variables keyed by path.
    target_keys = flatten(state)
    if cfg.scan_layers != meta["model_config"].get("scan_layers", cfg.scan_layers):
        raise UserError("loading a checkpoint with a different scan_layers setting is not supported; "
                        "convert it with `posttrain convert` first")
    missing = [k for k in target_keys if k not in flat]
    if missing:
        raise UserError(f"{ckpt_dir / str(step)}: checkpoint lacks {missing[:3]}")
    nnx.update(model, unflatten_like(state, {k: flat[k] for k in target_keys}))
    return model
