"""deploy/gpu: the wheel list for the GPU machine and the staged bench command. Nothing is
downloaded: fetch-wheels.sh is checked through its --dry-run listing, and every invocation
bench-gpu.sh would run is parsed by the real bench argument parser and spec parser."""

from __future__ import annotations

import importlib.metadata as md
import shlex
import subprocess
from pathlib import Path

import pytest

from pipeline.bench.specs import parse_specs
from producer.bench_cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
FETCH, BENCH = ROOT / "deploy/gpu/fetch-wheels.sh", ROOT / "deploy/gpu/bench-gpu.sh"
STAGES = ("smoke", "sd15", "sd15-pool", "sdturbo", "sdxl", "flux", "ernie", "profile-sd15", "profile-sdxl",
          "profile-flux")


def _run(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


@pytest.mark.parametrize("script", [FETCH, BENCH])
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
