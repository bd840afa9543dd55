#!/usr/bin/env bash
# One lent GPU session's measurements, planned in calls that each end inside 10 minutes.
#
# usage: bash deploy/gpu/session.sh PLAN     (PLAN: a, b, or cpu-check)
#   a          the families and sync checks on the device, then `bench pipeline` for sd15-arch
#              (512², 20 steps, batch 1) and sdxl-arch (1024², 30 steps, batch 1)
#   b          the farm on the GPU (`bench farm`, sd-turbo-arch 512² 1 step, batch 16, against a
#              bare loop), flux-schnell-arch (1024², 4 steps) and the ERNIE-Image-Turbo model card
#              table (bf16 against SDNQ uint4 with quantized matmul)
#   c          the last call: sd15-arch side by side (the farm's row without compile), the farm on
#              the GPU (no compile), flux-schnell-arch (the farm's row without compile)
#   cpu-check  every invocation of a and b with the tiny models on this CPU (checks the command
#              lines and code paths before device time is spent; nothing is measured);
#              cpu-check-a and cpu-check-b: one plan's
#
# Carried (device `carry`): .whl-farm (deploy/gpu/fetch-wheels.sh --farm) and .gpu-carry
# (deploy/gpu/fetch-farm-carry.sh). The image's own transformers is used (5.17 on the machines
# seen; every family was checked with it on the CPU).
#
# Compile: the farm's CUDA recipes compile with mode max-autotune-no-cudagraphs; here every
# compiled row uses mode "default" instead (COMPILE_MODE), and the diffusers tutorial's peer runs
# without its coordinate-descent tuning flags: with them, compiling even the tiny test model took
# 450 s on the H100, and the session has 30 minutes of device time in all. Rows say so.
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
plan=${1:?usage: session.sh a|b|cpu-check}
OUT=${OUT:-$root/gpu-out}
R=/tmp/bench-results
mkdir -p "$OUT" "$R"
exec > >(tee -a "$OUT/session-$plan.log") 2>&1
start=$(date +%s)
deadline=${SESSION_DEADLINE_S:-555}
export RENDERFARM_CACHE_DIR=${RENDERFARM_CACHE_DIR:-/tmp/renderfarm-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
C=${COMPILE_MODE:-default}

if [ "${plan%%-*}" = cpu ]; then
  DEV=cpu; SD15=tiny; SDXL=tiny-sdxl; TURBO=tiny; FLUX=tiny-flux; ERNIE=tiny-ernie-image; S=64; L=64; PY=${PYTHON:-.venv/bin/python}
  NOCOMPILE=+compile_denoiser=false+compile_vae=false
else
  DEV=cuda; SD15=sd15-arch; SDXL=sdxl-arch; TURBO=sd-turbo-arch; FLUX=flux-schnell-arch; ERNIE=ernie-image-turbo-arch
  S=512; L=1024; PY=python3; NOCOMPILE=
  tar xJf .gpu-carry/farmsite.tar.xz -C /tmp || exit 1
  mkdir -p /tmp/farmbin
  xz -dc .gpu-carry/redis-server.xz > /tmp/farmbin/redis-server && xz -dc .gpu-carry/weed.xz > /tmp/farmbin/weed \
    && chmod +x /tmp/farmbin/* || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-farm/*.whl || exit 1
  export PATH=/tmp/farmbin:$PATH PYTHONPATH=/tmp/site:/tmp/farmsite:$root
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, diffusers, transformers; print('torch', torch.__version__, 'triton', \
triton.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)"
fi

run() {  # run NAME ARGS...: one invocation, inside what is left of the deadline
  local name=$1; shift
  local left=$((deadline - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then echo "=== skipped (deadline): $name"; return 1; fi
  echo "=== $(date +%T) $name ($left s left)"
  timeout --signal=INT --kill-after=20 "$left" "$@"
  echo "=== $name: exit $? after $(( $(date +%s) - start )) s"
  tar czf "$OUT/results-$plan.tgz" -C "$R" . 2>/dev/null
}
bench() { run "$1" "$PY" -m producer.bench_cli "${@:2}"; }

plan_a() {
  run checks "$PY" -m pipeline.gpu_checks --out "$R/checks" --only families,syncs --device "$DEV" \
    --overrides '{"compile_denoiser": false, "compile_vae": false}'
  bench sd15 pipeline --model "$SD15" --device "$DEV" --width "$S" --height "$S" --steps 20 --batch-sizes 1 \
    --repeats 3 --json "$R/pipeline-sd15-arch-b1.json" --recipes \
    "reference,peer:compile_mode=$C+tuning=false,exact:compile_mode=$C$NOCOMPILE,fast:compile_mode=$C$NOCOMPILE,exact+batch_invariant:compile_mode=$C$NOCOMPILE"
  bench sdxl pipeline --model "$SDXL" --device "$DEV" --width "$L" --height "$L" --steps 30 --batch-sizes 1 \
    --repeats 2 --sequential --json "$R/pipeline-sdxl-arch-b1.json" --recipes "reference,exact:compile_mode=$C$NOCOMPILE"
}

plan_b() {
  bench farm farm --model "$TURBO" --jobs 256 --batch-size 16 --width "$S" --height "$S" --steps 1 \
    --guidance-scale 0 --rounds 2 --submit-jobs 0 --json "$R/farm-sd-turbo-arch-b16.json"
  bench flux pipeline --model "$FLUX" --device "$DEV" --width "$L" --height "$L" --steps 4 --guidance-scale 0 \
    --batch-sizes 1 --repeats 2 --sequential --json "$R/pipeline-flux-schnell-arch.json" \
    --recipes "reference,exact:compile_mode=$C$NOCOMPILE"
  bench ernie pipeline --table modelcard --model "$ERNIE" --device "$DEV" --width "$L" --height "$L" --steps 8 \
    --guidance-scale 1 --repeats 2 --json "$R/modelcard-ernie-image-turbo-arch.json" --recipes reference,sdnq-uint4
}

plan_c() {  # what fits in the last minutes: no compile in the farm's rows (see the header)
  local eager='+compile_denoiser=false+compile_vae=false'
  bench sd15 pipeline --model "$SD15" --device "$DEV" --width "$S" --height "$S" --steps 20 --batch-sizes 1 \
    --repeats 2 --json "$R/pipeline-sd15-arch-b1.json" --recipes "reference,peer:compile_mode=$C+tuning=false,exact:compile_mode=$C$eager"
  RENDERFARM_RECIPE_OVERRIDES='{"compile_denoiser": false, "compile_vae": false}' \
    bench farm farm --model "$TURBO" --jobs 128 --batch-size 16 --width "$S" --height "$S" --steps 1 \
    --guidance-scale 0 --rounds 1 --submit-jobs 0 --json "$R/farm-sd-turbo-arch-b16.json"
  bench flux pipeline --model "$FLUX" --device "$DEV" --width "$L" --height "$L" --steps 4 --guidance-scale 0 \
    --batch-sizes 1 --repeats 2 --sequential --json "$R/pipeline-flux-schnell-arch.json" \
    --recipes "reference,exact:compile_mode=$C$eager"
}

case "$plan" in
  a) plan_a ;;
  c) plan_c ;;
  cpu-check-c) plan_c ;;
  b) plan_b ;;
  cpu-check) plan_a; plan_b ;;
  cpu-check-a) plan_a ;;
  cpu-check-b) plan_b ;;
  *) echo "unknown plan $plan" >&2; exit 2 ;;
esac
cp "$R"/*.json "$OUT"/ 2>/dev/null
cp "$R"/checks/*.json "$OUT"/ 2>/dev/null
ls -la "$OUT"
