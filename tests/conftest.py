"""Test setup: 8 fake CPU devices for sharding tests (must be set before JAX initialises), and
small helpers that build tiny HF models and tokenizers locally (nothing is downloaded)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One compilation cache shared by every run the suite starts (the e2e runs compile the same
# tiny-model programs again and again), kept between sessions in the user's cache directory, apart
# from the user's own cache: CI's clean clones on one machine read back what the last run compiled.
# XLA:CPU compiles for the host's instruction set and JAX's cache key names only the platform
# ("cpu"), so the directory is keyed by the CPU's feature flags: a program built on an AVX-512
# machine is never loaded on an AVX2 one. POSTTRAIN_TEST_COLD=1: a fresh cache, deleted at exit
# (a cold start's time).
def _test_cache() -> str:
    import hashlib
    import tempfile

    if os.environ.get("POSTTRAIN_TEST_COLD"):
        import atexit
        import shutil

        path = tempfile.mkdtemp(prefix="posttrain-test-xla-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        return path
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:  # not Linux
        import platform

        flags = platform.processor()
    key = hashlib.sha1(flags.encode()).hexdigest()[:12]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    path = os.path.join(base, "posttrain", f"test-jax-{key}")
    os.makedirs(path, exist_ok=True)
    _bound(path, TEST_CACHE_BYTES)
    return path


# The cache's bound, kept here once per session and not by JAX: its `compilation_cache_max_size`
# scans the whole directory on every write (measured: the suite's models tests 3-6x slower at
# ~10k entries), and the suite writes tens of thousands of small programs.
TEST_CACHE_BYTES = 4 << 30


def _bound(path: str, limit: int) -> None:
    """Past `limit` bytes, the least recently written half of the entries goes."""
    entries = [e for e in os.scandir(path) if e.is_file()]
    if sum(e.stat().st_size for e in entries) <= limit:
        return
    entries.sort(key=lambda e: e.stat().st_mtime)
    for e in entries[:len(entries) // 2]:
        try:
            os.remove(e.path)
        except OSError:
            pass


if "POSTTRAIN_COMPILE_CACHE" not in os.environ:
    os.environ["POSTTRAIN_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = _test_cache()
    # every program, not only those compiling for over a second: the tests' eager gradients
    # compile thousands of small ones (measured, test_packed_batch's first case: 84 s cold,
    # 32 s warm this way; JAX's default keeps nearly none of them)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# ---- compiled programs held by the session -----------------------------------------------------
# XLA:CPU maps a few memory regions per compiled program (code and data sections, measured ~3)
# and a program lives as long as a jit cache holds it. The whole suite compiles tens of
# thousands in one process; at the kernel's vm.max_map_count (65530 by default) the next mmap
# fails and LLVM aborts the process ("Unable to allocate section memory": SIGABRT, or SIGSEGV)
# with no Python traceback: CI died that way at test ~390 of 526. After each test module, when
# the map count has passed a third of the limit, the compiled programs are dropped (the next
# module recompiles what it needs, or reads it back from the session's compile cache).
import gc  # noqa: E402

import pytest  # noqa: E402


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _map_limit() -> int:
    try:
        return int(open("/proc/sys/vm/max_map_count").read())
    except (OSError, ValueError):
        return 65530


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    yield
    if _map_count() > _map_limit() // 3:
        jax.clear_caches()
        gc.collect()


# ---- durations as they happen --------------------------------------------------------------------
# `--durations` prints only when the session ends; a run cut short by a time limit (CI's) leaves
# nothing. With POSTTRAIN_TEST_DURATIONS=FILE every test's phases append a line to FILE as each
# ends: "seconds phase nodeid".
def pytest_runtest_logreport(report):
    path = os.environ.get("POSTTRAIN_TEST_DURATIONS")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.when} {report.nodeid}\n")
