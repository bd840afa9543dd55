#!/usr/bin/env bash
# Download, on this machine, the wheels the GPU machine lacks for `bench pipeline|profile`
# (deploy/gpu/bench-gpu.sh installs them there into /tmp/site).
#
# The GPU machine's image (python 3.12, torch 2.11 + CUDA 13, triton, transformers
# 5.17, accelerate, safetensors, huggingface_hub, numpy, pillow, rich, tqdm, regex, tokenizers,
# typer, pyyaml, ...) has no diffusers, sdnq, torchao or pydantic, and nothing can be downloaded
# there. Every wheel is fetched with --no-deps for CPython 3.12 manylinux x86_64; the
# dependencies are listed here explicitly, one version each:
#   diffusers, transformers  the versions this project's tests run with (the CPU venv);
#                            transformers 5.23 needs regex >= 2025.10.22 (carried) and
#                            tokenizers 0.23 (the image's 0.23.2 fits)
#   sdnq                     the SDNQ uint4 rows (needs torch, diffusers, transformers, accelerate)
#   torchao                  0.17.0: built against torch 2.11 (its own minimum), fp8 rows
#   pydantic (+ core, annotated-types, typing-inspection, typing-extensions >= 4.16),
#   pydantic-settings (+ python-dotenv)   infra.schemas / infra.settings import them
#   open-clip-torch          only its BPE table (pipeline/tokenizer.py); never imported
#   tenacity                 producer/__init__ imports RenderClient (`bench farm` submits through it)
#
# usage: deploy/gpu/fetch-wheels.sh [--dry-run] [--farm] [--dest DIR] [--limit-mib N]
#   --dry-run    print the wheels and the pip command, download nothing
#   --farm       the lighter set deploy/gpu/measure.sh and farm-gpu.sh install, sent beside .gpu-carry/
#                (into .whl-farm): the image's own transformers (every family checked with 5.17)
#   --dest DIR   default .whl (.whl-farm with --farm) in the repository root
#   --limit-mib  fail when the wheels exceed this (default 40; 16 with --farm): what is sent to a GPU
#                machine with the repository should stay small, as some rentals cap the upload
set -euo pipefail

WHEELS=(
  diffusers==0.42.1
  transformers==5.23.0
  regex==2026.11.15
  sdnq==0.2.8
  torchao==0.17.0
  pydantic==2.14.3
  pydantic-core==2.50.4
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  pydantic-settings==2.16.3
  python-dotenv==1.2.4
  open-clip-torch==3.3.0
  tenacity==9.2.1
)
FARM_SKIP=(transformers regex)
LIMIT_MIB=40
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest="$root/.whl"
dry=0
farm=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --farm) farm=1; dest="$root/.whl-farm" ;;
    --dest) dest="$2"; shift ;;
    --limit-mib) limit_mib="$2"; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "$root/.venv/bin/python" ]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
if [ "$farm" = 1 ]; then
  kept=()
  for spec in "${WHEELS[@]}"; do
    skip=0
    for name in "${FARM_SKIP[@]}"; do [ "${spec%%==*}" = "$name" ] && skip=1; done
    [ "$skip" = 1 ] || kept+=("$spec")
  done
  WHEELS=("${kept[@]}")
  LIMIT_MIB=16
fi
LIMIT_MIB=${limit_mib:-$LIMIT_MIB}
platform_args=()
for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
pip_download=("$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12
              --implementation cp --abi cp312 --abi abi3 --abi none "${platform_args[@]}" --platform any
              --dest "$dest")

if [ "$dry" = 1 ]; then
  echo "would download into $dest (CPython 3.12, manylinux x86_64, --no-deps):"
  printf '  %s\n' "${WHEELS[@]}"
  echo "command: ${pip_download[*]} NAME==VERSION"
  exit 0
fi

mkdir -p "$dest"
for spec in "${WHEELS[@]}"; do
  "${pip_download[@]}" -q "$spec"
done

# one version of each distribution: drop any wheel not pinned above (an older download)
keep=()
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  keep+=("$(echo "$name" | tr '-' '_' | tr '[:upper:]' '[:lower:]')-$version-")
done
for wheel in "$dest"/*.whl; do
  base=$(basename "$wheel" | tr '[:upper:]' '[:lower:]')
  ok=0
  for prefix in "${keep[@]}"; do case "$base" in "$prefix"*) ok=1 ;; esac; done
  if [ "$ok" = 0 ]; then echo "removing $(basename "$wheel") (not pinned here)"; rm -f "$wheel"; fi
done

total=0
for wheel in "$dest"/*.whl; do
  size=$(stat -c %s "$wheel")
  total=$((total + size))
  printf '%10d  %s\n' "$size" "$(basename "$wheel")"
done
count=$(ls "$dest"/*.whl | wc -l)
total_mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "total: $count wheels, $total_mib MiB (limit $LIMIT_MIB MiB)"
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels, found $count" >&2
  exit 1
fi
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "the wheels exceed $LIMIT_MIB MiB" >&2
  exit 1
fi
