"""`posttrain convert`: HF safetensors <-> Orbax, and LoRA adapters -> PEFT, streaming.

Every direction moves one tensor at a time: safetensors are read by seeking to one tensor
(`safetensors_io`), Orbax arrays are written through a lazy type handler that materialises each
array only when Orbax reaches it and read back one array (or one layer of a stacked array) at a
time through TensorStore. Peak memory is about two copies of the largest tensor (the tensor and
its transpose) plus a fixed overhead, so a checkpoint larger than RAM converts.

Output is staged in a hidden sibling directory and renamed into place only when it is complete
(and verified, with `--verify`): a failed conversion leaves nothing behind, and an existing
output directory is never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

from posttrain.models.hf import build_param, hf_shape, hf_tensor_names, our_path, our_tensors
from posttrain.models.loading import (
    hf_model_config,
    open_hf_checkpoint,
    read_hf_config,
    resolve_model_path,
    tokenizer_next_to,
)
from posttrain.models.safetensors_io import write_sharded
from posttrain.errors import UserError

ASSETS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
          "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "generation_config.json")
# --verify: both sides in fp32 on the same weights. Differences come only from reduction order
# (XLA vs ATen), ~1e-6 on logits of magnitude ~1 in tests/models/test_parity.py; they grow with
# the logit scale, hence relative to max(1, max |logit|).
VERIFY_TOL = 1e-4
VERIFY_FAILED = 3  # exit status when the converted model does not reproduce the source logits


class VerifyError(UserError):
    exit_code = VERIFY_FAILED


# ---- output staging ----------------------------------------------------------------------
@contextlib.contextmanager
def staged_dir(dst: str | Path):
    """Yield a hidden temporary directory next to `dst`; rename it to `dst` on success only."""
    dst = Path(dst).absolute()
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"{dst}: already exists; choose a new output directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dst.exists():
        dst.rmdir()
    tmp.rename(dst)


def copy_assets(src: Path | None, out: Path) -> None:
    """Tokenizer files and generation config, kept with the weights in both directions; a
    generation config is derived from the tokenizer when the source has none."""
    out.mkdir(parents=True, exist_ok=True)
    if src is None:
        return
    for name in ASSETS:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if not (out / "generation_config.json").exists() and (out / "tokenizer.json").exists():
        from transformers import AutoTokenizer, GenerationConfig

        tok = AutoTokenizer.from_pretrained(out)
        GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         bos_token_id=None).save_pretrained(out)


# ---- Orbax: lazy writes, per-array reads ---------------------------------------------------
def release_free_memory() -> None:
    """Hand freed heap back to the OS after each tensor (glibc keeps it per thread arena
    otherwise, and the next tensor's buffers land elsewhere): peak RSS then tracks live data."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


CHUNK_BYTES = 32 * 1024**2  # storage chunk of unsharded arrays (with --mesh: the shard)


class LazyArray:
    """A to-be-written array: shape and dtype now, values from `load()` when Orbax writes it."""

    def __init__(self, shape, dtype, load, chunk_shape=None):
        self.shape, self.dtype, self.load = tuple(shape), np.dtype(dtype), load
        self.chunk_shape = tuple(chunk_shape) if chunk_shape else None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def _register_lazy_handler() -> None:
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    from orbax.checkpoint._src.serialization import type_handlers

    class LazyHandler(type_handlers.NumpyHandler):
        """Writes arrays one after another, each loaded just before and freed just after; the
        stored format is the NumpyHandler's, so ordinary restores read it."""

        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)

        async def serialize(self, values, infos, args=None):
            # bounded chunks: TensorStore encodes chunk by chunk, so its buffers stay small
            args = [ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)] * len(values)

            async def write_all():
                for value, info, arg in zip(values, infos, args):
                    arr = value.load()
                    await info.await_path_creation()
                    spec = ts_utils.build_array_write_spec(
                        info=info, arg=arg, global_shape=arr.shape,
                        local_shape=value.chunk_shape or arr.shape, dtype=arr.dtype,
                        use_ocdbt=info.is_ocdbt_checkpoint, process_index=0)
                    await self._open_and_write(arr, spec.json, info.ts_context)
                    del arr
                    release_free_memory()

            return [ocp.future.CommitFutureAwaitingContractedSignals(write_all(), name="lazy")]

    ocp.type_handlers.register_type_handler(LazyArray, LazyHandler(), override=True)


def save_orbax(out: Path, params: dict[str, LazyArray], meta: dict, step: int = 0) -> None:
    """`out/STEP/{params,meta}`: the layout of our training checkpoints, without optimizer state."""
    import orbax.checkpoint as ocp

    _register_lazy_handler()
    manager = ocp.CheckpointManager(out, item_names=("params", "meta"),
                                    options=ocp.CheckpointManagerOptions(
                                        enable_async_checkpointing=False))
    manager.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(
        params, ocdbt_target_data_file_size=CHUNK_BYTES),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
    manager.close()


