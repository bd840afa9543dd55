# syntax=docker/dockerfile:1
# renderfarm status API: python:3.11-slim, the project with its [api] extra: no torch, no diffusers.
# The API imports only infra/ (infra knows nothing of diffusers; a test runs this entrypoint
# with torch blocked), so the ML stack of the [worker] extra is left out.
# Build from the repository root:
#   docker build -f deploy/docker/api.Dockerfile -t renderfarm/api:0.1.0 .

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/renderfarm renderfarm

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY infra ./infra
COPY pipeline ./pipeline
COPY producer ./producer
COPY worker ./worker
# The client and the [api] extra, as pyproject.toml declares them.
RUN pip install "./[api]" \
    && python -c "import infra.api.app; infra.api.app.create_app()" \
    && renderfarm api --help >/dev/null

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
# `renderfarm api` (its log config redacts API keys); the CLI root needs no torch for it.
ENTRYPOINT ["tini", "--", "renderfarm"]
CMD ["api", "--host", "0.0.0.0", "--port", "8000"]
