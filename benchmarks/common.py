"""Shared benchmark helpers: the reference model of ENVIRONMENT.md and the matmul peak."""

from __future__ import annotations

import time

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


def matmul_peak_gflops(rows: int = 4096, reps: int = 5) -> float:
    """f32 GFLOP/s of the model's own matmul shapes (rows x 256 @ 256 x 768 and back)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (rows, 256))
    w1 = jax.random.normal(k2, (256, 768))
    w2 = jax.random.normal(k3, (768, 256))
    f = jax.jit(lambda x: ((x @ w1) @ w2).sum())
    return 2 * 2 * rows * 256 * 768 / _best_time(f, x, reps=reps) / 1e9


def matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies: every layer's projections (q, k, v, o, gate, up, down) and
    the LM head."""
    e, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    h, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return cfg.num_hidden_layers * (e * h * d * 2 + e * k * d * 2 + 3 * e * f) + v * e


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x (matmul params incl. the LM head) + attention scores/values (12 L T H D, full square)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    return 6 * matmul_params(cfg) + 12 * cfg.num_hidden_layers * seq_len * h * d


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


def op_times(run, reps: int, trace_dir) -> dict[str, tuple[float, int]]:
    """Trace `reps` calls of `run()` with the JAX profiler and sum the XLA:CPU thunks' durations
    per op: {op name: (ms per call, executions per call)}. On CPU, `ynn_fusion*` are YNNPACK dot
    fusions (the matmuls); the rest element-wise, copy and transpose fusions. Op time can exceed
    wall time: the thunk executor runs independent thunks on both cores at once."""
    import collections
    import gzip
    import json
    from pathlib import Path

    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    for _ in range(reps):
        jax.block_until_ready(run())
    jax.profiler.stop_trace()
    with gzip.open(max(Path(trace_dir).rglob("*.trace.json.gz"))) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    ms: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if (e.get("ph") == "X" and "dur" in e
                and not name.startswith(("ThunkExecutor", "$", "Slinky", "Pjit", "np.asarray"))):
            ms[name] += e["dur"] / reps / 1e3
            count[name] += 1
    return {name: (ms[name], count[name] // reps) for name in ms}


def op_kinds(ops: dict[str, tuple[float, int]]) -> dict[str, float]:
    """ms per call summed by op kind (`ynn_fusion.12` -> `ynn_fusion`), largest first."""
    import collections
    import re

    kinds: collections.Counter = collections.Counter()
    for name, (ms, _) in ops.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += ms
    return dict(kinds.most_common())


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


def run_tunix(root, mode: str, model_dir, steps: int) -> dict:
    """`benchmarks/peers/tunix_bench.py` under Tunix's interpreter: its JSON result (see there)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    r = subprocess.run([tunix_python(root), "benchmarks/peers/tunix_bench.py", mode, str(model_dir),
                        str(steps)], cwd=root, env=env, capture_output=True, text=True, check=False)
    if r.returncode or "@@" not in r.stdout:
        raise RuntimeError(f"Tunix {mode} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.split("@@")[-1])
