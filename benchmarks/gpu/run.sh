#!/usr/bin/env bash
# The GPU check, start to finish, on a machine with NVIDIA GPUs:
#   bash benchmarks/gpu/run.sh OUT [--parts sft,decode,grpo,parity]
# Makes .venv-gpu with posttrain and its CUDA extras (jax[cuda12], vLLM's CUDA build), then runs
# benchmarks/gpu/run.py, which writes OUT/results.json (and OUT/<part>.json). The install is not
# counted in the 10 minutes the check takes on one H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: benchmarks/gpu/run.sh OUT [run.py options]}
shift
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3.11 -m venv "$VENV" || python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -U pip
"$VENV/bin/pip" install -q -e '.[cuda,vllm,test]'
"$VENV/bin/python" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices()"
exec "$VENV/bin/python" -m benchmarks.gpu.run --out "$OUT" "$@"
