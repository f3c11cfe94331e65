"""Streaming safetensors: read one tensor at a time, write shards tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}`, offsets relative to the end of the header) and the raw
bytes. Reading seeks to one tensor and copies exactly its bytes; writing lays out every shard's
header first (shapes and dtypes are known before any value is computed) and then appends each
tensor as it is produced. Peak memory is therefore one tensor (plus whatever the producer holds),
not a shard and not the checkpoint: the 2 GiB shards of `safetensors.numpy.save_file` would need
the whole shard in memory.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from posttrain.errors import UserError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024**3


def read_header(file: Path) -> tuple[dict, int]:
    """(header without `__metadata__`, byte offset where the data starts)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def check_complete(file: Path, header: dict, start: int) -> None:
    """A file cut short (an interrupted download or copy) names the first tensor whose bytes
    run past its end, instead of failing later inside a read."""
    size = file.stat().st_size
    for name, info in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0, 0])[1]):
        end = start + int(info.get("data_offsets", [0, 0])[1])
        if end > size:
            raise UserError(f"{file}: truncated: tensor {name} ends at byte {end} but the file "
                            f"has {size} bytes (re-download or re-copy it)")


class SafetensorsReader:
    """Every tensor of a (possibly sharded) safetensors checkpoint, read one at a time."""

    def __init__(self, path: Path):
        path = Path(path)
        index = path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            weight_map = None
        else:
            raise UserError(f"{path}: no model.safetensors or {INDEX}")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for shard in files:
            if not (path / shard).is_file():
                raise UserError(f"{path / shard}: shard listed in {INDEX} is missing")
        self.path = path
        self.entries: dict[str, tuple[str, dict, int]] = {}
        for shard in files:
            header, start = read_header(path / shard)
            check_complete(path / shard, header, start)
            for name, info in header.items():
                if weight_map is None or weight_map.get(name) == shard:
                    self.entries[name] = (shard, info, start)
        if weight_map:
            lost = [n for n in weight_map if n not in self.entries]
            if lost:
                raise UserError(f"{path / weight_map[lost[0]]}: tensor {lost[0]} is listed in "
                                f"{INDEX} but not stored in that file")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def file(self, name: str) -> Path:
        return self.path / self.entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._info(name)["dtype"]
        if code not in DTYPES:
            raise UserError(f"{self.file(name)}: tensor {name} has unsupported dtype {code}")
        return DTYPES[code]

    def get(self, name: str, transpose: bool = False) -> np.ndarray:
        """The tensor (copied out of the file); with `transpose`, its transpose built directly
        (read in slabs of rows, so the peak is the result plus one slab)."""
        shard, info, start = self.entries.get(name, (None, None, None))
        if shard is None:
            raise UserError(f"{self.path}: tensor {name} is missing")
        dtype, shape = self.dtype(name), tuple(info["shape"])
        begin, end = info["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise UserError(f"{self.file(name)}: tensor {name}: {end - begin} bytes stored for "
                            f"shape {shape} {dtype}")
        file, offset = self.path / shard, start + begin
        if not transpose or len(shape) < 2:
            arr = np.fromfile(file, dtype=dtype, count=count, offset=offset).reshape(shape)
            return arr.T if transpose else arr
        rows, inner = shape[0], int(np.prod(shape[1:]))
        out = np.empty(shape[::-1], dtype)
        step = max(1, SLAB_BYTES // max(inner * dtype.itemsize, 1))
        for i in range(0, rows, step):
            n = min(step, rows - i)
            slab = np.fromfile(file, dtype=dtype, count=n * inner,
                               offset=offset + i * inner * dtype.itemsize).reshape((n,) + shape[1:])
            out[..., i:i + n] = slab.T
        return out

    def _info(self, name: str) -> dict:
        if name not in self.entries:
            raise UserError(f"{self.path}: tensor {name} is missing")
        return self.entries[name][1]


SLAB_BYTES = 32 * 1024**2


def write_slabs(f, arr: np.ndarray, slab_bytes: int = SLAB_BYTES) -> None:
    """Write `arr` in C order; a non-contiguous array (a transposed view) is copied one slab of
    leading-axis rows at a time, so the extra memory is one slab, not the tensor."""
    if arr.flags.c_contiguous or arr.ndim == 0:
        np.ascontiguousarray(arr).tofile(f)
        return
    row = max(1, arr.nbytes // max(arr.shape[0], 1))
    step = max(1, slab_bytes // row)
    for i in range(0, arr.shape[0], step):
        np.ascontiguousarray(arr[i:i + step]).tofile(f)


def plan_shards(specs: list[tuple[str, tuple[int, ...], np.dtype]],
                max_bytes: int = SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...], np.dtype]]]:
    shards, current, size = [], [], 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, tuple(shape), np.dtype(dtype)))
        size += nbytes
    shards.append(current)
    return shards


def write_sharded(out: Path, specs: list[tuple[str, tuple[int, ...], np.dtype]],
                  tensors: Iterable[tuple[str, np.ndarray]], *, prefix: str = "model",
                  max_bytes: int = SHARD_BYTES, metadata: dict | None = None) -> list[str]:
    """Write `tensors` (yielded in `specs` order, one at a time) as `prefix.safetensors`, or as
    `prefix-0000i-of-0000n.safetensors` shards plus an index when they exceed `max_bytes`."""
    shards = plan_shards(specs, max_bytes)
    it: Iterator[tuple[str, np.ndarray]] = iter(tensors)
    files, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        fname = f"{prefix}.safetensors" if len(shards) == 1 else \
            f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt", **(metadata or {})}}, 0
        for name, shape, dtype in shard:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            header[name] = {"dtype": CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned, as safetensors does
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, shape, dtype in shard:
                got_name, arr = next(it)
                arr = np.asarray(arr)
                if got_name != name or arr.shape != shape or arr.dtype != dtype:
                    raise AssertionError(f"writer expected {name} {shape} {dtype}, "
                                         f"got {got_name} {arr.shape} {arr.dtype}")
                write_slabs(f, arr)
                weight_map[name] = fname
                total += arr.nbytes
                del arr
        files.append(fname)
    if len(shards) > 1:
        (out / f"{prefix}.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files