class OrbaxParams:
    """Read single arrays (or one index of a stacked array) of a saved `params` item."""

    def __init__(self, params_dir: Path):
        import orbax.checkpoint as ocp
        from etils import epath

        if not params_dir.is_dir():
            raise UserError(f"{params_dir}: checkpoint has no params")
        meta = ocp.PyTreeCheckpointHandler().metadata(epath.Path(params_dir))
        self.dir, self.tree = params_dir, dict(meta.tree)
        self.driver = "zarr3" if meta.use_zarr3 else "zarr"
        self.ocdbt = (params_dir / "manifest.ocdbt").exists()

    def __contains__(self, key: str) -> bool:
        return key in self.tree

    def dtype(self, key: str) -> np.dtype:
        return np.dtype(self.tree[key].dtype)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.tree[key].shape)

    def read(self, key: str, index: tuple[int, ...] | None = None) -> np.ndarray:
        import tensorstore as ts

        name = self.tree[key].name
        kv = ({"driver": "ocdbt", "base": f"file://{self.dir}/", "path": name} if self.ocdbt
              else {"driver": "file", "path": f"{self.dir}/{name}/"})
        arr = ts.open({"driver": self.driver, "kvstore": kv}, open=True).result()
        return np.asarray((arr if index is None else arr[index]).read().result())


def _key(path: tuple) -> str:
    return "/".join(map(str, path)) + "/value"


def _open_checkpoint(src):
    from posttrain.train.checkpoint import find_checkpoint, read_meta

    ckpt_dir, step = find_checkpoint(src)
    meta = read_meta(ckpt_dir, step)
    return ckpt_dir, step, meta, OrbaxParams(ckpt_dir / str(step) / "params")


# ---- sharded layout ------------------------------------------------------------------------
def parse_mesh(text: str) -> dict[str, int]:
    from posttrain.config import MESH_AXES

    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, text.split(",")):
        axis, _, n = part.partition("=")
        if axis not in sizes or not n.isdigit() or int(n) < 1:
            raise UserError(f"--mesh: {part!r} is not AXIS=N with AXIS one of {', '.join(MESH_AXES)}")
        sizes[axis] = int(n)
    return sizes


def shard_chunks(cfg, mesh_sizes: dict[str, int]) -> dict[tuple, tuple[int, ...]]:
    """The per-device shard shape of every parameter on this mesh under the default rules:
    written as the storage chunk, each host later reads exactly its own shards."""
    from flax import nnx
    from jax.sharding import AbstractMesh

    from posttrain.models.loading import abstract_model
    from posttrain.config import DEFAULT_RULES
    from posttrain.sharding import param_shard_shapes

    mesh = AbstractMesh(tuple(mesh_sizes.values()), tuple(mesh_sizes))
    shapes = param_shard_shapes(nnx.state(abstract_model(cfg), nnx.Param), mesh, DEFAULT_RULES)
    return {path: local for path, (_, local, _) in shapes.items()}


# ---- the three conversions -------------------------------------------------------------------
def hf_to_orbax(src, dst, *, dtype: str | None = None, scan_layers: bool = False,
                mesh: str | None = None, verify: bool = False) -> Path:
    src = resolve_model_path(src)
    cfg = hf_model_config(src, scan_layers=scan_layers)
    reader = open_hf_checkpoint(src, cfg)
    first = hf_tensor_names(cfg)[0]
    out_dtype = np.dtype(dtype) if dtype else reader.dtype(first)
    cfg = cfg.model_copy(update={"param_dtype": "bfloat16" if out_dtype.name == "bfloat16"
                                 else "float32"})
    chunks = shard_chunks(cfg, parse_mesh(mesh)) if mesh else {}
    cast = np.dtype(dtype) if dtype else None
    params = {}
    for path, (names, transpose, stack) in our_tensors(cfg).items():
        shape = hf_shape(cfg, names[0])
        shape = stack + (shape[::-1] if transpose else shape)
        # the reader builds transposes directly (no second full-size copy)
        params[_key(path)] = LazyArray(shape, cast or reader.dtype(names[0]),
                                       partial(build_param, names, False, stack,
                                               partial(reader.get, transpose=transpose), cast),
                                       chunks.get(path))
    hf_cfg = read_hf_config(src)
    meta = {"model_config": cfg.model_dump(mode="json"), "step": 0, "lora": {},
            "hf_config": hf_cfg, "converted_from": str(src)}
    with staged_dir(dst) as tmp:
        save_orbax(tmp, params, meta)
        copy_assets(tokenizer_next_to(src) or src, tmp / "tokenizer")
        if verify:
            from posttrain.models.loading import load_model_from_checkpoint

            compare_logits(load_model_from_checkpoint(tmp, param_dtype="float32",
                                                      compute_dtype="float32"), src)
    return Path(dst)


