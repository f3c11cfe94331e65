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


def _op_events(data):
    """(name, duration ns, stats) of every XLA op execution: the first device's "XLA Ops" line,
    or the host's XLA thunks where there is no device plane (CPU)."""
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:") and "TPU" in p.name
              or p.name.startswith("/device:GPU")]
    if device:
        plane = sorted(device, key=lambda p: p.name)[0]
        for line in plane.lines:
            if line.name == "XLA Ops":
                for e in line.events:
                    yield e.name, e.duration_ns, _stats(e)
        return
    for p in planes:
        if p.name.startswith("/host:CPU"):
            for line in p.lines:
                for e in line.events:
                    st = _stats(e)
                    if "hlo_op" in st:
                        yield e.name, e.duration_ns, st


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
        # XLA's category on a TPU; on CPU the op's kind, its name without the ".N" suffix
        cat = str(st.get("hlo_category") or name.split(".")[0])
        by_op[name] += ns
        by_cat[cat] += ns
        if name not in info:
            info[name] = {"category": cat,
                          "hlo": str(st.get("long_name", st.get("tf_op", "")))[:240]}
    total = sum(by_op.values())
    ms = lambda ns: round(ns / steps / 1e6, 3)  # noqa: E731 - per step, milliseconds
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    return {"op_ms_per_step": ms(total),
            "by_category_ms": {c: ms(v) for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_ops": [{"op": n, "ms": ms(v), "share": round(v / max(total, 1), 4), **info[n]}
                        for n, v in ranked]}
