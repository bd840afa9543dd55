# syntax=docker/dockerfile:1
# renderfarm CPU worker: python:3.11-slim, CPU torch, the project with its [worker] extra.
# Build from the repository root:
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t renderfarm/worker-cpu:0.1.0 .
# Also the image of the nightly catalog CronJob (it needs the full CLI).

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Where pip finds packages; a build without the internet points it at a local index
# (tests/deploy/test_images.py serves one on 127.0.0.1 with --network host).
ARG PIP_INDEX_URL=https://pypi.org/simple

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG OPEN_CLIP_VERSION=3.3.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RENDERFARM_CACHE_DIR=/models/renderfarm \
    HF_HOME=/models/huggingface

# PYTHON_IMAGE may also be a plain Debian bookworm (e.g. one made by debootstrap, as
# tests/deploy/test_images.py does offline): it has no Python, so python3, its venv module
# and `python` come from apt there; the python:*-slim images have all three already.
# tini: PID 1 that forwards SIGTERM, so Celery's warm shutdown finishes the current batch.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && { command -v python >/dev/null \
         || apt-get install -y --no-install-recommends python3 python3-venv python-is-python3; } \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/renderfarm renderfarm \
    && mkdir -p /models \
    && chown renderfarm:renderfarm /models

# torch first (CPU wheels), so the [worker] extra's torch range is already met; open-clip-torch
# without its deps, which would replace that torch (as the Makefile does).
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY infra ./infra
COPY pipeline ./pipeline
COPY producer ./producer
COPY worker ./worker
COPY bench ./bench
COPY deploy/constraints.txt ./constraints.txt
RUN pip install -c constraints.txt "./[worker]" \
    && pip install --no-deps "open-clip-torch==${OPEN_CLIP_VERSION}" \
    && renderfarm --help >/dev/null

USER 10001:10001
VOLUME ["/models"]
# No HEALTHCHECK: a worker serves no port; its health is its heartbeat in Redis
# (GET /v1/workers), and a zombie worker is stopped by the circuit breaker.
ENTRYPOINT ["tini", "--", "renderfarm"]
CMD ["worker", "--model", "tiny", "--device", "cpu"]
