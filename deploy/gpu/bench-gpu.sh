#!/usr/bin/env bash
# The pipeline benchmarks on a GPU machine in named stages, one command (a machine with little
# setup: the wheels it lacks are installed from a folder sent with the repository).
#
# usage: bash deploy/gpu/bench-gpu.sh [--dry-run] [--results DIR] [--budget S] [--return-mib N]
#                                     [--return-files N] STAGE [STAGE ...]
#   STAGE is one of the stages below, or `custom`: the `;`-separated bench invocations in
#   $BENCH_CMDS (each the arguments of `python3 -m bench.cli`, e.g.
#   "pipeline --model tiny --device cuda --json @/x.json"; `@/` stands for the work folder).
#   --dry-run prints the invocations and does nothing else (runs anywhere).
#   --results DIR (default ./gpu-results), --budget S (seconds for the whole run, default 540),
#   --return-mib N and --return-files N: as deploy/gpu/measure.sh (what the results folder may hold).
#
# What it does: installs the wheels in .whl/ (made by deploy/gpu/fetch-wheels.sh) into /tmp/site
# and puts them and the repository on PYTHONPATH (the project itself needs no install); prints
# nvidia-smi and the torch/triton/CUDA versions; runs each invocation with
# `python3 -m bench.cli` (the bench commands without the CLI root, whose other commands
# need Celery/Redis/FastAPI), each writing its JSON into the work folder; after every invocation
# refreshes the results folder (deploy/gpu/results.py pack: results.tgz, the JSONs while they fit)
# beside bench-gpu.log there, so a run stopped at its time limit still leaves what finished. Each
# invocation gets the time left before the budget; one that runs out is stopped, the next skipped.
# At the end: a one-line-per-row summary of every JSON.
#
# Stages (run the smoke pass first; times are estimates until a run records them):
#   smoke        tiny: every row kind at 256², 1 round, compile mode default; profile;
#                model-card table with sdnq-uint4; sd15-arch 512² 4 steps, no compile
#   sd15         sd15-arch 512², 20 steps, batch 1, all five rows, 5 rounds (four rows compile
#                the UNet and the VAE decoder with max-autotune: minutes each; with
#                COMPILE_MODE=max-autotune-no-cudagraphs or default, much less)
#   sd15-pool    sd15-arch 512², 20 steps, the pool's batch size, reference/peer/exact/fast
#   sdturbo      sd-turbo-arch 512², 1 step, guidance 0, batch 1 and the pool's
#   sdxl         sdxl-arch 1024², 30 steps, batch 1
#   flux         flux-schnell-arch 1024², 4 steps, guidance 0, batch 1, one row at a time
#   ernie        ernie-image-turbo-arch 1024², 8 steps, guidance 1: the SDNQ model card's table
#                (reference bf16 vs sdnq-uint4), and the side-by-side table
#   profile-sd15 profile-sdxl profile-flux   `bench profile` of exact and fast (and peer for sd15)
# Inductor's caches live in $TORCHINDUCTOR_CACHE_DIR (/tmp/inductor-cache): a stage run again on the
# same (still running) machine compiles from its cache.
set -uo pipefail
export PYTHONUNBUFFERED=1

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
dry=0 out=$root/gpu-results deadline_s=540 return_mib=64 return_files=8
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --results) out=${2:?}; shift ;;
    --budget) deadline_s=${2:?}; shift ;;
    --return-mib) return_mib=${2:?}; shift ;;
    --return-files) return_files=${2:?}; shift ;;
    -*) sed -n '2,40p' "$0"; exit 2 ;;
    *) break ;;
  esac
  shift
