#!/usr/bin/env bash
# One lent GPU session's measurements as ONE prepared command that ends inside 8 minutes.
#
# usage: bash deploy/gpu/session.sh [--dry-run]
#   (device call: carry .whl-farm and .gpu-carry, timeout_s 540; from the repository root)
#   --dry-run  the same parts on this CPU with the tiny models (tiny, tiny-flux), 64², 2 steps,
#              --device cpu, 1 round, compile off in the farm's rows: checks every command line and code
#              path before device time is spent; nothing is measured (tests/bench/test_gpu_scripts.py)
#
# A lent session has 15 minutes of device time in all, machine start included, so everything is
# one call. The parts run in priority order, each under its own budget (`timeout`, capped by what
# is left of the total deadline SESSION_DEADLINE_S, default 475 s); each writes its JSON into the
# results folder the moment it ends and the folder is packed into $OUT/results.tgz after every part,
# so a run cut off anywhere still returns what finished. $OUT gets results.tgz, session.log and
# the JSONs themselves while they fit (a device call returns at most 8 files).
#   0 setup     nvidia-smi, torch/triton/diffusers versions (versions.txt)
#   1 sd15-b1   sd15-arch 512², 20 steps, batch 1: reference, the compiled peer (diffusers'
#               "Accelerate inference" tutorial, mode default and without its coordinate-descent
#               tuning flags: with them even the tiny model took 450 s to compile on the H100), and
#               the farm's `exact` compiled with static shapes and CUDA graphs (mode reduce-overhead)
#     sd15-b8   the same at bucket 8: reference against the farm's compiled `exact`
#   2 ready     the worker's time to ready, cold and then with the compile cache (`bench ready`:
#               each phase a fresh process with an empty Inductor cache; one bucket at 512², the
#               same static CUDA-graph compile, so that the cold compile fits; the dry run
#               compiles the tiny VAE decoder only, unfrozen as on the GPU)
#   3 flux-*    flux-schnell-arch 1024², 4 steps, guidance 0, batch 1, one row per invocation (each
#               its own JSON): reference, the farm's `fast` (its torchao fp8 + compile), `exact`
# Budgets (seconds, env overrides; the H200 run took 200, 104 and 138 s): SD15_B1_S 210, SD15_B8_S 110,
# READY_S 150 (a phase at most 2/3 of it: its cold phase took 93 s), FLUX_S 50 each: the flux parts run only
# on what the others leave.
# SESSION_PARTS=a,b runs only the parts named (a second call on a warm machine: the parts the first left).
# parts.json records each part's exit status, seconds and JSON (124: its budget ran out).
set -uo pipefail
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) sed -n '2,32p' "$0"; exit 2 ;;
esac
OUT=${OUT:-$root/gpu-out}
R=${BENCH_RESULTS:-/tmp/session-results}
mkdir -p "$OUT" "$R"
exec > >(tee -a "$OUT/session.log") 2>&1
start=$(date +%s)
deadline=${SESSION_DEADLINE_S:-475}
export RENDERFARM_CACHE_DIR=${RENDERFARM_CACHE_DIR:-/tmp/renderfarm-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor-cache}
# static shapes per bucket, CUDA graphs (the farm's compiled rows; the peer keeps its own mode)
FARM=compile_dynamic=false+compile_mode=reduce-overhead

if [ "$dry" = 1 ]; then
  DEV=cpu SD15=tiny FLUX=tiny-flux S=64 L=64 STEPS=2 FSTEPS=2 N=1 PY=${PYTHON:-python3}
  FARM=$FARM+compile_denoiser=false+compile_vae=false
  # no Inductor freezing: the GPU run's reduce-overhead compile never freezes, so the dry run takes its path
  READY='{"compile_denoiser": false, "compile_vae": true, "batch_invariant": false, "compile_dynamic": false, "compile_freeze": false}'
