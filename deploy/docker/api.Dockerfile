# syntax=docker/dockerfile:1
# renderfarm status API: python:3.11-slim, the project with its [api] extra: no torch, no diffusers.
# The API imports only infra/ (infra knows nothing of diffusers; a test runs this entrypoint
# with torch blocked), so the ML stack of the [worker] extra is left out.
# Build from the repository root:
#   docker build -f deploy/docker/api.Dockerfile -t renderfarm/api:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Where pip finds packages; a build without the internet points it at a local index
# (tests/deploy/test_images.py serves one on 127.0.0.1 with --network host).
ARG PIP_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# PYTHON_IMAGE may also be a plain Debian bookworm (e.g. one made by debootstrap, as
# tests/deploy/test_images.py does offline): it has no Python, so python3, its venv module
# and `python` come from apt there; the python:*-slim images have all three already.
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && { command -v python >/dev/null \
         || apt-get install -y --no-install-recommends python3 python3-venv python-is-python3; } \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/renderfarm renderfarm

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY infra ./infra
COPY pipeline ./pipeline
COPY producer ./producer
COPY worker ./worker
COPY bench ./bench
# The client and the [api] extra, as pyproject.toml declares them.
RUN pip install "./[api]" \
    && python -c "import infra.api.server; infra.api.server.create_app()" \
    && renderfarm api --help >/dev/null

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
# `renderfarm api` (its log config redacts API keys); the CLI root needs no torch for it.
ENTRYPOINT ["tini", "--", "renderfarm"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
