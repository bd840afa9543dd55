#!/usr/bin/env bash
# The GPU measurements as ONE command that fits a short GPU rental: a fresh machine, minutes of
# time, nothing downloadable there, and a folder of results to copy back.
#
# usage: bash deploy/gpu/measure.sh [--dry-run] [--results DIR] [--budget S] [--parts a,b,...]
#                                   [--return-mib N] [--return-files N] [--wheels DIR] [--carry DIR]
#   --results DIR     where the results go (default ./gpu-results): run.log, results.tgz (everything),
#                     parts.json and the part JSONs while --return-files allows
#   --budget S        seconds for the whole run, setup included (default 540: a 10-minute rental with
#                     room to copy back); each part below has its own budget, capped by what is left
#   --parts a,b       run only these parts, in the order below (default: all)
#   --return-mib N    the most results.tgz may hold (default 64); compile-cache artifacts go in only while
#                     it fits, the rest are listed with their bytes and SHA-256 (artifacts.json)
#   --return-files N  the most files kept in the results folder (default 8)
#   --wheels DIR      pipeline wheels to install (default .whl-farm: deploy/gpu/fetch-wheels.sh --farm)
#   --carry DIR       farm packages and binaries, optional (default .gpu-carry: fetch-farm-carry.sh)
#   --dry-run         the same parts on this CPU with the tiny models (tiny, tiny-flux, tiny-sdxl), 64²,
#                     2 steps, 1 timed round, compile off in the farm's rows: checks every command line and
#                     code path before GPU time is spent; nothing is measured (tests/bench/test_gpu_scripts.py)
#
# Every bench invocation writes its JSON into the work folder after each cold call, settle call and
# round (`bench pipeline` checkpoints; rows run one at a time, --sequential), so a part cut off by its
# budget keeps every row it finished; the results folder is refreshed after every part. Each part
# also logs TorchDynamo's recompiles (TORCH_LOGS=recompiles, <part>.recompiles.log).
# Parts, in priority order (the first three fit 540 s; budgets in seconds, env overrides):
#   flux-a     flux-schnell-arch 1024², 4 steps, guidance 0, batch 1: reference, the same with torchao
#              fp8 on the denoiser eager (the lower bound), the farm's exact (regional compile)  FLUX_A_S 150
#   flux-fast  the same: reference, the farm's fast (torchao fp8 + compile) with GEMM autotuning off
#              (compile_gemm_autotune=false: one cuBLASLt choice per fp8 GEMM)              FLUX_FAST_S 130
#   wan-video  wan2.1-t2v-1.3b-arch (with its UMT5-XXL) 832x480, 33 frames, 4 steps, guidance 5: bench
#              pipeline --video (exact, eager; with VAE tiling; with First Block Cache 0.05), s/frame and
#              peak allocated, 2 rounds (dry run: tiny-wan 64², 9 frames, 2 steps)         WAN_VIDEO_S 150
#   sd15-pool  sd15-arch 512², 20 steps, the pool's batch (16 on a cuda-large card): exact, reference,
#              fast                                                                         SD15_POOL_S 200
#   sdxl-pool  sdxl-arch 1024², 20 steps, the pool's batch: exact, reference                SDXL_POOL_S 220
#   sd15-like  sd15-arch 512², batch 1, like for like: reference, the peer without and with CUDA graphs,
#              exact with and without them                                                  SD15_LIKE_S 330
#   sd15-cudnn sd15-arch 512², the pool's batch: exact with cuDNN's SDPA (the dry run: math)  SD15_CUDNN_S 110
#   ready      bench ready: a cuda-large worker's whole bucket plan (1,2,4,8,16) at 512², cold, then
#              from the compile cache; the artifact kept under artifacts/ (dry run: bucket 1)  READY_S 480
# The compiled farm rows use static shapes and CUDA graphs (compile_dynamic=false,
# compile_mode=reduce-overhead); regionally compiled blocks compile without graphs (see
# pipeline/optimize/compile.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
dry=0 results=$root/gpu-results budget=540 parts="" return_mib=64 return_files=8
wheels=.whl-farm carry=.gpu-carry
usage() { sed -n '2,20p' "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --results) results=${2:?}; shift ;;
    --budget) budget=${2:?}; shift ;;
    --parts) parts=${2:?}; shift ;;
    --return-mib) return_mib=${2:?}; shift ;;
    --return-files) return_files=${2:?}; shift ;;
    --wheels) wheels=${2:?}; shift ;;
    --carry) carry=${2:?}; shift ;;
    *) usage ;;
  esac
  shift
done
case "$budget$return_files" in *[!0-9]*) echo "--budget and --return-files take whole numbers" >&2; exit 2 ;; esac
start=$(date +%s)
mkdir -p "$results" || exit 1
results=$(cd "$results" && pwd)
W=$(mktemp -d "${TMPDIR:-/tmp}/gpu-measure.XXXXXX")  # the work folder: results.tgz holds what it had
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/artifacts"
exec > >(tee -a "$results/run.log") 2>&1
# the offline models' builds and OpenVINO IRs: RENDERFARM_CACHE_DIR as set, else the settings' default
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$W/inductor-cache}
FARM=compile_dynamic=false+compile_mode=reduce-overhead
if [ "$dry" = 1 ]; then
  DEV=cpu SD15=tiny SDXL=tiny-sdxl FLUX=tiny-flux S=64 L=64 STEPS=2 FSTEPS=2 N=1 PY=${PYTHON:-python3}
  WAN=tiny-wan VW=64 VH=64 VF=9 VSTEPS=2
  NOGEMM=--no-gemm  # the CPU's GEMM probe takes seconds a row and says nothing about the GPU's
  FARM=$FARM+compile_denoiser=false+compile_vae=false
  BUCKETS=1 RSTEPS=1 SDPA=math  # the CPU has no cuDNN attention: the same knob, another backend
  PEER_PLAIN=peer:compile=false+compile_mode=default PEER_GRAPHS=peer:compile=false+compile_mode=reduce-overhead
  # the VAE decoder compiled without freezing, as the GPU's reduce-overhead compile never freezes
  READY='{"compile_denoiser": false, "compile_vae": true, "batch_invariant": false, "compile_dynamic": false, "compile_freeze": false}'
