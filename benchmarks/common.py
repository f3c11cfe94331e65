"""Shared benchmark helpers: the reference model of ENVIRONMENT.md and the matmul peak."""

from __future__ import annotations

import time
from typing import NamedTuple

import jax

from posttrain.models import ModelConfig

# Qwen3 architecture, hidden 256, 4 layers, 4 heads of dim 64, 2 KV heads, MLP 768, tied, vocab ~470.
REFERENCE = ModelConfig(arch="qwen3", vocab_size=512, hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, tie_word_embeddings=True, max_position_embeddings=512)


def _best_time(f, *args, reps: int = 5) -> float:
    """Best wall time of `reps` calls of `f(*args)` after one warm-up (compile) call."""
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def steal_seconds(stat_text: str | None = None) -> float | None:
    """CPU seconds the hypervisor has taken from this VM since boot (the `steal` column of
    /proc/stat's first line), or None where the kernel does not report it. Its growth during a
    benchmark round says whether the round ran on a contended host: on the shared build
    machines the cross-process ratios move by +-10% with it."""
    import os

    if stat_text is None:
        try:
            with open("/proc/stat") as f:
                stat_text = f.readline()
        except OSError:
            return None
    fields = stat_text.split("\n", 1)[0].split()
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def with_steal(run):
    """(run(), the steal seconds that accrued meanwhile, or None)."""
    before = steal_seconds()
    out = run()
    after = steal_seconds()
    return out, None if before is None or after is None else round(after - before, 2)


def steal_report(stolen: dict) -> str:
    """The line a benchmark prints under its rounds: {contender: [steal seconds per run]}."""
    import json

    return ("CPU seconds the host took from this VM during each run (/proc/stat steal): "
            + json.dumps(stolen))


def matmul_peak_gflops(rows: int = 4096, reps: int = 5) -> float:
    """f32 GFLOP/s of the model's own matmul shapes (rows x 256 @ 256 x 768 and back)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (rows, 256))
    w1 = jax.random.normal(k2, (256, 768))
    w2 = jax.random.normal(k3, (768, 256))
    f = jax.jit(lambda x: ((x @ w1) @ w2).sum())
    return 2 * 2 * rows * 256 * 768 / _best_time(f, x, reps=reps) / 1e9



def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x (matmul params incl. the LM head) + attention scores/values (12 L T H D, full square)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    return 6 * cfg.matmul_params() + 12 * cfg.num_hidden_layers * seq_len * h * d


def matmul_floor_seconds(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> dict:
    """Seconds the GRPO step's weight matmuls alone take at the workload's own shapes, under jit:
    `rollout`: `new_tokens` decode steps of `batch` rows through every layer's projections and
    the LM head (a fori_loop, as the engine's while_loop); `update`: forward and backward (dX and
    dW) of the same matmuls over batch x (prompt_len + new_tokens) tokens. Attention, norms,
    RoPE, sampling and the loss are left out: a floor no implementation on these cores beats
    without faster matmuls."""
    import jax.numpy as jnp

    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    keys = iter(jax.random.split(jax.random.key(0), 4 * cfg.num_hidden_layers + 2))
    layers = [{"qkv": jax.random.normal(next(keys), (e, q + 2 * kv)) * 0.02,
               "o": jax.random.normal(next(keys), (q, e)) * 0.02,
               "gu": jax.random.normal(next(keys), (e, 2 * f)) * 0.02,
               "down": jax.random.normal(next(keys), (f, e)) * 0.02} for _ in range(cfg.num_hidden_layers)]
    head = jax.random.normal(next(keys), (e, v)) * 0.02

    def forward(x, layers, head):
        for w in layers:
            x = x + (x @ w["qkv"])[:, :q] @ w["o"]
            g = x @ w["gu"]
            x = x + (g[:, :f] * g[:, f:]) @ w["down"]
        return x @ head

    @jax.jit
    def decode(x, layers, head):
        return jax.lax.fori_loop(0, new_tokens, lambda i, x: x + forward(x, layers, head)[:, :e] * 1e-3, x)

    update = jax.jit(jax.grad(lambda ws, x: forward(x, *ws).sum()))
    tokens = batch * (prompt_len + new_tokens)
    rollout_s = _best_time(decode, jnp.ones((batch, e)), layers, head)
    update_s = _best_time(update, (layers, head), jnp.ones((tokens, e)))
    return {"rollout": rollout_s, "update": update_s, "step": rollout_s + update_s}


class OpTime(NamedTuple):
    """One op's time per call of the traced function: `wall` ms of wall clock charged to it
    (an interval where k ops run at once on k threads is split k ways, so the ops' walls add
    up to the time the device was busy), `op` ms of its own (self) time on its thread, and how
    many times it ran per call."""

    wall: float
    op: float
    count: int


def self_segments(events: list[dict]) -> list[dict]:
    """Each thread's time charged to its innermost running op. XLA:CPU's thunk executor runs a
    thunk's successors inline from its completion, and a `while` thunk spans its body, so
    events nest on a thread; an op's own time is its span less its children's (the usual
    self time of nested trace events). Returns non-overlapping pieces per thread, with the
    event's name, `ts`, `dur` and `tid`."""
    import collections

    by_tid = collections.defaultdict(list)
    for e in events:
        by_tid[e["tid"]].append(e)
    out: list[dict] = []
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        cur = 0.0

        def emit(until):
            if stack and until > cur:
                out.append({"name": stack[-1]["name"], "ts": cur, "dur": until - cur, "tid": tid})

        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                end = stack[-1]["ts"] + stack[-1]["dur"]
                emit(end)
                cur = max(cur, end)
                stack.pop()
            emit(e["ts"])
            cur = max(cur, e["ts"])
            stack.append(e)
        while stack:
            end = stack[-1]["ts"] + stack[-1]["dur"]
            emit(end)
            cur = max(cur, end)
            stack.pop()
    return out


