# Two commands for a newcomer: `make run` trains the example job, `make test` runs every test.
# While developing: `make test-fast` runs the tests that need no broker and are quick (just under 2 min on 2 cores).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
JOB    ?= examples/digits.yaml

.PHONY: run test test-fast test-soak test-compose install lint docs bench broker tools clean device-kit

run: $(STAMP)
	$(BIN)/fedmq run $(JOB)

# Lint first: a lint error fails the build before the tests take their minutes. Four workers
# (pytest-xdist) that steal work from each other: the end-to-end tests mostly wait on their
# services (three workers kept 2 cores 132% busy), and the longest ones must not end the run
# alone on one worker. TEST_WORKERS=0: serial.
# Soak tests (a three-node broker cluster, a storm of broker-side closes) run with `make test-soak`.
# The docs site is built too (seconds): a broken link or a page out of its nav fails the build.
TEST_WORKERS ?= 4
test: lint docs broker tools
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not soak" --durations=25

# Soak tests: minutes of CPU each (tests marked `soak`: a job across a three-node RabbitMQ
# cluster losing each node in turn, a storm of closes); outside `make test` (CI: 20 minutes, 2 cores).
test-soak: lint broker tools
	$(BIN)/python -m pytest -s -m soak

# Unit and in-memory integration tests: no RabbitMQ, nothing marked slow (tests/tiers.py). Two
# workers: these tests keep the cores busy themselves, and each worker spends ~13 s collecting
# (measured on 2 cores: 1:48 with two workers, 2:17 with four).
FAST_WORKERS ?= 2
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(FAST_WORKERS) -m "not rabbitmq and not slow"

# The compose stack for real (tests/compose, which `make test` never collects): images built by the
# compose-local tool (COMPOSE_LOCAL), three learners, kills, down and up. Needs a Docker engine (as
# root, the tool starts one); skips loudly without. docs/deployment.md, "Testing the compose stack".
COMPOSE_LOCAL ?= ../shared/tools/compose-local
test-compose: $(STAMP)
	FEDMQ_COMPOSE_LOCAL=$(abspath $(COMPOSE_LOCAL)) $(BIN)/python -m pytest -s tests/compose

# torch first (the CPU wheel), then the project with its test and docs tools, so pip never
# reaches for a CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,docs]'
	touch $(STAMP)

install: $(STAMP)

# `make test` starts a local RabbitMQ that is installed but stopped, and as root apt-get installs
# promtool and docker-compose when missing; each says so first. FEDMQ_NO_INSTALL=1: neither does.
broker:
	@scripts/ensure-rabbitmq.sh

tools:
	@scripts/ensure-tools.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy -p fedmq -p tests

# The docs site (docs/, mkdocs.yml) into build/site; --strict: any warning fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Every benchmark; their results go to benchmarks/results.json and docs/benchmarks.md is rendered
# from them (also when one failed: the page says which).
bench: $(STAMP) broker
	$(BIN)/python benchmarks/all.py; status=$$?; \
	$(BIN)/python benchmarks/report.py --write docs/benchmarks.md; exit $$status

clean:
	rm -rf $(VENV) .fedmq .pytest_cache .mypy_cache .hypothesis build/site

# What the device tool's GPU machine lacks (fedmq's dependencies as wheels for its Python, Erlang and
# RabbitMQ), packed into .device/ for scripts/device-check.sh (docs/development.md, "On a GPU machine").
device-kit: $(STAMP)
	scripts/device-kit.sh $(BIN)/python
