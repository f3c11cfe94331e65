"""Orbax checkpoints: `RUN_DIR/checkpoints/STEP/{params,train,meta}`.

- `params`: every model variable (trainable and frozen) keyed by its path; enough for
  `from_pretrained` and `posttrain convert` without knowing the optimizer.
- `train`: optimizer state, step and RNG (resume only).
- `meta`: JSON with the model config, the data iterator position and the policy version.

Saves are asynchronous (training continues while the previous step is written), the last
`checkpoint.keep` are kept, and `resume` picks the latest automatically.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from posttrain import faults
from posttrain.errors import CheckpointError, UserError, warn
from posttrain.models.transformer import dequantize, merge_lora


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


# ---- integrity ---------------------------------------------------------------------------------
def _words(x: jax.Array) -> jax.Array:
    """An array's bits as uint32 words (keys as their key data, 64-bit values as word pairs)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _digests(tree: dict) -> dict:
    """Per array, a Fletcher-style pair (sum of words, sum of words x odd position weights)
    mod 2^32. Integer sums are exact in any order, so the pair is the same whatever the
    sharding or host count; any change to one word changes both, a swap changes the second."""
    def one(x):
        w = _words(x)
        pos = jnp.zeros(w.shape, jnp.uint32)
        stride = 1
        for d in reversed(range(w.ndim)):  # the linear index, built without a reshape
            pos = pos + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
            stride *= w.shape[d]
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32),
                          jnp.sum(w * (pos * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)])

    return {k: one(v) for k, v in tree.items()}


def digests(flat: dict[str, jax.Array]) -> dict[str, list[int]]:
    """`_digests` on the host: plain ints, for the checkpoint's JSON meta."""
    out = _digests({k: jnp.asarray(v) for k, v in flat.items()})
    return {k: [int(x) for x in np.asarray(v.addressable_data(0))] for k, v in out.items()}


def corrupted(flat: dict[str, jax.Array], saved: dict[str, list[int]]) -> list[str]:
    """Keys whose restored values differ from the digests saved with them."""
    now = digests({k: flat[k] for k in saved if k in flat})
    return [k for k in saved if now.get(k) != saved[k]]


