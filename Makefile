# Two commands set everything up on a fresh machine with Python 3.11 and make:
#   make run    start the whole system on the embedded default
#   make test   create the environment and pass the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# `make run` installs what running needs (the services, `pgw`, the MCP server and gate of the quick
# start); `make test` adds the test tools and every integration's library on top.
RUN_STAMP := $(VENV)/.installed-run
# `make test` runs the suite in this many pytest-xdist workers (each test starts its own
# nats-server on port 0, so workers share nothing); TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2

.PHONY: run test test-lowest security chaos bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(RUN_STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[mcp]'
	@touch $(RUN_STAMP)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(STAMP) $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/pgw up --quickstart

# The peers the suite runs against (browser, ops tools, the MCP reference servers), then the suite,
# with the Python of the environment $(1).
define suite
	-sh tests/web/setup.sh
	-sh tests/ops/setup.sh
	-$(1)/python -m tests.mcp_peers
	$(1)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal
endef

test: $(STAMP)
	$(call suite,$(BIN))

# The suite on the lowest release of each runtime dependency pyproject.toml admits (.ci/lowest.py):
# run it when a bound changes. Not part of `make test`, which gets the newest releases.
LOWEST := .venv-lowest
test-lowest:
	$(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install --quiet --upgrade pip packaging
	$(LOWEST)/bin/python .ci/lowest.py > $(LOWEST)/constraints.txt
	$(LOWEST)/bin/pip install --quiet -c $(LOWEST)/constraints.txt -e '.[test]'
	$(LOWEST)/bin/pip list --format=freeze | grep -i -E "^($$(sed 's/[=;].*//; s/[-_]/[-_]/g' $(LOWEST)/constraints.txt | paste -sd'|'))=="
	$(call suite,$(LOWEST)/bin)

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
	rm -rf $(VENV) $(LOWEST) .pgw .pytest_cache
