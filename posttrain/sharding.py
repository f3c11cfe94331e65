"""Device mesh and logical-axis sharding.

Model code names the dimensions of parameters (`nnx.Param(..., logical_axes=("embed", "mlp"))`)
and of key activations (`constrain(x, ("batch", "activation_length", "activation_embed"))`); the
recipe's `mesh.rules` table maps each logical name to mesh axes (`data`, `fsdp`, `tensor`,
`expert`). Nothing else in the code mentions a mesh axis, and without an active mesh every
constraint is a no-op, so the same model runs on one device.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec


Rules = Sequence[tuple[str, str | Sequence[str] | None]]
_ACTIVE: list[tuple[Mesh, Rules]] = []


def make_mesh(mesh_cfg, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `MESH_AXES`; multi-slice/multi-host layouts put `dcn` axes outermost."""
    from posttrain.config import MESH_AXES, mesh_shape  # config imports the models, which import us

    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(mesh_cfg, len(devices))
    dcn = [getattr(mesh_cfg.dcn, ax) for ax in MESH_AXES]
    if math.prod(dcn) > 1 and len({d.process_index for d in devices}) > 1:
        from jax.experimental import mesh_utils

        ici = [shape[ax] // n for ax, n in zip(MESH_AXES, dcn)]
        # TPU: a dcn granule is a slice; GPU/CPU hosts: a process
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=devices[0].platform != "tpu")
    else:
        arr = np.asarray(devices).reshape([shape[ax] for ax in MESH_AXES])
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], rules: Rules, mesh: Mesh,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """Map logical names to a PartitionSpec. A mesh axis is used at most once per array, and a
    dimension that its mesh axes do not divide stays replicated (e.g. 2 KV heads on tensor=4)."""
    table = dict(rules)
    used: set[str] = set()
    out = []
    for i, name in enumerate(axes):
        target = table.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        cand = [target] if isinstance(target, str) else list(target)
        cand = [a for a in cand if a not in used and mesh.shape[a] > 1]
        if shape is not None:
            # keep the longest prefix of mesh axes whose product divides the dimension
            while cand and shape[i] % math.prod(mesh.shape[a] for a in cand):
                cand.pop()
        used.update(cand)
        out.append(None if not cand else cand[0] if len(cand) == 1 else tuple(cand))
    return PartitionSpec(*out)


def param_logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    axes = tuple(var.get_metadata().get("logical_axes") or ())
    ndim = len(var.shape)
    if len(axes) == ndim - 1:  # stacked for scan: leading layer axis
        axes = ("layers",) + axes
    if len(axes) != ndim:
        axes = (None,) * ndim
    return axes


def shard_shape(shape: Sequence[int], spec: PartitionSpec, mesh_shape) -> tuple[int, ...]:
    """The per-device block of an array of `shape` laid out as `spec` over a mesh of these sizes."""
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, entries):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        out.append(-(-dim // math.prod(mesh_shape[a] for a in axes)))
    return tuple(out)


def param_shard_shapes(state: nnx.State, mesh, rules: Rules) -> dict[tuple, tuple[tuple, tuple, np.dtype]]:
    """path -> (global shape, per-device shape, dtype) of every variable, from its logical axes.
    `mesh` may be an AbstractMesh: nothing is placed."""
    out = {}
    for path, var in nnx.to_flat_state(state):
        if not isinstance(var, nnx.Variable):
            continue
        spec = logical_to_spec(param_logical_axes(var), rules, mesh, var.shape)
        out[tuple(path)] = (tuple(var.shape), shard_shape(var.shape, spec, mesh.shape),
                            np.dtype(var.dtype))
    return out


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """NamedSharding for every variable of an NNX state, from its logical axes."""

    def one(var):
        if not isinstance(var, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        spec = logical_to_spec(param_logical_axes(var), rules, mesh, var.shape)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules):
    """Activate a mesh + rules for `constrain` (and as JAX's ambient mesh)."""
    _ACTIVE.append((mesh, rules))
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _ACTIVE.pop()


def active_mesh() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) of the innermost `use_mesh`, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op without an active mesh."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, logical_to_spec(axes, rules, mesh, x.shape)))


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def batch_shards(mesh: Mesh, rules: Rules) -> int:
    """How many ways the rules split a batch's leading axis over the mesh."""
    axes = batch_sharding(mesh, rules, 1).spec[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def shard_batch(batch: dict, mesh: Mesh, rules: Rules, rows: int | None = None) -> dict:
    """Put every array of a batch on the mesh, its leading (batch) axis split by the rules.
    `batch` holds this process's rows of a global batch of `rows` (default: all of them; in a
    multi-host trainer each process passes only the rows its devices hold)."""
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        shape = (rows if rows is not None else v.shape[0],) + v.shape[1:]
        out[k] = jax.make_array_from_process_local_data(batch_sharding(mesh, rules, v.ndim), v,
                                                        shape)
    return out
