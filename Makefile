# Two commands set up a fresh machine: `make run` and `make test`.
# Each creates .venv (Python 3.11+) and installs what it needs on first use.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test lint typecheck pytest bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch exactly so: a CPU build lies on this disk; any other spec pulls gigabytes
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[daemon,client,arrow,torch,dev]'
	@touch $(STAMP)

## run: the daemon on its embedded default (./chunkd-data, ./chunkd-cache, 127.0.0.1:8470)
run: $(STAMP)
	$(BIN)/chunkd serve

## test: ruff, mypy (strict on the package) and the whole pytest suite
test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

## bench: every benchmark, side by side with the baselines; report in bench/out/
bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache chunkd-cache
