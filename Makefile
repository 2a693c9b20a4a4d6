# The two commands of the README: `make demo` and `make test` (both set up .venv first).
VENV := .venv
PY := $(VENV)/bin/python
# One thread per process: tests run several ranks (and engines) on a 2-core machine.
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test test-fast lint bench
# The sender's native checks (common/kernels/native.py) are built here, not in a first refit's setup.
setup:
	@bash scripts/setup_venv.sh
	-@$(PY) -m common.kernels.native

demo: setup
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 recipes/megatron_refit.py

lint: setup
	$(VENV)/bin/ruff check .

# The suite's budget is 25 minutes on 2 cores (docs/testing.md): two groups side by side
# (scripts/run_tests.sh), each ending with its slowest tests (DURATIONS; 0: every one) and total.
DURATIONS ?= 10
test: lint
	DURATIONS=$(DURATIONS) bash scripts/run_tests.sh

test-fast: setup
	$(PY) -m pytest -q -ra -m "not slow"

bench: setup
	$(PY) bench/broadcast_bench.py --quick