else
  DEV=cuda SD15=sd15-arch FLUX=flux-schnell-arch S=512 L=1024 STEPS=20 FSTEPS=4 N= PY=python3
  READY='{"compile_denoiser": true, "compile_vae": true, "compile_dynamic": false, "compile_mode": "reduce-overhead"}'
  tar xJf .gpu-carry/farmsite.tar.xz -C /tmp || exit 1
  mkdir -p /tmp/farmbin
  # the parts below need neither Redis nor S3; the binaries are unpacked when carried (farm-gpu.sh needs them)
  for b in redis-server weed; do
    [ -f ".gpu-carry/$b.xz" ] && { xz -dc ".gpu-carry/$b.xz" > "/tmp/farmbin/$b" && chmod +x "/tmp/farmbin/$b" || exit 1; }
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl-farm/*.whl || exit 1
  export PATH=/tmp/farmbin:$PATH PYTHONPATH=/tmp/site:/tmp/farmsite:$root
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
  nvidia-smi
fi
"$PY" - > "$R/versions.txt" <<'PY'
import importlib.metadata as md, os, platform
import torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu")
for name in ("triton", "diffusers", "transformers", "torchao", "celery", "boto3"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} missing")
print("load average", os.getloadavg())
PY
cat "$R/versions.txt"
echo "[]" > "$R/parts.json"

pack() {
  tar czf "$OUT/results.tgz" -C "$R" . 2>/dev/null
  if [ "$(find "$R" -maxdepth 1 -name '*.json' | wc -l)" -le 5 ]; then cp "$R"/*.json "$OUT"/ 2>/dev/null; fi
}
part() {  # part NAME BUDGET_S JSON ARGS...: one invocation inside its budget and the deadline
  local name=$1 budget=$2 json=$3; shift 3
  local left=$((deadline - ($(date +%s) - start) - 5)) t0 rc
  [ "$budget" -lt "$left" ] || budget=$left
  t0=$(date +%s)
  if [ -n "${SESSION_PARTS:-}" ] && [[ ",$SESSION_PARTS," != *",$name,"* ]]; then
    echo "=== skipped (not in SESSION_PARTS): $name"; rc=-1
  elif [ "$left" -lt 20 ]; then
    echo "=== skipped (deadline): $name"; rc=-1
  else
    echo "=== $(date +%T) $name: budget $budget s (${left} s left)"
    timeout --signal=INT --kill-after=10 "$budget" "$@"
    rc=$?
    echo "=== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  fi
  "$PY" - "$R/parts.json" "$name" "$rc" "$(( $(date +%s) - t0 ))" "$json" <<'PY'
import json, pathlib, sys
path, name, rc, seconds, out = sys.argv[1:]
parts = json.loads(pathlib.Path(path).read_text())
written = pathlib.Path(out).exists()
parts.append({"part": name, "exit": int(rc), "seconds": int(seconds), "json": pathlib.Path(out).name if written else None,
              "status": "ok" if rc == "0" and written else "skipped" if rc == "-1" else
              "budget ran out" if rc in ("124", "137") else "failed"})
pathlib.Path(path).write_text(json.dumps(parts, indent=1))
PY
  pack
}
bench() { local name=$1 budget=$2; shift 2; part "$name" "$budget" "$R/$name.json" "$PY" -m producer.bench_cli "$@" --json "$R/$name.json"; }

sd15=(pipeline --model "$SD15" --device "$DEV" --width "$S" --height "$S" --steps "$STEPS" --no-flops)
bench sd15-b1 "${SD15_B1_S:-210}" "${sd15[@]}" --batch-sizes 1 --repeats "${N:-3}" \
  --recipes "reference,peer:compile_mode=default+tuning=false,exact:$FARM"
bench sd15-b8 "${SD15_B8_S:-110}" "${sd15[@]}" --batch-sizes 8 --repeats "${N:-2}" --recipes "reference,exact:$FARM"
ready_s=${READY_S:-150}
bench ready "$ready_s" ready --model "$SD15" --device "$DEV" --recipe exact --buckets 1 --sizes "${S}x${S}" \
  --steps "$STEPS" --guidance-scale 7.5 --overrides "$READY" --timeout $((ready_s * 2 / 3))
flux=(pipeline --model "$FLUX" --device "$DEV" --width "$L" --height "$L" --steps "$FSTEPS" --guidance-scale 0
      --batch-sizes 1 --repeats "${N:-2}" --no-flops --sequential)
bench flux-reference "${FLUX_S:-50}" "${flux[@]}" --recipes reference
bench flux-fast "${FLUX_S:-50}" "${flux[@]}" --recipes "fast:$FARM"
bench flux-exact "${FLUX_S:-50}" "${flux[@]}" --recipes "exact:$FARM"

"$PY" - "$R" <<'PY'
import json, pathlib, sys
results = pathlib.Path(sys.argv[1])
for p in json.loads((results / "parts.json").read_text()):
    print(f"## {p['part']}: {p['status']} (exit {p['exit']}, {p['seconds']} s)")
    if not p["json"]:
        continue
    r = json.loads((results / p["json"]).read_text())
    for row in r.get("rows", []):
        keys = ("recipe", "batch_size", "load_s", "cold_s", "hot_median_s_per_img", "it_per_s", "images_per_s",
                "peak_allocated_mib", "psnr_db", "speedup", "vs_peer")
        print("  " + " ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None))
    if "rows" not in r:
        print("  " + json.dumps({k: v for k, v in r.items() if not isinstance(v, (dict, list))})[:600])
PY
pack
echo "results: $OUT/results.tgz; log: $OUT/session.log; $(( $(date +%s) - start )) s in all"
