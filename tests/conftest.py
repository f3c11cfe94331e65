"""Test setup: 8 fake CPU devices for sharding tests (must be set before JAX initialises), and
small helpers that build tiny HF models and tokenizers locally (nothing is downloaded)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