def orbax_to_hf(src, dst, *, dtype: str | None = None, verify: bool = False) -> Path:
    """Any checkpoint of ours -> an HF directory: LoRA merged, int8 dequantized, layers unstacked."""
    from posttrain.models.export import write_hf_config
    from posttrain.models.config import ModelConfig
    from posttrain.train.checkpoint import canonical_param

    ckpt_dir, _, meta, store = _open_checkpoint(src)
    cfg = ModelConfig.model_validate(meta["model_config"])
    lora = meta.get("lora") or {}
    scale = lora["alpha"] / lora["rank"] if lora.get("rank") else None
    keys = set(store.tree)
    cast = np.dtype(dtype) if dtype else None

    def stored_dtype(path) -> np.dtype:
        key = _key(path)
        return store.dtype(key) if key in store else np.dtype(np.float32)  # int8: dequantized

    def tensors():
        for name in hf_tensor_names(cfg):
            path, index, transpose = our_path(cfg, name)
            read = partial(store.read, index=index) if index else store.read
            arr = canonical_param(read, keys, "/".join(map(str, path)), scale)
            arr = arr.T if transpose else arr
            yield name, arr if cast is None else arr.astype(cast)
            del arr
            release_free_memory()

    specs = [(n, hf_shape(cfg, n), cast or stored_dtype(our_path(cfg, n)[0]))
             for n in hf_tensor_names(cfg)]
    extra = {k: v for k, v in (meta.get("hf_config") or {}).items()
             if k not in ("dtype", "torch_dtype")}
    with staged_dir(dst) as tmp:
        write_sharded(tmp, specs, tensors())
        write_hf_config(tmp, cfg, str(cast or specs[0][2]), extra)
        copy_assets(_assets_dir(ckpt_dir), tmp)
        if verify:
            from posttrain.models.loading import load_model_from_checkpoint

            compare_logits(load_model_from_checkpoint(src, param_dtype="float32",
                                                      compute_dtype="float32"), tmp)
    return Path(dst)


def _assets_dir(ckpt_dir: Path) -> Path | None:
    for cand in (ckpt_dir / "tokenizer", ckpt_dir.parent / "tokenizer"):
        if cand.is_dir():
            return cand
    return None


def lora_to_hf(src, dst, *, merge: bool = False, dtype: str | None = None,
               verify: bool = False, base: str | None = None) -> Path:
    """A LoRA run's adapters as a PEFT adapter directory, or merged into full HF weights."""
    ckpt_dir, step, meta, store = _open_checkpoint(src)
    lora = meta.get("lora") or {}
    if not lora.get("rank"):
        raise UserError(f"{ckpt_dir / str(step)}: not a LoRA checkpoint (no adapters saved)")
    if merge:
        return orbax_to_hf(src, dst, dtype=dtype, verify=verify)
    suffix = "kernel_lora_a/value"
    stems = sorted((k[: -len(suffix)] for k in store.tree if k.endswith(suffix)),
                   key=lambda s: [int(p) if p.isdigit() else p for p in s.split("/")])
    cast = np.dtype(dtype) if dtype else None
    specs, sources = [], []
    for stem in stems:
        module = stem.strip("/").replace("/", ".")
        a_key, b_key = stem + "kernel_lora_a/value", stem + "kernel_lora_b/value"
        (n_in, r), (_, n_out) = store.shape(a_key), store.shape(b_key)
        # qwix: W' = W + s A B with A [in, r], B [r, out] on a [in, out] kernel; PEFT stores
        # torch layouts, lora_A [r, in] and lora_B [out, r], and adds s B A to weight [out, in].
        for which, key, shape in (("A", a_key, (r, n_in)), ("B", b_key, (n_out, r))):
            name = f"base_model.model.{module}.lora_{which}.weight"
            specs.append((name, shape, cast or store.dtype(key)))
            sources.append((name, key))

    def tensors():
        for name, key in sources:
            arr = store.read(key).T
            yield name, arr if cast is None else arr.astype(cast)

    modules = [s.strip("/").split("/") for s in stems]
    names = sorted({m[-1] for m in modules})
    layers = {int(m[2]) for m in modules if m[:2] == ["model", "layers"]}
    from posttrain.models.config import ModelConfig

    cfg = ModelConfig.model_validate(meta["model_config"])
    every_layer = len(modules) == len(names) * cfg.num_hidden_layers and \
        layers == set(range(cfg.num_hidden_layers))
    targets = names if every_layer else \
        "^(" + "|".join(".".join(m).replace(".", r"\.") for m in modules) + ")$"
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"],
        "lora_alpha": lora["alpha"], "lora_dropout": lora.get("dropout", 0.0),
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "modules_to_save": None, "inference_mode": True,
        "base_model_name_or_path": base or _run_model_path(ckpt_dir),
    }
    if lora.get("int8_base"):
        print("posttrain convert: note: this run trained its adapters on an int8-quantized base; "
              "PEFT adds them to whichever base you load (use --merge for the exact weights)",
              file=sys.stderr)
    with staged_dir(dst) as tmp:
        write_sharded(tmp, specs, tensors(), prefix="adapter_model", max_bytes=1 << 62)
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
        copy_assets(_assets_dir(ckpt_dir), tmp)
        if verify:
            base_dir = base or adapter_config["base_model_name_or_path"]
            if not base_dir:
                raise UserError("--verify: the base model is unknown; pass --base HF_DIR")
            from posttrain.models.loading import load_model_from_checkpoint

            compare_logits(load_model_from_checkpoint(src, param_dtype="float32",
                                                      compute_dtype="float32"),
                           resolve_model_path(base_dir), adapter=tmp)
    return Path(dst)


