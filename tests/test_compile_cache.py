"""The persistent compilation cache every posttrain command turns on (posttrain/compile_cache.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.compile_cache import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_cache_directory_is_chosen_in_order_and_can_be_turned_off(tmp_path):
    assert cache_dir({"POSTTRAIN_COMPILE_CACHE": str(tmp_path)}) == tmp_path
    for off in ("off", "0", "OFF", ""):
        assert cache_dir({"POSTTRAIN_COMPILE_CACHE": off, "JAX_COMPILATION_CACHE_DIR": "/x"}) is None
    assert cache_dir({"JAX_COMPILATION_CACHE_DIR": "/x/jax"}) == Path("/x/jax")
    assert cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/posttrain/jax")


def _compile_in_a_fresh_process(environ: dict) -> subprocess.CompletedProcess:
    code = ("from posttrain import compile_cache; compile_cache.enable(); import jax, os; "
            "jax.jit(lambda x: x * 2 + 1)(1.0).block_until_ready(); "
            "print(os.environ.get('JAX_COMPILATION_CACHE_DIR'))")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("POSTTRAIN_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **environ},
                          timeout=120, check=True)


def test_compiled_programs_are_written_there_and_children_inherit_it(tmp_path):
    cache = tmp_path / "xla"
    r = _compile_in_a_fresh_process({"POSTTRAIN_COMPILE_CACHE": str(cache)})
    assert r.stdout.strip() == str(cache)  # in the environment: Ray workers and hosts share it
    assert any(cache.iterdir())
    off = _compile_in_a_fresh_process({"POSTTRAIN_COMPILE_CACHE": "off",
                                       "XDG_CACHE_HOME": str(tmp_path / "home")})
    assert off.stdout.strip() == "None" and not (tmp_path / "home").exists()


def test_dropping_compiled_programs_unmaps_their_memory():
    """What tests/conftest.py relies on to keep the session under vm.max_map_count: compiled
    programs map memory regions, and `jax.clear_caches` returns them."""
    import gc

    import jax
    import jax.numpy as jnp

    from tests.conftest import _map_count

    before = _map_count()
    fns = [jax.jit(lambda x, i=i: jnp.sin(x) * i + jnp.cos(x * i)) for i in range(100)]
    for f in fns:
        f(jnp.ones((8,))).block_until_ready()
    grown = _map_count()
    assert grown - before >= 100  # at least one region per program
    del fns
    jax.clear_caches()
    gc.collect()
    assert _map_count() - before < (grown - before) / 2


def test_the_compile_tally_counts_each_new_program_once():
    """`CompileTally` (what every metrics row reports as compile/count, compile/seconds): a
    function jitted at a new shape is one compile, a call at a shape seen before none."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from posttrain.compile_cache import CompileTally, compile_metrics

    CompileTally.install()
    CompileTally.install()  # idempotent: one listener, not two
    f = jax.jit(lambda x: jnp.tanh(x) * 3 - 1)
    a, b, c = (jax.device_put(np.full(n, 0.5, np.float32)) for n in (7, 7, 9))
    before = CompileTally.snapshot()
    f(a).block_until_ready()
    m, now = compile_metrics(before)
    assert m["compile/count"] == 1 and m["compile/seconds"] > 0
    f(b).block_until_ready()  # the same shape: no compile
    f(c).block_until_ready()  # a new one: a compile
    m, _ = compile_metrics(now)
    assert m["compile/count"] == 1


def test_compile_effort_is_low_only_for_a_small_model_on_a_tpu(monkeypatch):
    """auto: -1 for the quickstart's 3M model on a TPU (its compiles, not its steps, are the
    run), XLA's default for a real model or off a TPU; a number is taken as given and applies
    to this process's later compiles and its children's."""
    import jax

    from posttrain.compile_cache import resolve_effort, set_effort
    from posttrain.config import TrainSection
    from posttrain.models.config import ModelConfig

    tiny, real = ModelConfig(), ModelConfig.preset("qwen3_0_6b")
    assert tiny.matmul_params() < 5e6 < 5e8 < real.matmul_params()
    assert resolve_effort("auto", "tpu", tiny.matmul_params()) == -1.0
    assert resolve_effort("auto", "tpu", real.matmul_params()) == 0.0
    assert resolve_effort("auto", "cpu", tiny.matmul_params()) == 0.0
    assert resolve_effort(0.5, "cpu", tiny.matmul_params()) == 0.5
    with pytest.raises(ValueError, match="compile_effort"):
        TrainSection(compile_effort=2)
    monkeypatch.setenv("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "0")
    prev = jax.config.jax_exec_time_optimization_effort
    try:
        assert set_effort(-0.5, tiny) == -0.5
        assert jax.config.jax_exec_time_optimization_effort == -0.5
        assert os.environ["JAX_EXEC_TIME_OPTIMIZATION_EFFORT"] == "-0.5"
    finally:
        jax.config.update("jax_exec_time_optimization_effort", prev)
