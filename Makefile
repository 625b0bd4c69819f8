# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
# Both create .venv (once, and again whenever pyproject.toml changes) before they run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: train test test-fast lint bench clean slurm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and by exact version: on a CPU-only box with a local wheel this takes seconds.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev]"
	# replaced by parallama's own Optuna sweeper (it pins optuna 2.x): gone from venvs made before
	$(BIN)/python -m pip uninstall -y -q hydra-optuna-sweeper 2>/dev/null || true
	touch $(STAMP)

train: $(STAMP)  ## train the default tiny model on the embedded corpus (extra overrides: make train ARGS="...")
	$(BIN)/parallama-train $(ARGS)

# Test files run in 2 pytest-xdist workers (a file stays on one worker, so its module fixtures run once): CI has 2
# cores, and most tests wait on a training subprocess that uses one. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: $(STAMP) slurm  ## the whole CPU test suite: unit, integration, distributed, slurm (what CI runs)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)

# A one-node SLURM cluster for tests/slurm: its Debian packages (slurmctld, slurmd, munged), installed when missing.
# The `slurm` fixture (tests/conftest.py, tests/slurm/cluster.py) configures and starts the daemons; without root
# or apt-get this says so in one line and those tests skip, saying why.
slurm:
	@export PATH=$$PATH:/usr/sbin:/sbin; \
	missing=$$(for b in sbatch srun scontrol slurmctld slurmd munged; do command -v $$b >/dev/null || echo $$b; done); \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "slurm: no" $$missing "and no root with apt-get to install slurm-wlm and munge: tests/slurm will skip"; \
	else \
	  echo "slurm: installing slurm-wlm and munge with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1; } || \
	  echo "slurm: apt-get install slurm-wlm munge failed: tests/slurm will skip"; \
	fi

test-fast: $(STAMP)  ## unit tests only (no training run; about 3 minutes)
	$(BIN)/python -m pytest tests/unit --durations=10 $(ARGS)

lint: $(STAMP)  ## ruff, and the packages' layering (pyproject.toml's import-linter contract; docs/architecture.md)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/lint-imports

bench: $(STAMP)  ## CPU benchmarks (see docs/benchmarks.md)
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf logs data/cache .pytest_cache