class Checkpointer:
    """Orbax's CheckpointManager plus what a run needs to survive faults:

    - every save records a digest of each array in its meta; a restore recomputes them, so a
      bit flip or torn file that still decodes is caught rather than trained on;
    - `restore_latest` walks back from the newest step past any it cannot read or verify,
      moving each aside (`corrupt-STEP-TIME`) with a warning naming both steps; with none
      left it raises rather than starting from scratch;
    - unfinished writes (a kill during an asynchronous save) are reported and cleaned up;
    - a save that fails (disk full) raises `CheckpointError` naming the step; Orbax writes to
      a temporary directory and deletes old steps only after a new one commits, so what was
      saved before stays intact.
    """

    def __init__(self, directory: str | Path, keep: int = 2, async_save: bool = True):
        self.directory = Path(directory).absolute()
        if self.directory.is_dir() and jax.process_index() == 0:
            for tmp in sorted(self.directory.glob("*.orbax-checkpoint-tmp*")):
                warn(f"{tmp}: discarding an unfinished checkpoint write (the run stopped during it)")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=async_save,
                                                 cleanup_tmp_directories=True),
            item_names=("params", "train", "meta"),
        )
        self._pending: int | None = None  # the step whose asynchronous write may still fail

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, train: Any, meta: dict, *, force: bool = False) -> None:
        params, train = flatten(params), flatten(train)
        meta = {**meta, "digests": {"params": digests(params), "train": digests(train)}}
        with self._failures(step):
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), train=ocp.args.StandardSave(train),
                meta=ocp.args.JsonSave(meta)), force=force)
            self._pending = step
        faults.point("checkpoint_write")  # the asynchronous write is in flight

    def restore(self, step: int, params_target: Any, train_target: Any) -> tuple[Any, Any, dict]:
        targets = {"params": flatten(params_target), "train": flatten(train_target)}
        for item, target in targets.items():
            self._check_structure(step, item, target)
        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(targets["params"])),
            train=ocp.args.StandardRestore(_abstract(targets["train"])),
            meta=ocp.args.JsonRestore()))
        meta = dict(out["meta"])
        saved = meta.get("digests") or {}  # absent in checkpoints from before digests
        bad = [f"{item}/{k}" for item in ("params", "train")
               for k in corrupted(out[item], saved.get(item, {}))]
        if bad:
            raise ValueError(f"{len(bad)} arrays differ from their saved digests ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''})")
        return (unflatten_like(params_target, out["params"]),
                unflatten_like(train_target, out["train"]), meta)

    def _check_structure(self, step: int, item: str, target: dict) -> None:
        """A checkpoint saved by a different model or optimizer is the recipe's problem
        (`UserError`), not corruption: it must not be moved aside. Unreadable metadata is."""
        saved = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / item)
        where = f"{self.directory / str(step)}: {item}"
        if set(saved) != set(target):
            diff = sorted(set(saved) ^ set(target))
            raise UserError(f"{where}: saved with different variables than this recipe builds "
                            f"({', '.join(diff[:3])}{', ...' if len(diff) > 3 else ''}); the "
                            "model, LoRA or optimizer keys changed: use a new run_dir")
        for k, m in saved.items():
            x = target[k]
            if tuple(m.shape) != tuple(x.shape) or str(np.dtype(m.dtype)) != str(x.dtype):
                raise UserError(f"{where}/{k}: saved as {tuple(m.shape)} {np.dtype(m.dtype)}, this "
                                f"recipe builds {tuple(x.shape)} {np.dtype(x.dtype)}; use a new run_dir")

    def restore_latest(self, restore: Callable[[int], Any]) -> tuple[int, Any] | None:
        """`restore(step)` on the newest step that restores and verifies, or None when there
        is no checkpoint at all. Unusable steps are moved aside with a warning."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        problems = []
        for i, step in enumerate(steps):
            try:
                return step, restore(step)
            except UserError:
                raise
            except Exception as e:  # orbax/tensorstore raise many types for unreadable data
                why = _short_reason(e)
                problems.append(f"{step}: {why}")
                aside = self._move_aside(step)
                nxt = f"falling back to step {steps[i + 1]}" if i + 1 < len(steps) else \
                    "no earlier checkpoint"
                warn(f"checkpoint {self.directory / str(step)} is unusable ({why}); moved to "
                     f"{aside.name}; {nxt}")
        if problems:
            raise CheckpointError(f"{self.directory}: no usable checkpoint ({'; '.join(problems)}); "
                                  "the unusable ones were moved aside as corrupt-STEP-*. To start "
                                  "from scratch set checkpoint.resume=false or use a new run_dir")
        return None

    def _move_aside(self, step: int) -> Path:
        src = self.directory / str(step)
        dst = self.directory / f"corrupt-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0 and src.exists():
            src.rename(dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"posttrain-checkpoint-aside-{step}")
        self.manager.reload()
        return dst

    def wait(self) -> None:
        with self._failures(self._pending):
            self.manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self.manager.close()

    @contextlib.contextmanager
    def _failures(self, step: int | None):
        """A failed write (raised by Orbax now, or by the previous asynchronous save) becomes
        one line naming the step, the directory and the OS's reason."""
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:
            reason = _os_reason(e)
            if reason is None:
                raise
            failed = re.search(r"/(\d+)\.orbax-checkpoint-tmp", _chain_text(e))
            step = int(failed.group(1)) if failed else step
            if jax.process_index() == 0:  # the partial write only holds the space it took
                for tmp in self.directory.glob("*.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            kept = [s for s in self.manager.all_steps() if s != step]
            raise CheckpointError(
                f"{self.directory}: writing checkpoint {step} failed: {reason}; "
                + (f"checkpoint {max(kept)} is intact" if kept else "no earlier checkpoint")
                + "; free space and run the same command again to resume") from None


def _short_reason(e: BaseException) -> str:
    """One readable line for why a restore failed: TensorStore's status line (OUT_OF_RANGE,
    NOT_FOUND, ...) from anywhere in the exception chain if there is one, without its spec."""
    chain = _chain(e)
    lines = [str(x).strip().splitlines()[0] for x in chain if str(x).strip()]
    status = [ln for ln in lines if re.match(r"[A-Z_]{5,}: ", ln)]
    line = (status or lines or [type(chain[0]).__name__])[0]
    return line.split(" [tensorstore_spec")[0][:300]


def _chain(e: BaseException | None) -> list[BaseException]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _chain_text(e: BaseException) -> str:
    return "\n".join(str(x) for x in _chain(e))


def _os_reason(e: BaseException) -> str | None:
    """The OS error behind an exception from Orbax/TensorStore (they wrap it in their own
    types, sometimes only in the message), or None if it is not one."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno:
            return f"{os.strerror(x.errno)} ({errno.errorcode.get(x.errno, x.errno)})"
        for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EIO):
            if os.strerror(code) in str(x):
                return f"{os.strerror(code)} ({errno.errorcode[code]})"
    return None


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
        value = dequantize(np.asarray(read(f"{stem}/array/qvalue/value")),
                           np.asarray(read(f"{stem}/array/scale/value")))
    lora = stem[: -len("kernel")] + "kernel_lora_"
    if stem.endswith("kernel") and f"{lora}a/value" in keys:
        a, b = np.asarray(read(f"{lora}a/value")), np.asarray(read(f"{lora}b/value"))
        value = merge_lora(value, a, b, lora_scale)
    return value


def canonical_params(flat: dict[str, np.ndarray], lora_scale: float | None) -> dict[tuple, np.ndarray]:
    """Saved variables -> plain parameters keyed by path tuples (see `canonical_param`), so
    that any checkpoint of ours loads as an ordinary model."""
    return {_path(stem): canonical_param(flat.__getitem__, flat, stem, lora_scale)
            for stem in param_stems(flat)}