def _run_model_path(ckpt_dir: Path) -> str | None:
    import yaml

    for cand in (ckpt_dir.parent / "config.yaml", ckpt_dir / "config.yaml"):
        if cand.is_file():
            return ((yaml.safe_load(cand.read_text()) or {}).get("model") or {}).get("path")
    return None


# ---- verification ---------------------------------------------------------------------------
def compare_logits(ours, hf_dir: Path, *, adapter: Path | None = None, batch: int = 2,
                   length: int = 32) -> float:
    """Logits of our model vs transformers (optionally with a PEFT adapter) on random tokens,
    both in fp32. Raises VerifyError beyond VERIFY_TOL x max(1, max |logit|)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise UserError("--verify needs torch (pip install 'posttrain[test]')") from None
    import jax.numpy as jnp

    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        ref = PeftModel.from_pretrained(ref, adapter).eval()
    length = min(length, ours.cfg.max_position_embeddings)
    ids = np.random.default_rng(0).integers(0, ours.cfg.vocab_size, (batch, length))
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids)).logits.float().numpy()
    got = np.asarray(ours(jnp.asarray(ids, jnp.int32)), np.float32)
    diff = float(np.abs(got - want).max())
    tol = VERIFY_TOL * max(1.0, float(np.abs(want).max()))
    print(f"verify: max |logit difference| {diff:.3g} over {batch}x{length} tokens "
          f"(tolerance {tol:.3g}): {'ok' if diff <= tol else 'FAILED'}", file=sys.stderr)
    if not diff <= tol:
        raise VerifyError(f"--verify: converted model's logits differ from the source by {diff:.3g} "
                          f"(tolerance {tol:.3g}); nothing was written")
    return diff


# ---- command line ---------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints: HF <-> Orbax, LoRA -> PEFT")
    kinds = p.add_subparsers(dest="direction", required=True)
    dtypes = ("float32", "bfloat16")

    a = kinds.add_parser("hf-to-orbax", help="an HF safetensors directory (or hub id) -> Orbax")
    a.add_argument("src")
    a.add_argument("dst")
    a.add_argument("--dtype", choices=dtypes)
    a.add_argument("--scan-layers", action="store_true",
                   help="store layers stacked on a leading axis (the layout of scanned training)")
    a.add_argument("--mesh", metavar="AXIS=N,...",
                   help="chunk the arrays as the shards of this mesh (e.g. fsdp=8,tensor=2)")
    a.add_argument("--verify", action="store_true")
    a.set_defaults(fn=lambda args: hf_to_orbax(args.src, args.dst, dtype=args.dtype,
                                               scan_layers=args.scan_layers, mesh=args.mesh,
                                               verify=args.verify) and 0)

    b = kinds.add_parser("orbax-to-hf", help="a checkpoint of ours (run dir or step) -> HF")
    b.add_argument("src")
    b.add_argument("dst")
    b.add_argument("--dtype", choices=dtypes)
    b.add_argument("--verify", action="store_true")
    b.set_defaults(fn=lambda args: orbax_to_hf(args.src, args.dst, dtype=args.dtype,
                                               verify=args.verify) and 0)

    c = kinds.add_parser("lora-to-hf", help="a LoRA run's adapters -> a PEFT adapter directory")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--merge", action="store_true", help="write full HF weights with W + s*A*B")
    c.add_argument("--dtype", choices=dtypes)
    c.add_argument("--base", help="the HF base model (for --verify; default: the run's model.path)")
    c.add_argument("--verify", action="store_true")
    c.set_defaults(fn=lambda args: lora_to_hf(args.src, args.dst, merge=args.merge,
                                              dtype=args.dtype, verify=args.verify,
                                              base=args.base) and 0)