done
if [ $# -eq 0 ]; then sed -n '2,40p' "$0"; exit 2; fi

results=${BENCH_RESULTS:-/tmp/bench-results}  # the work folder; --results gets a copy after each invocation
start=$(date +%s)
export RENDERFARM_CACHE_DIR=${RENDERFARM_CACHE_DIR:-/tmp/renderfarm-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}

R=@
# rows LIST: the specs, each compiled row given compile_mode=$COMPILE_MODE when that is set (e.g.
# COMPILE_MODE=max-autotune-no-cudagraphs or default: minutes less of compiling per row and shape
# than max-autotune, the peer's tutorial mode and the cuda recipes' own)
rows() {
  local out=() spec
  IFS=, read -ra list <<< "$1"
  for spec in "${list[@]}"; do
    if [ -n "${COMPILE_MODE:-}" ] && [ "$spec" != reference ] && [ "${spec%%:*}" = "$spec" ]; then
      spec="$spec:compile_mode=$COMPILE_MODE"
    fi
    out+=("$spec")
  done
  (IFS=,; echo "${out[*]}")
}
ALL5=$(rows "reference,peer,exact,fast,exact+batch_invariant")
NOCOMPILE="compile_unet=false+compile_vae=false"
stage_commands() {  # one invocation per line
  case "$1" in
    smoke)  # cheap compiles: this checks the paths, not the speed
      echo "pipeline --model tiny --device cuda --width 256 --height 256 --steps 4 --batch-sizes 1,2 --repeats 1 --recipes reference,peer:compile_mode=default,exact:compile_mode=default,fast:compile_mode=default,exact+batch_invariant:$NOCOMPILE --json $R/smoke-pipeline-tiny.json"
      echo "profile --model tiny --device cuda --width 256 --height 256 --steps 4 --recipe exact:compile_mode=default --json $R/smoke-profile-tiny.json"
      echo "pipeline --table modelcard --model tiny --device cuda --width 256 --height 256 --steps 4 --guidance-scale 1 --repeats 2 --recipes reference,sdnq-uint4 --json $R/smoke-modelcard-tiny.json"
      echo "pipeline --model sd15-arch --device cuda --width 512 --height 512 --steps 4 --batch-sizes 1 --repeats 1 --recipes reference,exact:$NOCOMPILE --json $R/smoke-pipeline-sd15-arch.json" ;;
    sd15)
      echo "pipeline --model sd15-arch --device cuda --width 512 --height 512 --steps 20 --batch-sizes 1 --repeats 5 --recipes $ALL5 --json $R/pipeline-sd15-arch-b1.json" ;;
    sd15-pool)
      echo "pipeline --model sd15-arch --device cuda --width 512 --height 512 --steps 20 --batch-sizes pool --repeats 5 --recipes $(rows reference,peer,exact,fast) --json $R/pipeline-sd15-arch-pool.json" ;;
    sdturbo)
      echo "pipeline --model sd-turbo-arch --device cuda --width 512 --height 512 --steps 1 --guidance-scale 0 --batch-sizes 1,pool --repeats 5 --recipes $ALL5 --json $R/pipeline-sd-turbo-arch.json" ;;
    sdxl)
      echo "pipeline --model sdxl-arch --device cuda --width 1024 --height 1024 --steps 30 --batch-sizes 1 --repeats 5 --recipes $ALL5 --json $R/pipeline-sdxl-arch-b1.json" ;;
    flux)
      echo "pipeline --model flux-schnell-arch --device cuda --width 1024 --height 1024 --steps 4 --guidance-scale 0 --batch-sizes 1 --repeats 5 --sequential --recipes $(rows reference,peer,exact,fast) --json $R/pipeline-flux-schnell-arch.json" ;;
    ernie)
      echo "pipeline --table modelcard --model ernie-image-turbo-arch --device cuda --width 1024 --height 1024 --steps 8 --guidance-scale 1 --repeats 3 --recipes reference,sdnq-uint4 --json $R/modelcard-ernie-image-turbo-arch.json"
      echo "pipeline --model ernie-image-turbo-arch --device cuda --width 1024 --height 1024 --steps 8 --guidance-scale 1 --batch-sizes 1 --repeats 5 --sequential --recipes $(rows reference,peer,exact,fast) --json $R/pipeline-ernie-image-turbo-arch.json" ;;
    profile-sd15)
      for spec in $(rows exact,fast,peer | tr , ' '); do
        echo "profile --model sd15-arch --device cuda --width 512 --height 512 --steps 20 --recipe $spec --json $R/profile-sd15-arch-${spec%%:*}.json"
      done ;;
    profile-sdxl)
      for spec in $(rows exact,fast | tr , ' '); do
        echo "profile --model sdxl-arch --device cuda --width 1024 --height 1024 --steps 30 --recipe $spec --json $R/profile-sdxl-arch-${spec%%:*}.json"
      done ;;
    profile-flux)
      for spec in $(rows exact,fast | tr , ' '); do
        echo "profile --model flux-schnell-arch --device cuda --width 1024 --height 1024 --steps 4 --guidance-scale 0 --recipe $spec --json $R/profile-flux-schnell-arch-${spec%%:*}.json"
      done ;;
    custom)
      if [ -z "${BENCH_CMDS:-}" ]; then echo "custom: set BENCH_CMDS" >&2; return 1; fi
      echo "$BENCH_CMDS" | tr ';' '\n' | sed 's/^ *//; /^$/d' ;;
    *) echo "unknown stage: $1" >&2; return 1 ;;
  esac
}

