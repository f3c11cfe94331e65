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
applied = host_memory.keep_freed_memory()
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


def _probe(**environ) -> tuple[bool, float, str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "POSTTRAIN_HOST"))}
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                       env={**env, "JAX_PLATFORMS": "cpu", **environ}, timeout=120, check=True)
    applied, faults, arenas, trim = r.stdout.split()
    return applied == "True", float(faults), arenas, trim


def test_scratch_memory_is_reused_instead_of_faulted_in_every_call():
    page_faults_of_the_scratch = 128 * 2**20 / os.sysconf("SC_PAGESIZE")
    applied, faults, _, _ = _probe()
    assert applied and faults < 0.05 * page_faults_of_the_scratch
    # glibc's defaults map the scratch afresh each call: the check above can fail
    applied, faults, _, _ = _probe(POSTTRAIN_HOST_MALLOC="default")
    assert not applied and faults > 0.5 * page_faults_of_the_scratch


def test_a_malloc_variable_the_user_set_is_left_alone():
    # the user's 128 KiB mmap threshold stands: the scratch is mapped afresh every call again
    applied, faults, _, _ = _probe(MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
    assert applied and faults > 0.5 * 128 * 2**20 / os.sysconf("SC_PAGESIZE")


def test_only_processes_that_train_take_them():
    """One arena makes the decode loop's executor threads queue on its lock
    (posttrain/host_memory.py): `posttrain run` applies the settings, the other commands do
    not, and nothing goes into the environment, so workers the run starts keep glibc's
    defaults (a trainer-group host applies them itself)."""
    from posttrain.cli import build_parser

    assert build_parser().parse_args(["run", "r.yaml"]).trains
    assert not getattr(build_parser().parse_args(["validate", "r.yaml"]), "trains", False)
    _, _, arenas, trim = _probe()
    assert arenas == "None" and trim == "None"


def test_an_unknown_setting_is_a_clear_error_before_anything_runs():
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "run", "no-such-recipe.yaml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "POSTTRAIN_HOST_MALLOC": "off"})
    assert r.returncode == 2 and "POSTTRAIN_HOST_MALLOC='off'" in r.stderr
