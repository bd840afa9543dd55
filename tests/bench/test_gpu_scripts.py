"""deploy/gpu: the wheel list for the GPU machine, the staged bench command and the one prepared
measurement command. Nothing is downloaded: fetch-wheels.sh is checked through its --dry-run
listing, every invocation bench-gpu.sh would run is parsed by the real bench argument parser and
spec parser, and measure.sh runs whole on this CPU (--dry-run: the same parts with the tiny
models), its `ready` part being the end-to-end test of `bench ready` (cold, then cached)."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.cli import build_parser
from bench.pipeline.specs import parse_specs
from bench.pipeline.time_to_ready import served

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
FETCH, BENCH = ROOT / "deploy/gpu/fetch-wheels.sh", ROOT / "deploy/gpu/bench-gpu.sh"
MEASURE, FARM = ROOT / "deploy/gpu/measure.sh", ROOT / "deploy/gpu/farm-gpu.sh"
#: measure.sh's parts, in priority order
PARTS = ["flux-a", "flux-fast", "wan-video", "sd15-pool", "sdxl-pool", "sd15-like", "sd15-cudnn", "ready"]
STAGES = ("smoke", "sd15", "sd15-pool", "sdturbo", "sdxl", "flux", "ernie", "profile-sd15", "profile-sdxl",
          "profile-flux")


def _run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


@pytest.mark.parametrize("script", [FETCH, BENCH, MEASURE, FARM])
def test_scripts_parse(script):
    assert _run("-n", script).returncode == 0


def test_fetch_wheels_lists_one_pinned_version_of_each_and_matches_the_tested_versions():
    listing = _run(FETCH, "--dry-run")
    assert listing.returncode == 0, listing.stderr
    pins = [line.strip() for line in listing.stdout.splitlines() if "==" in line and "command" not in line]
    names = [p.split("==")[0].lower() for p in pins]
    assert len(names) == len(set(names))  # one version of each: two stop the install on the GPU
    needed = {"diffusers", "transformers", "sdnq", "torchao", "pydantic", "pydantic-core", "pydantic-settings",
              "annotated-types", "typing-inspection", "python-dotenv", "open-clip-torch"}
    assert needed <= set(names)
    versions = dict(p.split("==") for p in pins)
    for package in ("diffusers", "transformers"):  # the GPU run uses what the tests here run with
        assert versions[package] == md.version(package)
    assert "--no-deps" in listing.stdout and "--python-version 3.12" in listing.stdout


@pytest.mark.parametrize("compile_mode", [None, "max-autotune-no-cudagraphs"])
def test_every_staged_invocation_is_a_valid_bench_command(compile_mode):
    import os

    env = {k: v for k, v in os.environ.items() if k != "COMPILE_MODE"}
    if compile_mode:
        env["COMPILE_MODE"] = compile_mode
    listing = _run(BENCH, "--dry-run", *STAGES, env=env)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert len(lines) >= len(STAGES)
    parser = build_parser()
    for line in lines:
        words = shlex.split(line)
        assert words[:3] == ["python3", "-m", "bench.cli"]
        args = parser.parse_args(words[3:])
        assert args.device == "cuda" and args.json.startswith("/tmp/bench-results/")
        specs = parse_specs(args.recipes if args.bench == "pipeline" else [args.recipe])
        if compile_mode and "smoke" not in args.json:  # every compiled row of a full stage takes the mode
            assert all(s.options.get("compile_mode") == compile_mode for s in specs
                       if s.kind in ("peer", "farm"))


def test_custom_invocations_and_unknown_stages():
    import os

    env = {**os.environ, "BENCH_CMDS": "pipeline --model tiny --json @/a.json; profile --model tiny"}
    listing = _run(BENCH, "--dry-run", "custom", env=env)
    assert listing.stdout.splitlines() == [
        "python3 -m bench.cli pipeline --model tiny --json /tmp/bench-results/a.json",
        "python3 -m bench.cli profile --model tiny"]
    assert _run(BENCH, "--dry-run", "warp").returncode == 2



def _measure(tmp_path: Path, *args: str, cache: Path | None = None, **env: str):
    """Run ``measure.sh --dry-run`` into ``tmp_path/results``; returns (process, results folder, the
    archive's members by name, parts.json)."""
    results = tmp_path / "results"
    full = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), **env}
    if cache is not None:
        full["RENDERFARM_CACHE_DIR"] = str(cache)
    done = subprocess.run(["bash", str(MEASURE), "--dry-run", "--results", str(results), *args],
                          capture_output=True, text=True, cwd=ROOT, env=full, timeout=1800)
    members: dict[str, bytes] = {}
    if (results / "results.tgz").exists():
        with tarfile.open(results / "results.tgz") as tgz:
            for m in tgz.getmembers():
                if m.isfile():
                    members[m.name] = tgz.extractfile(m).read()  # type: ignore[union-attr]
    parts = json.loads(members["parts.json"]) if "parts.json" in members else []
    return done, results, members, parts


def _rows(members: dict[str, bytes], part: str) -> dict[str, dict]:
    result = json.loads(members[f"{part}.json"])
    assert result["complete"] is True and result["config"]["method"] == {
        "cold_calls": 1, "settle_calls": 1, "timed_rounds": 1}
    for text, report in result["reports"].items():  # what ran, read back from the objects
        observed = report["observed"]
        assert observed["scheduler"] and "max_autotune_gemm_backends" in observed["inductor"], text
        assert observed["cuda_graphs"] is None  # a CUDA fact: null on the CPU
    return {r["recipe"]: r for r in result["rows"]}


