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


$(STAMP): pyproject.toml constraints.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch numpy
	$(PY) -m pip install --quiet -c constraints.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet -c constraints.txt -e '.[demo,bench,deepspeed,lightning,accelerate,transformers]'
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

# The README's main job (issue 5): `make demo` and `make demo-quick`, the
# benchmark suite of `kaisa demo`: workloads gap_cnn, small_cnn, vit, gpt (resnet20 on request) x
# arms sgd, adamw, muon, soap (heavyball, from the 'bench' extra), kaisa-sgd,
# kaisa-adamw (K-FAC with the library's defaults), 3 seeds, each run stopped
# at its workload's target. Per workload OUT/<workload>/{results.json,
# evaluations.csv,accuracy.png}; over workloads OUT/summary.{json,md}.
#
#   make demo                        # the suite: about 70 minutes on 2 cores (the knobs: the
#                                    # epoch budgets in kaisa/demo/config.py WORKLOADS, --seeds,
#                                    # --arms)
#   make demo-quick                  # gap_cnn, 1 epoch, sgd/adamw/muon/kaisa-sgd, one seed,
#                                    # target 85%: about two minutes
#   make demo OUT=runs/mine NPROC=2  # output directory; 2 processes (torchrun + gloo, DDP)
#   make demo DEMO_ARGS='--workload gap_cnn --arms sgd,kaisa-sgd'  # any `kaisa demo` option
#
# Peak learning rates come from benchmarks/results/suite_lrs.json, written by
# `python benchmarks/lr_sweep.py --suite` (about an hour per workload; see that
# script), else from the fallback table in kaisa/demo/config.py.

DEMO_ARGS ?=
FASHION_MNIST_PKG := dataset-fashion-mnist
FASHION_MNIST_FILES := train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz \
	t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz
DEMO := $(VENV)/bin/kaisa demo --data-dir $(DATA_DIR) --nproc $(NPROC) --out $(OUT) $(DEMO_ARGS)

.PHONY: data demo demo-quick

# The suite's data from Debian's packages, each installed only when it is missing:
# Fashion-MNIST (the image workloads) and the fortunes text corpus (the gpt
# workload; $KAISA_TEXT_DIR, read by `kaisa demo` too, names another directory
# of such text files).
TEXT_PKG := fortunes
TEXT_DEFAULT := /usr/share/games/fortunes
TEXT_DIR := $(or $(KAISA_TEXT_DIR),$(TEXT_DEFAULT))

data:
	@missing=""; for f in $(FASHION_MNIST_FILES); do \
		[ -f "$(DATA_DIR)/$$f" ] || missing="$$missing $$f"; \
	done; \
	if [ -z "$$missing" ]; then \
		echo "Fashion-MNIST: $(DATA_DIR)"; \
	elif [ "$(DATA_DIR)" != "/usr/share/datasets/fashion-mnist" ]; then \
		echo "Fashion-MNIST files missing from DATA_DIR=$(DATA_DIR):$$missing" >&2; \
		exit 1; \
	elif [ "$$(id -u)" = "0" ]; then \
		echo "Fashion-MNIST missing: installing the Debian package $(FASHION_MNIST_PKG)"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(FASHION_MNIST_PKG); \
	else \
		echo "Fashion-MNIST is missing from $(DATA_DIR). Install it as root with:" >&2; \
		echo "    apt-get update && apt-get install -y $(FASHION_MNIST_PKG)" >&2; \
		echo "(or: sudo apt-get update && sudo apt-get install -y $(FASHION_MNIST_PKG)), then run make again." >&2; \
		exit 1; \
	fi
	@if find "$(TEXT_DIR)" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' ! -name '.*' \
		2>/dev/null | grep -q .; then \
		echo "fortunes text corpus: $(TEXT_DIR)"; \
	elif [ "$(TEXT_DIR)" != "$(TEXT_DEFAULT)" ]; then \
		echo "No text files in KAISA_TEXT_DIR=$(TEXT_DIR)" >&2; \
		exit 1; \
	elif [ "$$(id -u)" = "0" ]; then \
		echo "fortunes text corpus missing: installing the Debian package $(TEXT_PKG)"; \
		apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(TEXT_PKG); \
	else \
		echo "The fortunes text corpus is missing from $(TEXT_DIR). Install it as root with:" >&2; \
		echo "    apt-get update && apt-get install -y $(TEXT_PKG)" >&2; \
		echo "(or: sudo apt-get update && sudo apt-get install -y $(TEXT_PKG)), then run make again." >&2; \
		exit 1; \
	fi

demo: $(STAMP) data
	$(DEMO)

demo-quick: $(STAMP) data
	$(DEMO) --quick
