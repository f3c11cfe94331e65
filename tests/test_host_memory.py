"""posttrain keeps freed host memory in the process (posttrain/host_memory.py): a jitted program
whose scratch buffer is larger than glibc's thread heaps is not faulted in again on every call."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="the settings are glibc's")

PROBE = """
import os, resource, sys
from posttrain import host_memory
role = sys.argv[1]
if role == "generator":  # a Ray rollout worker: started with a trainer's environment
    host_memory.thread_arenas()
    applied = False
else:
    applied = host_memory.keep_freed_memory(one_arena=role == "trainer")
import jax, jax.numpy as jnp

@jax.jit
def f(x, w):
    return (jnp.tanh(x @ w) @ w.T).sum()  # a [4096, 8192] f32 scratch: 128 MiB

x, w = jnp.ones((4096, 64)), jnp.full((64, 8192), 0.01)
f(x, w).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    f(x, w).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
print(applied, faults, os.environ.get("MALLOC_ARENA_MAX"), os.environ.get("MALLOC_TRIM_THRESHOLD_"))
"""


def _probe(role="trainer", **environ) -> tuple[bool, float, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "POSTTRAIN_HOST"))}
    r = subprocess.run([sys.executable, "-c", PROBE, role], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "JAX_PLATFORMS": "cpu", **environ}, timeout=120, check=True)
    applied, faults, arenas, trim = r.stdout.split()
    return applied == "True", float(faults), arenas, trim


def test_scratch_memory_is_reused_instead_of_faulted_in_every_call():
    page_faults_of_the_scratch = 128 * 2**20 / os.sysconf("SC_PAGESIZE")
    applied, faults, arenas, _ = _probe()
    assert applied and arenas == "1"  # in the environment: Ray workers and hosts start with it
    assert faults < 0.05 * page_faults_of_the_scratch
    # glibc's defaults map the scratch afresh each call: the check above can fail
    applied, faults, arenas, _ = _probe(POSTTRAIN_HOST_MALLOC="default")
    assert not applied and arenas == "None"
    assert faults > 0.5 * page_faults_of_the_scratch


def test_a_malloc_variable_the_user_set_is_left_alone():
    applied, _, arenas, trim = _probe(MALLOC_ARENA_MAX="4")
    assert applied and arenas == "4" and trim == str(2**31 - 1)


def test_a_process_that_only_generates_keeps_thread_arenas():
    """One arena makes decode's executor threads queue on its lock (posttrain/host_memory.py):
    `posttrain generate` sets the thresholds only, and a rollout worker started with a
    trainer's environment gives XLA's threads arenas of their own again, so the big block is
    an mmap again (the faults show which arena served it)."""
    from posttrain.cli import build_parser

    assert build_parser().parse_args(["run", "r.yaml"]).trains
    assert not getattr(build_parser().parse_args(["validate", "r.yaml"]), "trains", False)
    page_faults_of_the_scratch = 128 * 2**20 / os.sysconf("SC_PAGESIZE")
    applied, faults, arenas, trim = _probe("generate_cli")
    assert applied and arenas == "None" and trim == str(2**31 - 1)
    trainer_env = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**30),
                   "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1),
                   "POSTTRAIN_HOST_MALLOC_SET": "MALLOC_ARENA_MAX,MALLOC_MMAP_THRESHOLD_"}
    _, faults, arenas, _ = _probe("generator", **trainer_env)
    assert arenas == "1" and faults > 0.5 * page_faults_of_the_scratch
    # the user's own MALLOC_ARENA_MAX=1 is left alone
    _, faults, _, _ = _probe("generator", **{**trainer_env, "POSTTRAIN_HOST_MALLOC_SET": ""})
    assert faults < 0.05 * page_faults_of_the_scratch
