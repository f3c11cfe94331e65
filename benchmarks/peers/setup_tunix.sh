#!/usr/bin/env bash
# Google's Tunix in its own virtual environment (.venv-tunix): its pins do not install beside
# ours, and a peer is only worth measuring as its authors ship it. The benchmarks that compare
# against Tunix (grpo_step.py, sft_throughput.py) run benchmarks/peers/tunix_bench.py with it.
# Idempotent: an existing .venv-tunix with the pinned version is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-tunix
PY=${PYTHON:-python3.11}
if "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('google-tunix') == '0.1.7'" 2>/dev/null; then
  echo "$VENV: Tunix 0.1.7 already installed"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "google-tunix==0.1.7" "jax==0.10.2" "jaxlib==0.10.2"
echo "$VENV: Tunix $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("google-tunix"))') installed"
