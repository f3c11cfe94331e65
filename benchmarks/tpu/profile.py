"""Where a jitted step's device time goes: the XLA ops of a few steps captured with
`jax.profiler.trace` and read back with `jax.profiler.ProfileData` (no TensorBoard needed),
summed per op and per XLA category (convolution = matmul fusions, loop / input fusions,
custom-call = Pallas kernels, copy, ...), per step.

    from benchmarks.tpu.profile import op_breakdown
    table = op_breakdown(lambda: step_once(), steps=3)

On a TPU the ops are read from the device plane's "XLA Ops" line; on CPU from the host's XLA
thunks (what the CPU dry run in the test suite sees), so the same code runs in both places.
"""

from __future__ import annotations

import collections
import glob
import tempfile
from collections.abc import Callable


def _stats(event) -> dict:
    out = {}
    for k, v in event.stats:
        out[str(k)] = v
    return out


def _leaves(events):
    """The events that contain no other: a `while` or `call` op spans its body's ops, which are
    events of their own on the same line, so counting both would count the body twice."""
    ev = sorted(events, key=lambda e: (e.start_ns, -e.duration_ns))
    for i, e in enumerate(ev):
        if i + 1 < len(ev) and ev[i + 1].start_ns < e.start_ns + e.duration_ns:
            continue  # the next op starts inside this one: this one is a parent
        yield e


def _op_events(data):
    """(name, duration ns, stats) of every leaf XLA op execution: the first device's "XLA Ops"
    line, or the host's XLA thunks where there is no device plane (CPU)."""
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:") and "TPU" in p.name
              or p.name.startswith("/device:GPU")]
    if device:
        plane = sorted(device, key=lambda p: p.name)[0]
        lines = [ln for ln in plane.lines if ln.name == "XLA Ops"]
    else:
        lines = [ln for p in planes if p.name.startswith("/host:CPU") for ln in p.lines]
    for line in lines:
        events = [e for e in line.events if device or "hlo_op" in _stats(e)]
        for e in _leaves(events):
            yield e.name, e.duration_ns, _stats(e)


def category(name: str, stats: dict) -> str:
    """XLA's category of an op where the profile names it; else its kind read from the name (a
    TPU op's name is its HLO text, `%convolution_add_fusion.3 = bf16[..] fusion(..), kind=..`):
    the name without `%` and the `.N` suffix, and a plain `fusion`'s kind (kOutput fusions are
    the matmuls on TPU, kLoop/kInput the elementwise and reduction ones)."""
    if stats.get("hlo_category"):
        return str(stats["hlo_category"])
    head, _, rest = name.partition(" = ")
    base = head.lstrip("%").split(".")[0]
    if base == "fusion" and "kind=" in rest:
        base += ":" + rest.split("kind=")[1].split(",")[0].split(")")[0]
    return base


def op_breakdown(run_step: Callable[[], object], steps: int = 3, top: int = 25) -> dict:
    """Profile `steps` calls of `run_step` (each must block until its step is done) and return
    per step: total op time, time per XLA category and the `top` ops by time, each with its
    category and the start of its HLO text (what the op computes)."""
    import jax
    from jax.profiler import ProfileData

    d = tempfile.mkdtemp(prefix="op_profile_")
    with jax.profiler.trace(d):
        for _ in range(steps):
            run_step()
    files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
    if not files:
        return {"error": "the profiler wrote no trace"}
    by_op: dict = collections.defaultdict(float)
    info: dict = {}
    by_cat: dict = collections.defaultdict(float)
    for name, ns, st in _op_events(ProfileData.from_file(files[0])):
        cat = category(name, st)
        op = name.split(" = ")[0]
        by_op[op] += ns
        by_cat[cat] += ns
        if op not in info:
            info[op] = {"category": cat,
                          "hlo": str(st.get("long_name", st.get("tf_op", name)))[:240]}
    total = sum(by_op.values())
    ms = lambda ns: round(ns / steps / 1e6, 3)  # noqa: E731 - per step, milliseconds
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {"op_ms_per_step": ms(total),
            "by_category_ms": {c: ms(v) for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": n, "ms": ms(v), "share": round(v / max(total, 1), 4), **info[n]}
                        for n, v in ranked]}
