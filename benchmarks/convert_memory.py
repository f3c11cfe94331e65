"""Peak RSS of `posttrain convert` on a ~1.3 GB checkpoint, both directions.

Builds a random Qwen3-architecture HF checkpoint (vocab 32000, hidden 2048, MLP 5632, 4 layers,
untied head: 320M fp32 parameters, largest tensor 262 MB) in shards, streamed to disk so this
process never holds it; then runs each conversion in a fresh process and reads its peak RSS
(VmHWM). The imports' share is the peak of the same command on a tiny model. The bound the
converters promise: peak < 2 x largest tensor + FIXED_OVERHEAD (imports ~216 MB plus TensorStore's
encode/commit buffers).

    python -m benchmarks.convert_memory [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from posttrain.models import ModelConfig

BIG = ModelConfig(arch="qwen3", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                  num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, tie_word_embeddings=False, max_position_embeddings=512)
TINY = BIG.model_copy(update=dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32))

# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child forked from a big
# process (a test runner) would report its parent's size.
FIXED_OVERHEAD = 400 * 1024**2  # "a few hundred MB": imports 216 MB + TensorStore/allocator

MEASURE = """
import re, sys
from posttrain.cli import main
rc = main(sys.argv[1:])
hwm = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
print("@@RSS@@", int(hwm) * 1024, rc)
"""


def write_random_hf(cfg: ModelConfig, out: Path, shard_bytes: int = 400 * 1024**2) -> int:
    """A random HF checkpoint written tensor by tensor; returns the largest tensor's bytes."""
    from posttrain.models.export import hf_specs, write_hf_config
    from posttrain.models.safetensors_io import write_sharded

    out.mkdir(parents=True, exist_ok=True)
    specs = hf_specs(cfg, lambda name: np.float32)
    rng = np.random.default_rng(0)

    def tensors():
        for name, shape, dtype in specs:
            yield name, rng.standard_normal(shape, dtype=np.float32) * 0.02

    write_sharded(out, specs, tensors(), max_bytes=shard_bytes)
    write_hf_config(out, cfg, "float32")
    return max(int(np.prod(s)) * 4 for _, s, _ in specs)


def peak_rss(args: list[str]) -> int:
    """Peak RSS in bytes of `posttrain ARGS` run in a fresh process (which must succeed)."""
    # A clean environment, as a user's shell has (one device; nothing a test process set).
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True,
                         check=False, env=env)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("@@RSS@@")]
    if out.returncode or not line or line[0].split()[2] != "0":
        raise RuntimeError(f"posttrain {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return int(line[0].split()[1])


def measure(workdir: Path) -> dict:
    largest = write_random_hf(BIG, workdir / "big_hf")
    write_random_hf(TINY, workdir / "tiny_hf")
    total = sum(f.stat().st_size for f in (workdir / "big_hf").glob("*.safetensors"))
    res = {"checkpoint_bytes": total, "largest_tensor_bytes": largest}
    for name, src in (("tiny", "tiny_hf"), ("big", "big_hf")):
        res[f"{name}_hf_to_orbax"] = peak_rss(["convert", "hf-to-orbax", str(workdir / src),
                                               str(workdir / f"{name}_orbax")])
        res[f"{name}_orbax_to_hf"] = peak_rss(["convert", "orbax-to-hf",
                                               str(workdir / f"{name}_orbax"),
                                               str(workdir / f"{name}_back")])
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        r = measure(Path(d))
    mb = 1024**2
    print(json.dumps(r))
    print(f"checkpoint {r['checkpoint_bytes'] / mb:,.0f} MB, largest tensor "
          f"{r['largest_tensor_bytes'] / mb:,.0f} MB")
    for direction in ("hf_to_orbax", "orbax_to_hf"):
        big, tiny = r[f"big_{direction}"], r[f"tiny_{direction}"]
        bound = 2 * r["largest_tensor_bytes"] + FIXED_OVERHEAD
        print(f"{direction}: peak RSS {big / mb:,.0f} MB = imports (tiny model) "
              f"{tiny / mb:,.0f} MB + {(big - tiny) / r['largest_tensor_bytes']:.2f} x largest "
              f"tensor; bound 2 x largest + {FIXED_OVERHEAD / mb:.0f} MB = {bound / mb:,.0f} MB -> "
              f"{'ok' if big < bound else 'EXCEEDED'}")


if __name__ == "__main__":
    main()