def wall_shares(events: list[dict]) -> dict[str, float]:
    """Wall-clock time (trace units) charged to each op name: a sweep over the ops' start and
    end points that splits every interval evenly among the ops running during it."""
    import collections

    points = sorted([(e["ts"], 1, i) for i, e in enumerate(events)]
                    + [(e["ts"] + e["dur"], -1, i) for i, e in enumerate(events)],
                    key=lambda p: (p[0], p[1]))
    share: collections.Counter = collections.Counter()
    active: set[int] = set()
    last = None
    for t, kind, i in points:
        if active and last is not None and t > last:
            part = (t - last) / len(active)
            for j in active:
                share[events[j]["name"]] += part
        last = t
        if kind == 1:
            active.add(i)
        else:
            active.discard(i)
    return dict(share)


def op_times(run, reps: int, trace_dir=None) -> dict[str, OpTime]:
    """Trace `reps` calls of `run()` with the JAX profiler; per XLA:CPU thunk name, its `OpTime`
    per call. On CPU, `ynn_fusion*` are YNNPACK fusions (the dots, and some reductions); the
    rest element-wise, copy and transpose fusions. The thunk executor runs independent thunks
    on both cores at once, so the ops' `op` times can add up to more than the wall time; their
    `wall` times add up to the busy time. Nested events count once (`self_segments`). The trace
    goes to `trace_dir`, or to a temporary directory removed afterwards."""
    import collections
    import gzip
    import json
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="op_times_") as tmp:
        trace_dir = Path(trace_dir or tmp)
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
        for _ in range(reps):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        with gzip.open(max(trace_dir.rglob("*.trace.json.gz"))) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events
           if e.get("ph") == "X" and "dur" in e and "hlo_op" in e.get("args", {})
           and not e["name"].startswith(("end:", "ThunkExecutor"))]
    pieces = self_segments(ops)
    wall = wall_shares(pieces)
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter(e["name"] for e in ops)
    for e in pieces:
        ms[e["name"]] += e["dur"]
    return {name: OpTime(wall.get(name, 0.0) / reps / 1e3, ms[name] / reps / 1e3, count[name] // reps)
            for name in ms}


def donating_calls(step, state, batch):
    """A no-argument call of a jitted `step(state, batch) -> (state, metrics)` that donates its
    state: each call takes the state the last one returned, and returns the metrics."""
    carry = [state]

    def call():
        carry[0], metrics = step(carry[0], batch)
        return metrics

    return call


def op_kinds(ops: dict[str, OpTime]) -> dict[str, float]:
    """Wall ms per call summed by op kind (`ynn_fusion.12` -> `ynn_fusion`), largest first."""
    import collections
    import re

    kinds: collections.Counter = collections.Counter()
    for name, t in ops.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += t.wall
    return dict(kinds.most_common())


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{instruction name: (result shape, the JAX op it came from)} of a compiled module's text
    (`jitted.lower(...).compile().as_text()`), to say what a traced thunk computes."""
    import re

    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?op_name=\"([^\"]*)\"", hlo_text, re.M):
        out[m.group(1)] = (m.group(2), m.group(3))
    return out


WEIGHT_MATMULS, ATTENTION_DOTS, OTHER = ("weight matmuls (projections, LM head)",
                                         "attention dots (scores, values)", "everything else")


def op_groups(ops: dict[str, OpTime], hlo: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Wall ms per call in three groups, by what each op computes (`hlo_ops`): dots with a 2-D
    result are the weight matmuls (every projection is one [tokens, in] @ [in, out], see
    `layers.dense`, and so are their gradients), dots with a batched result attention's, the
    rest everything else."""
    groups = {WEIGHT_MATMULS: 0.0, ATTENTION_DOTS: 0.0, OTHER: 0.0}
    for name, t in ops.items():
        shape, op = hlo.get(name, ("", ""))
        if op.endswith("dot_general"):
            rank = shape[shape.find("[") + 1:shape.find("]")].count(",") + 1
            groups[WEIGHT_MATMULS if rank == 2 else ATTENTION_DOTS] += t.wall
        else:
            groups[OTHER] += t.wall
    return groups


TUNIX_VENV = "benchmarks/peers/setup_tunix.sh"


def tunix_python(root) -> str:
    """The interpreter of Tunix's own environment (`$TUNIX_PYTHON`, else `.venv-tunix`), or a
    SystemExit that says how to make it."""
    import os
    from pathlib import Path

    py = os.environ.get("TUNIX_PYTHON") or str(Path(root) / ".venv-tunix" / "bin" / "python")
    if not Path(py).exists():
        raise SystemExit(f"Tunix is not installed ({py} missing): run `bash {TUNIX_VENV}` (its own "
                         "venv: its pins do not install beside ours), or leave `tunix` out of --peers")
    return py


def peer_environ(keep_freed_memory: bool = False) -> dict:
    """The environment a peer runs in: ours without XLA flags or glibc malloc settings, so the
    peer runs as it ships; with `keep_freed_memory`, with the malloc settings `posttrain run`
    applies to itself (`posttrain.host_memory`), to measure what they would give it."""
    import os

    from posttrain.host_memory import SETTINGS

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MALLOC_")}
    if keep_freed_memory:
        env |= {name: str(value) for name, (_, value) in SETTINGS.items()}
    return env


def run_tunix(root, mode: str, model_dir, steps: int, keep_freed_memory: bool = False) -> dict:
    """`benchmarks/peers/tunix_bench.py` under Tunix's interpreter: its JSON result (see there)."""
    import json
    import subprocess

    env = peer_environ(keep_freed_memory) | {"JAX_PLATFORMS": "cpu"}
    r = subprocess.run([tunix_python(root), "benchmarks/peers/tunix_bench.py", mode, str(model_dir),
                        str(steps)], cwd=root, env=env, capture_output=True, text=True, check=False)
    if r.returncode or "@@" not in r.stdout:
        raise RuntimeError(f"Tunix {mode} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.split("@@")[-1])
