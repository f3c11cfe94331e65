"""Checkpoint converters: HF safetensors <-> Orbax, per-architecture name/layout maps."""
