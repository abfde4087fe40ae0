# The two commands of the README: `make test` and `make demo`. Each sets up
# everything it needs on a fresh Debian machine (virtual environment at .venv,
# pinned CPU torch through constraints.txt, tools, data).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATA_DIR ?= /usr/share/datasets/fashion-mnist
OUT ?= runs/demo-$(shell date +%Y%m%d-%H%M%S)
NPROC ?= 1

.PHONY: test demo demo-quick lint typecheck venv data clean

.DEFAULT_GOAL := test

# `make demo`, `make demo-quick` and `make data` live in demo.mk.
include demo.mk

$(STAMP): pyproject.toml constraints.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch numpy
	$(PY) -m pip install --quiet -c constraints.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[demo]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check kaisa tests benchmarks examples
	$(VENV)/bin/ruff format --check kaisa tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy kaisa

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -q tests

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache
