"""The child process that readies Inductor's C++ toolchain (pipeline.optimize.compile.start_compiler_warm_up).

Every step runs in its own Python process on one fresh Inductor cache directory and one fresh
``TMPDIR``, as on a new replica, with ``g++`` behind a wrapper that logs each invocation.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long,
              pytest.mark.skipif(not shutil.which("g++") or platform.machine() not in ("x86_64", "AMD64"),
                                 reason="Inductor's CPU toolchain checks run on x86 with g++")]

WARM_UP = "from pipeline.optimize.compile import start_compiler_warm_up\nassert start_compiler_warm_up().wait() == 0\n"
# Another kernel than the child's: a worker's first compile after the child finished.
FIRST_COMPILE = "import torch\ntorch.compile(lambda x: torch.sin(x) * 3.0, dynamic=False)(torch.ones(64))\n"


def _box(root: Path) -> tuple[dict, Path]:
    """(environment, g++ log) under ``root``: fresh cache and temporary directories, g++ logged."""
    bin_dir, log = root / "bin", root / "gxx.log"
    bin_dir.mkdir()
    wrapper = bin_dir / "g++"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("g++")} "$@"\n')
    wrapper.chmod(0o755)
    return _fresh({**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, root, "box"), log


@pytest.fixture
def box(tmp_path):
    return _box(tmp_path)


def _fresh(env: dict, tmp_path: Path, name: str) -> dict:
    """``env`` with an empty Inductor cache directory and ``TMPDIR`` of its own, under ``tmp_path/name``."""
    (tmp_path / name / "tmp").mkdir(parents=True)
    return {**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / name / "inductor"), "TMPDIR": str(tmp_path / name / "tmp")}


def _run(code: str, env: dict, *args: str) -> None:
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def _header_builds(log: Path) -> int:
    return sum("c++-header" in line for line in log.read_text().splitlines()) if log.exists() else 0


def test_after_the_warm_up_the_first_compile_builds_no_precompiled_header(box):
    env, log = box
    _run(WARM_UP, env)
    assert _header_builds(log) == 1  # the child built the header
    log.unlink()
    _run(FIRST_COMPILE, env)
    assert _header_builds(log) == 0


def test_without_the_warm_up_the_first_compile_builds_the_header(exported):
    # The control: on a fresh temporary directory the first compile pays the header itself (the
    # compile whose kernels the restore tests below export, run once for both).
    _, header_builds = exported
    assert header_builds == 1


# Stopped while it builds the header (a compile-cache hit): the child's g++ is stopped with it, and no
# half-written header is left. Inductor builds a header only when its file is missing and trusts one
# that exists, so with none left the next compile builds it whole, as on a fresh TMPDIR (the control
# test above).
STOP = (
    "import pathlib, sys, time\n"
    "from infra.localstack.processes import group_members\n"
    "from pipeline.optimize.compile import start_compiler_warm_up, stop_compiler_warm_up\n"
    "log = pathlib.Path(sys.argv[1])\n"
    "child = start_compiler_warm_up()\n"
    "deadline = time.monotonic() + 300\n"
    "while not (log.exists() and 'c++-header' in log.read_text()):\n"
    "    assert child.poll() is None and time.monotonic() < deadline, 'no header build seen'\n"
    "    time.sleep(0.05)\n"
    "time.sleep(0.5)  # inside the header's g++ call (seconds long)\n"
    "assert stop_compiler_warm_up(child) == 'stopped'\n"
    "assert child.wait(timeout=30) != 0\n"
    "deadline = time.monotonic() + 30\n"
    "while group_members(child.pid):  # every process of the child's group (its g++, cc1plus) exits\n"
    "    assert time.monotonic() < deadline, 'the g++ of the stopped child still runs'\n"
    "    time.sleep(0.1)\n"
    "assert stop_compiler_warm_up(child) == 'finished'\n"
)


def test_a_stopped_warm_up_leaves_no_partial_header(box):
    env, log = box
    _run(STOP, env, str(log))
    assert _header_builds(log) == 1
    assert not list(Path(env["TMPDIR"]).rglob("*.gch")), "a header the stopped g++ had not finished"


# A restored compile cache: one process compiles and exports its artifacts (pipeline.compile_cache),
# a new one (fresh cache and temporary directories, as a new replica) imports them and runs the same
# function; its kernels load from the restored binaries.
KEY = "from pipeline.compile_cache import CacheKey\nkey = CacheKey({'model': 'header-test'})\n"
EXPORT = (KEY + "import pathlib, sys, torch\nfrom pipeline.compile_cache import export_artifacts\n" + FIRST_COMPILE
          + "pathlib.Path(sys.argv[1]).write_bytes(export_artifacts(key))\n")
RESTORE = (KEY + "import pathlib, sys, contextlib, torch\n"
           "from pipeline.compile_cache import compile_counters, import_artifacts\n"
           "from pipeline.optimize.compile import without_precompiled_headers\n"
           "assert import_artifacts(pathlib.Path(sys.argv[1]).read_bytes(), key).outcome == 'hit'\n"
           "with without_precompiled_headers() if sys.argv[2] == 'skip' else contextlib.nullcontext():\n"
           "    y = torch.compile(lambda x: torch.sin(x) * 3.0, dynamic=False)(torch.ones(64))\n"
           "assert torch.equal(y, torch.sin(torch.ones(64)) * 3.0)\n"
           "c = compile_counters()\nassert c['fxgraph_cache_hit'] == 1 and c['fxgraph_cache_miss'] == 0, c\n")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, int]:
    """FIRST_COMPILE on fresh cache and temporary directories, its artifacts exported: (the
    artifact's path, the precompiled-header builds its g++ log shows)."""
    root = tmp_path_factory.mktemp("exported")
    env, log = _box(root)
    blob = root / "artifact.bin"
    _run(EXPORT, env, str(blob))
    return blob, _header_builds(log)


def test_a_restored_cache_loads_its_kernels_without_building_the_header(box, tmp_path, exported):
    env, log = box
    blob, _ = exported
    _run(RESTORE, _fresh(env, tmp_path, "skip"), str(blob), "skip")
    assert _header_builds(log) == 0
    # the control: the same restore without the context builds the header nothing then uses
    _run(RESTORE, _fresh(env, tmp_path, "control"), str(blob), "control")
    assert _header_builds(log) == 1
