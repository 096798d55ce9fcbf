# Two commands set everything up on a fresh machine with Python 3.11 and make:
#   make run    start the whole system on the embedded default
#   make test   create the environment and pass the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# `make test` runs the suite in this many pytest-xdist workers (each test starts its own
# nats-server on port 0, so workers share nothing); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: run test security chaos bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/pgw up --open

test: $(STAMP)
	-sh tests/web/setup.sh
	-sh tests/ops/setup.sh
	-$(BIN)/python -m tests.mcp_peers
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal

security: $(STAMP)
	$(BIN)/python -m pytest -q -m security -p no:cacheprovider

chaos: $(STAMP)
	$(BIN)/python -m pytest -q -m chaos -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python -m benchmarks

lint: $(STAMP)
	$(BIN)/pip install --quiet ruff
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pgw .pytest_cache