def _check_ready(members: dict[str, bytes]) -> None:
    """`bench ready` end to end: the cold phase compiled and saved the artifact, the cached phase
    loaded it and compiled nothing; the artifact came back with its checksum."""
    ready = json.loads(members["ready.json"])
    cold, cached = ready["cold"], ready["cached"]
    assert cold["compile_cache"]["outcome"] == "miss" and cold["counters"]["fxgraph_cache_miss"] >= 1, cold
    assert cached["compile_cache"]["outcome"] == "hit", cached["compile_cache"]
    # TorchDynamo traces again (the artifact holds Inductor's output), Inductor compiles nothing
    assert cached["counters"]["fxgraph_cache_miss"] == 0 and served(cached["counters"]) >= 1, cached
    assert cached["compile_cache"]["compiler_warm_up"] in ("stopped", "finished"), cached["compile_cache"]
    assert cached["quiet_s"] is not None and cached["quiet_s"] >= cached["ready_s"], cached
    artifact = members[f"artifacts/{ready['artifact_kept']}"]
    assert hashlib.sha256(artifact).hexdigest() == ready["artifact_sha256"] and len(artifact) == ready["artifact_bytes"]
    listed = json.loads(members["artifacts.json"])
    assert listed == [{"name": ready["artifact_kept"], "bytes": len(artifact), "sha256": ready["artifact_sha256"],
                       "in_archive": True}]


def test_measure_dry_run_runs_every_part_in_order_and_returns_each_json(tmp_path, bench_cache):
    budgets = {"FLUX_A_S": "400", "FLUX_FAST_S": "400", "WAN_VIDEO_S": "400", "SD15_POOL_S": "400",
               "SDXL_POOL_S": "400", "SD15_LIKE_S": "400", "SD15_CUDNN_S": "400", "READY_S": "600"}
    done, results, members, parts = _measure(tmp_path, "--budget", "3000", cache=bench_cache, **budgets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print("\n".join(f"dry run part {p['part']}: {p['status']}, {p['seconds']} s" for p in parts))
    assert [p["part"] for p in parts] == PARTS
    assert all(p["status"] == "ok" for p in parts), parts  # `ready` too: the CPU runs it whole
    flux = _rows(members, "flux-a")
    assert list(flux) == ["reference", "reference:fp8=true", next(r for r in flux if r.startswith("exact:"))]
    fp8 = json.loads(members["flux-a.json"])["reports"]["reference:fp8=true"]
    assert "compute capability" in fp8["skipped"]["fp8"]  # the CPU has no FP8 tensor cores: said, not hidden
    fast = _rows(members, "flux-fast")
    spec = next(r for r in fast if r.startswith("fast:"))
    assert json.loads(members["flux-fast.json"])["reports"][spec]["recipe"]["compile_gemm_autotune"] is False
    wan = json.loads(members["wan-video.json"])  # bench pipeline --video: its three rows, the knobs each toggles
    assert [r["row"] for r in wan["rows"]] == ["baseline", "vae_tiling", "step_cache"] and wan["rows"][0]["ratio"] == 1
    pool = json.loads(members["sd15-pool.json"])
    assert pool["config"]["resolved_batch_sizes"] == [pool["config"]["pool_batch_size"]] and \
        pool["config"]["pool_batch_size"] >= 1
    like = _rows(members, "sd15-like")
    modes = sorted(parse_specs([r])[0].options.get("compile_mode") for r in like if not r.startswith("reference"))
    assert modes == ["default", "default", "reduce-overhead", "reduce-overhead"]  # graphs off and on, each side
    assert all(r["status"] == "ok" and r["settle_s"] is not None and r["timed_rounds"] == 1 for r in like.values())
    _check_ready(members)
    assert {"parts.json", "versions.txt", *(f"{p}.json" for p in PARTS), *(f"{p}.recompiles.log" for p in PARTS)} \
        <= set(members)
    returned = sorted(p.name for p in results.iterdir())
    assert len(returned) <= 8 and {"results.tgz", "run.log", "parts.json"} <= set(returned), returned
    assert "torch" in members["versions.txt"].decode() and "## ready: ok" in done.stdout


def test_measure_cut_off_by_its_budgets_still_returns_what_it_recorded(tmp_path):
    # 3 s cannot import torch and diffusers, load a pipeline and render: the parts named are cut off
    # by their budget; the others are skipped at once (--parts), and what is left is recorded
    budgets = {k: "3" for k in ("FLUX_A_S", "FLUX_FAST_S", "WAN_VIDEO_S", "SD15_POOL_S", "SDXL_POOL_S", "SD15_LIKE_S",
                                "SD15_CUDNN_S", "READY_S")}
    done, results, members, parts = _measure(tmp_path, "--budget", "60", "--parts", "flux-a,sd15-pool", **budgets)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [p["part"] for p in parts] == PARTS
    assert parts[0]["status"] == "budget ran out" and parts[0]["json"] is None and parts[0]["budget_s"] == 3
    not_named = [p for p in parts if p["part"] not in ("flux-a", "sd15-pool")]
    assert all(p["status"] == "skipped" and p["seconds"] <= 1 for p in not_named), parts
    assert done.stdout.count("skipped (not in --parts)") == len(not_named)
    assert {"results.tgz", "run.log", "parts.json"} <= {p.name for p in results.iterdir()}


def test_measure_refuses_unknown_options(tmp_path):
    done = subprocess.run(["bash", str(MEASURE), "--dry-run", "--budget", "ten"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 2 and "whole numbers" in done.stderr
    assert subprocess.run(["bash", str(MEASURE), "--warp"], capture_output=True, text=True, cwd=ROOT,
                          timeout=60).returncode == 2
