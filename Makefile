# Two entry points for a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test env clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip uninstall --quiet --yes keel 2>/dev/null || true  # the distribution was named keel before keel-twin
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,ray,examples]'  # ray: tests/test_planner.py runs plan's replicas on a local Ray instance; examples: tests/test_job_examples.py
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/keel demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=20  # the slowest 20 printed: the suite must stay under 15 minutes on 2 cores

# Issue 13's reliability tests (pytest -m reliability) at FULL counts; writes docs/reliability.md.
.PHONY: reliability
reliability: $(STAMP)
	$(BIN)/python bench/reliability.py

# Issue 14: keel side by side with torchrun elastic and torchft, DCP, a naive SimPy model and torch's
# DataLoader, in one invocation; writes docs/benchmarks.md and docs/figures/bench-*.svg.
.PHONY: bench
bench: $(STAMP)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[peers]' || echo "make bench: torchft not installed; bench/peers.py skips it and says why"
	$(BIN)/python bench/peers_report.py

clean:
	rm -rf $(VENV)

# Issue 25: keel validate (emulated) over N members of a seeded family of scenarios; writes
# runs/validate-sweep/seed-SEED/ (sweep.md, sweep.json, sweep.svg, failing/ to replay).
# SWEEP_ARGS=--resume keeps the members a stopped sweep finished and runs the rest.
N    ?= 30
SEED ?= 1
SWEEP_ARGS ?=
.PHONY: validate-sweep
validate-sweep: $(STAMP)
	$(BIN)/python bench/validate_sweep.py $(N) --seed $(SEED) --quick $(SWEEP_ARGS)
