# Two entry points that set everything up on a fresh clone:
#   make run   - the main job (kvwire run on the default profile)
#   make test  - lint, type-check and the whole test suite
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvwire-installed

.PHONY: run test lint bench install redis-server

install: $(STAMP)

# torch is installed from the pin first: any later requirement on torch is then
# already satisfied and pip never reaches for a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,redis,bench,test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvwire run

redis-server:
	./scripts/ensure-redis-server

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

test: $(STAMP) redis-server lint
	$(BIN)/pytest

bench: $(STAMP) redis-server
	$(BIN)/python -m benchmarks
