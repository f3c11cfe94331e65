"""Test setup: 8 fake CPU devices for sharding tests (must be set before JAX initialises), and
small helpers that build tiny HF models and tokenizers locally (nothing is downloaded)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# One compilation cache for the session, shared by every run it starts (the e2e runs compile the
# same tiny-model programs again and again); fresh per session, so CI's time is a cold start's
# and nothing reaches the user's own cache.
if "POSTTRAIN_COMPILE_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="posttrain-test-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["POSTTRAIN_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