else
  DEV=cuda SD15=sd15-arch SDXL=sdxl-arch FLUX=flux-schnell-arch S=512 L=1024 STEPS=20 FSTEPS=4 N=5 PY=python3
  WAN=wan2.1-t2v-1.3b-arch VW=832 VH=480 VF=33 VSTEPS=4
  NOGEMM=
  BUCKETS=1,2,4,8,16 RSTEPS=2 SDPA=cudnn
  PEER_PLAIN=peer:compile_mode=default+tuning=false PEER_GRAPHS=peer:compile_mode=reduce-overhead+tuning=false
  READY='{"compile_denoiser": true, "compile_vae": true, "compile_dynamic": false, "compile_mode": "reduce-overhead"}'
  [ -d "$carry" ] && { tar xJf "$carry/farmsite.tar.xz" -C /tmp || exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:/tmp/farmsite:$root
  nvidia-smi
fi
"$PY" - > "$W/versions.txt" <<'PY'
import importlib.metadata as md, os, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu")
for name in ("triton", "diffusers", "transformers", "torchao"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} missing")
print("load average", os.getloadavg())
PY
cat "$W/versions.txt"

pack() { "$PY" deploy/gpu/results.py pack "$W" "$results" "$return_mib" "$return_files"; }
part() {  # part NAME BUDGET ARGS...: one bench invocation inside its budget and what is left of the run's
  local name=$1 want=$2; shift 2
  local json="$name.json" left=$((budget - ($(date +%s) - start) - 10)) t0 rc b
  b=$want
  [ "$b" -lt "$left" ] || b=$left
  t0=$(date +%s)
  if [ -n "$parts" ] && [[ ",$parts," != *",$name,"* ]]; then
    echo "=== skipped (not in --parts): $name"; rc=-1
  elif [ "$left" -lt 30 ]; then
    echo "=== skipped (budget: ${left} s left, this part's is $want s): $name"; rc=-1
  else
    echo "=== $(date +%T) $name: budget $b s of its $want (${left} s left)"
    TORCH_LOGS=recompiles TORCH_LOGS_OUT="$W/$name.recompiles.log" timeout --signal=INT --kill-after=15 "$b" \
      "$PY" -m bench.cli "$@" --json "$W/$json"
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  fi
  "$PY" deploy/gpu/results.py record "$W" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$want" "$json" >/dev/null
  pack
}

pipe=(pipeline --device "$DEV" --repeats "${N}" $NOGEMM --sequential --batch-sizes)
flux=(--model "$FLUX" --width "$L" --height "$L" --steps "$FSTEPS" --guidance-scale 0)
sd15=(--model "$SD15" --width "$S" --height "$S" --steps "$STEPS" --guidance-scale 7.5)
part flux-a "${FLUX_A_S:-150}" "${pipe[@]}" 1 "${flux[@]}" --recipes "reference,reference:fp8=true,exact:$FARM"
part flux-fast "${FLUX_FAST_S:-130}" "${pipe[@]}" 1 "${flux[@]}" \
  --recipes "reference,fast:$FARM+compile_gemm_autotune=false"
part wan-video "${WAN_VIDEO_S:-150}" pipeline --video --model "$WAN" --device "$DEV" --width "$VW" --height "$VH" \
  --frames "$VF" --steps "$VSTEPS" --guidance-scale 5 --repeats 2 --video-overrides '{"compile_regional": false}'
part sd15-pool "${SD15_POOL_S:-200}" "${pipe[@]}" pool "${sd15[@]}" --recipes "exact:$FARM,reference,fast:$FARM"
part sdxl-pool "${SDXL_POOL_S:-220}" "${pipe[@]}" pool --model "$SDXL" --width "$L" --height "$L" --steps "$STEPS" \
  --guidance-scale 7.5 --recipes "exact:$FARM,reference"
part sd15-like "${SD15_LIKE_S:-330}" "${pipe[@]}" 1 "${sd15[@]}" \
  --recipes "reference,$PEER_PLAIN,$PEER_GRAPHS,exact:$FARM,exact:${FARM/reduce-overhead/default}"
part sd15-cudnn "${SD15_CUDNN_S:-110}" "${pipe[@]}" pool "${sd15[@]}" --recipes "exact:$FARM+sdpa=$SDPA"
ready_s=${READY_S:-480}  # a phase may take three quarters of it: the cold one compiles every bucket
part ready "$ready_s" ready --model "$SD15" --device "$DEV" --recipe exact --buckets "$BUCKETS" --sizes "${S}x${S}" \
  --steps "$RSTEPS" --guidance-scale 7.5 --overrides "$READY" --timeout $((ready_s * 3 / 4)) --artifact-dir "$W/artifacts"

"$PY" deploy/gpu/results.py summary "$W"
pack
echo "results: $results (results.tgz, run.log); $(( $(date +%s) - start )) s in all"
