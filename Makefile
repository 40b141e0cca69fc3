# Two commands for a newcomer: `make run` trains the example job, `make test` runs every test.
# While developing: `make test-fast` runs the tests that need no broker and are quick (~30 s).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
JOB    ?= examples/digits.yaml

.PHONY: run test test-fast install lint bench broker tools clean

run: $(STAMP)
	$(BIN)/fedmq run $(JOB)

# Lint first: a lint error fails the build before the tests take their minutes.
test: lint broker tools
	$(BIN)/python -m pytest

# Unit and in-memory integration tests: no RabbitMQ, nothing marked slow (tests/tiers.py).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not rabbitmq and not slow"

# torch first (the CPU wheel), then the project, so pip never reaches for a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

broker:
	@scripts/ensure-rabbitmq.sh

tools:
	@scripts/ensure-tools.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy -p fedmq -p tests

bench: $(STAMP)
	$(BIN)/python benchmarks/codec.py
	$(BIN)/python benchmarks/embedded.py
	$(BIN)/python benchmarks/round_overhead.py
	$(BIN)/python benchmarks/large_model.py

clean:
	rm -rf $(VENV) .fedmq .pytest_cache .mypy_cache .hypothesis
