"""The base install is the client: the project's wheel, installed with pip into a fresh virtual
environment without any extra, has no torch (nor Redis, Celery, FastAPI), and its ``renderfarm``
submits to the session farm, waits and downloads; the commands of the extras say which extra
they need. pip installs the base dependencies from its index (or its cache); the size and time
of that install are written to ``test-artifacts/base-install.json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "test-artifacts" / "base-install.json"


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=900, **kwargs)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory) -> Path:
    """A fresh venv with the base wheel (and only its dependencies) installed."""
    root = tmp_path_factory.mktemp("base-install")
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
                  str(REPO)])
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = (root / "dist").glob("renderfarm-*.whl")
    venv = root / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    empty = _size(venv)
    started = time.perf_counter()
    installed = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", str(wheel)])
    seconds = time.perf_counter() - started
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    freeze = _run([str(venv / "bin" / "python"), "-m", "pip", "freeze"]).stdout.split()
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    ARTIFACT.write_text(json.dumps({"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size,
                                    "install_seconds": round(seconds, 1), "installed_bytes": _size(venv) - empty,
                                    "packages": freeze}, indent=1))
    return venv


def _client_env(farm_env: dict[str, str]) -> dict[str, str]:
    """A shell with only what a client needs: the API URL (no S3 keys, no Redis URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RENDERFARM_", "AWS_"))}
    return {**env, "RENDERFARM_API_URL": farm_env["RENDERFARM_API_URL"], "RENDERFARM_ENV_FILE": ""}


def test_no_torch_nor_the_farms_server_side(base_venv):
    for module in ("torch", "diffusers", "redis", "celery", "fastapi", "boto3"):
        out = _run([str(base_venv / "bin" / "python"), "-c", f"import {module}"])
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, module
    frozen = {line.split("==")[0].lower() for line in json.loads(ARTIFACT.read_text())["packages"]}
    assert {"httpx", "pydantic", "pydantic-settings", "tqdm", "rich", "renderfarm"} <= frozen
    assert not frozen & {"torch", "diffusers", "transformers", "celery", "redis", "fastapi", "boto3", "numpy"}


def test_the_base_cli_submits_waits_and_downloads(base_venv, farm_env, api_server, workers, tmp_path):
    cli = str(base_venv / "bin" / "renderfarm")
    env = _client_env(farm_env)
    submitted = _run([cli, "submit", "--prompt", "a lighthouse", "--prompt", "a harbour", "--model", "tiny",
                      "--width", "64", "--height", "64", "--steps", "2", "--wait", "--timeout", "600"], env=env)
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    assert "2/2 succeeded" in submitted.stderr
    batch_id = submitted.stdout.split()[0]
    downloaded = _run([cli, "download", batch_id, "--dir", str(tmp_path / "out")], env=env)
    assert downloaded.returncode == 0, downloaded.stderr[-2000:]
    files = sorted((tmp_path / "out").glob("*.png"))
    assert len(files) == 2 and all(f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in files)


def test_the_extras_commands_say_what_to_install(base_venv):
    cli = str(base_venv / "bin" / "renderfarm")
    helped = _run([cli, "--help"])
    assert helped.returncode == 0 and "not installed here:" in helped.stdout and "renderfarm[api]" in helped.stdout
    for argv, extra in ((["api"], "api"), (["keys", "list"], "api"), (["worker", "--model", "tiny"], "worker"),
                        (["up"], "worker"), (["bench", "farm", "--model", "null"], "worker")):
        out = _run([cli, *argv], env={**os.environ, "RENDERFARM_ENV_FILE": ""})
        assert out.returncode == 2 and f"needs the [{extra}] extra" in out.stderr, (argv, out.stderr[-1000:])
