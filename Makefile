# The two commands of the README: `make demo` and `make test` (both set up .venv first).
VENV := .venv
PY := $(VENV)/bin/python
# One thread per process: tests run several ranks (and engines) on a 2-core machine.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
# The venv's ninja builds the sender's native checks (common/native.py) on first use.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-fast lint bench
setup:
	@bash scripts/setup_venv.sh

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 recipes/megatron_refit.py

lint: setup
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

bench: setup
	$(PY) bench/broadcast_bench.py --quick
