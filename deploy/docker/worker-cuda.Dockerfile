# syntax=docker/dockerfile:1
# renderfarm CUDA worker: NVIDIA CUDA runtime base, Python 3.11, torch with CUDA from the
# PyTorch CUDA index, the project with its [gpu] extra, flash-attn optional.
# Build from the repository root:
#   docker build -f deploy/docker/worker-cuda.Dockerfile -t renderfarm/worker-cuda:0.1.0 .
#   docker build -f deploy/docker/worker-cuda.Dockerfile --build-arg FLASH_ATTN=1 \
#       -t renderfarm/worker-cuda:0.1.0-fa .
# CUDA_VERSION, the base's Ubuntu and TORCH_INDEX_URL's cuXYZ must agree.

ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu22.04

# --- stage 1: a venv with torch (+ flash-attn, compiled against that torch, when asked) ---
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${UBUNTU} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG OPEN_CLIP_VERSION=3.3.0
ARG FLASH_ATTN=0
ARG FLASH_ATTN_VERSION=2.8.3
# flash-attn compiles for these SM archs only (H100 = 9.0, L4 = 8.9, A100 = 8.0).
ARG TORCH_CUDA_ARCH_LIST="8.0;8.9;9.0"
ARG MAX_JOBS=4

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev git \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN if [ "${FLASH_ATTN}" = "1" ]; then \
        pip install "packaging==26.0" "ninja==1.13.0" "wheel==0.45.1" \
        && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
           pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; \
    fi

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY infra ./infra
COPY pipeline ./pipeline
COPY producer ./producer
COPY worker ./worker
COPY bench ./bench
COPY deploy/constraints.txt ./constraints.txt
# the [gpu] extra: the worker's stack with torchao and sdnq (flash-attn above, built against this torch)
RUN pip install -c constraints.txt "./[gpu]" && pip install --no-deps "open-clip-torch==${OPEN_CLIP_VERSION}"

# --- stage 2: the runtime image ---
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${UBUNTU}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RENDERFARM_CACHE_DIR=/models/renderfarm \
    HF_HOME=/models/huggingface \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 tini \
    && apt-get purge -y software-properties-common \
    && apt-get autoremove -y \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/renderfarm renderfarm \
    && mkdir -p /models \
    && chown renderfarm:renderfarm /models

COPY --from=build /opt/venv /opt/venv
RUN renderfarm --help >/dev/null

USER 10001:10001
VOLUME ["/models"]
# No HEALTHCHECK: a worker serves no port; its health is its heartbeat in Redis
# (GET /v1/workers), and a zombie worker is stopped by the circuit breaker.
ENTRYPOINT ["tini", "--", "renderfarm"]
CMD ["worker", "--model", "stabilityai/sd-turbo", "--device", "cuda"]
