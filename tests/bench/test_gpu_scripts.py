"""deploy/gpu: the wheel list for the GPU machine, the staged bench command and the one prepared
session command. Nothing is downloaded: fetch-wheels.sh is checked through its --dry-run listing,
every invocation bench-gpu.sh would run is parsed by the real bench argument parser and spec
parser, and session.sh runs whole on this CPU (--dry-run: the same parts with the tiny models)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from pipeline.bench.specs import parse_specs
from producer.bench_cli import build_parser

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
FETCH, BENCH = ROOT / "deploy/gpu/fetch-wheels.sh", ROOT / "deploy/gpu/bench-gpu.sh"
SESSION = ROOT / "deploy/gpu/session.sh"
#: session.sh's parts, in priority order
PARTS = ["sd15-b1", "sd15-b8", "ready", "flux-reference", "flux-fast", "flux-exact"]
STAGES = ("smoke", "sd15", "sd15-pool", "sdturbo", "sdxl", "flux", "ernie", "profile-sd15", "profile-sdxl",
          "profile-flux")


def _run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


@pytest.mark.parametrize("script", [FETCH, BENCH, SESSION])
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
        assert words[:3] == ["python3", "-m", "producer.bench_cli"]
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
        "python3 -m producer.bench_cli pipeline --model tiny --json /tmp/bench-results/a.json",
        "python3 -m producer.bench_cli profile --model tiny"]
    assert _run(BENCH, "--dry-run", "warp").returncode == 2


def _session(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, results = tmp_path / "out", tmp_path / "results"
    full = {**os.environ, "OUT": str(out), "BENCH_RESULTS": str(results), "PYTHON": sys.executable,
            "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), **env}
    done = subprocess.run(["bash", str(SESSION), "--dry-run"], capture_output=True, text=True, cwd=ROOT, env=full,
                          timeout=1800)
    return done, out, results


def _has_ready_command() -> bool:
    """Whether this build has ``bench ready`` (the worker's time to ready, cold and cached)."""
    try:
        build_parser().parse_args(["ready", "--help"])
    except SystemExit as stop:
        return stop.code == 0
    return True


def test_session_dry_run_runs_every_part_in_order_and_packs_each_json(tmp_path):
    # the GPU budgets are for an H100; a loaded 2-core CPU loads even the tiny models slower (about
    # 3 minutes in all at load average 2, over 10 at 12)
    budgets = {"SD15_B1_S": "400", "SD15_B8_S": "400", "READY_S": "500", "FLUX_S": "300"}
    done, out, results = _session(tmp_path, SESSION_DEADLINE_S="1700", **budgets)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((results / "parts.json").read_text())
    assert [p["part"] for p in parts] == PARTS
    by_name = {p["part"]: p for p in parts}
    for name in ("sd15-b1", "sd15-b8", "flux-reference", "flux-fast", "flux-exact"):
        assert by_name[name]["status"] == "ok", by_name[name]
    # bench ready's own results are tested with it (tests/bench, tests/integration); here: the part runs
    # inside its budget, and whatever it ends with, the parts after it still run
    assert by_name["ready"]["status"] in ("ok", "failed") and by_name["ready"]["exit"] != -1
    if not _has_ready_command():
        assert by_name["ready"]["status"] == "failed"
    if by_name["ready"]["status"] == "ok":  # the cached phase compiled nothing and left nothing running
        cached = json.loads((results / "ready.json").read_text())["cached"]
        assert cached["compile_cache"]["outcome"] == "hit", cached["compile_cache"]
        assert cached["compile_cache"]["compiler_warm_up"] in ("stopped", "finished"), cached["compile_cache"]
        assert cached["quiet_s"] is not None and cached["quiet_s"] >= cached["ready_s"], cached
    b1 = json.loads((results / "sd15-b1.json").read_text())
    assert [(r["kind"], r["batch_size"]) for r in b1["rows"]] == [("reference", 1), ("peer", 1), ("farm", 1)]
    farm = parse_specs([b1["rows"][2]["recipe"]])[0]
    assert farm.options["compile_dynamic"] is False and farm.options["compile_mode"] == "reduce-overhead"
    b8 = json.loads((results / "sd15-b8.json").read_text())
    assert {r["batch_size"] for r in b8["rows"]} == {8}
    with tarfile.open(out / "results.tgz") as tgz:
        packed = {Path(n).name for n in tgz.getnames()}
    assert {"parts.json", "versions.txt", "sd15-b1.json", "sd15-b8.json", "flux-exact.json"} <= packed
    assert by_name["ready"]["status"] != "ok" or "ready.json" in packed
    returned = [p for p in out.rglob("*") if p.is_file()]
    assert len(returned) <= 8  # what a device call brings back
    assert "torch" in (results / "versions.txt").read_text() and "## flux-exact: ok" in done.stdout


def test_session_cut_off_by_its_budgets_still_returns_what_it_recorded(tmp_path):
    # 3 s cannot import torch and diffusers, load a pipeline and render: every part is cut off, or
    # skipped once less than 20 s of the deadline is left
    # (SESSION_PARTS: a second call runs only the parts the first left; the others are skipped at once)
    budgets = {"SD15_B1_S": "3", "SD15_B8_S": "3", "READY_S": "3", "FLUX_S": "3"}
    done, out, results = _session(tmp_path, SESSION_DEADLINE_S="45", SESSION_PARTS="sd15-b1,flux-fast", **budgets)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = json.loads((results / "parts.json").read_text())
    assert [p["part"] for p in parts] == PARTS
    assert parts[0]["status"] == "budget ran out" and parts[0]["json"] is None
    not_named = [p for p in parts if p["part"] not in ("sd15-b1", "flux-fast")]
    assert all(p["status"] == "skipped" and p["seconds"] <= 1 for p in not_named), parts
    assert done.stdout.count("skipped (not in SESSION_PARTS)") == len(not_named)
    assert all(p["status"] in ("budget ran out", "skipped", "failed") and p["json"] is None for p in parts[1:])
    with tarfile.open(out / "results.tgz") as tgz:
        assert "parts.json" in {Path(n).name for n in tgz.getnames()}