commands=()
for stage in "$@"; do
  lines=$(stage_commands "$stage") || exit 2
  while IFS= read -r line; do commands+=("${line//$R\//$results/}"); done <<< "$lines"
done

if [ "$dry" = 1 ]; then
  for c in "${commands[@]}"; do echo "python3 -m bench.cli $c"; done
  exit 0
fi

mkdir -p "$out" "$results"
exec > >(tee -a "$out/bench-gpu.log") 2>&1

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the wheels in .whl/ failed"; exit 1; }
else
  echo "no .whl/ here: run deploy/gpu/fetch-wheels.sh and send .whl/ with the repository"
fi
export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}
if ! python3 -c "import bench.pipeline, infra.schemas" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
fi

nvidia-smi
python3 - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
for name in ("triton", "diffusers", "transformers", "accelerate", "sdnq", "torchao", "pydantic", "huggingface-hub"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} missing")
PY

status=0
for c in "${commands[@]}"; do
  left=$((deadline_s - ($(date +%s) - start)))
  if [ "$left" -lt 20 ]; then
    echo "=== skipped (deadline): $c"; status=1; continue
  fi
  echo "=== $(date +%T) ($left s left): python3 -m bench.cli $c"
  # shellcheck disable=SC2086  # the invocation is a word list on purpose
  timeout --signal=INT --kill-after=15 "$left" python3 -m bench.cli $c
  rc=$?
  echo "=== exit $rc after $(( $(date +%s) - start )) s"
  [ "$rc" -eq 0 ] || status=1
  python3 deploy/gpu/results.py pack "$results" "$out" "$return_mib" "$return_files"
done

python3 - "$results" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    print(f"## {path.name} ({r.get('benchmark')}, {r.get('seconds')} s)")
    if r.get("benchmark") == "profile":
        print("  per step", r["per_step"], "| per scheduler.step", r["per_scheduler_step"])
        print("  sync debug", {k: v for k, v in (r.get("sync_debug") or {}).items() if k != "top_sources"})
        print("  denoiser", r["denoiser"], "| render ms by category", r["time_by_category"]["render"])
        continue
    keys = ("recipe", "batch_size", "load_s", "cold_s", "hot_mean_s_per_img", "hot_median_s_per_img", "it_per_s",
            "images_per_s", "peak_allocated_mib", "peak_reserved_mib", "psnr_db", "pct_of_bf16_matmul", "speedup",
            "vs_peer", "load_peak_allocated_mib", "cold_peak_allocated_mib", "hot_peak_reserved_mib",
            "hot_peak_allocated_mib", "speed_vs_first", "peak_vs_first")
    for row in r["rows"]:
        print("  " + " ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None))
PY
python3 deploy/gpu/results.py pack "$results" "$out" "$return_mib" "$return_files"
echo "results: $out (results.tgz, bench-gpu.log); status $status"
exit $status
