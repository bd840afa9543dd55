"""The ``renderfarm`` root (infra/cli.py): which command modules a start-up imports.

Place in the data flow: beside it; every process of the farm (the API, each worker, ``up``) and
every client command starts through this root, so what it imports is paid at each start.
Each case runs the root in a fresh interpreter, where ``sys.modules`` shows what was imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

_PROBE = """
import json, sys
from infra.cli import main
try:
    main(json.loads(sys.argv[1]))
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _root(*argv: str) -> tuple[int, set[str], str]:
    """Run the root with ``argv`` in a fresh interpreter: its exit code, the modules it imported and
    its output before the probe's line."""
    env = {**os.environ, "RENDERFARM_ENV_FILE": "", "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    *output, probe = done.stdout.rstrip("\n").split("\n")
    result = json.loads(probe)
    return result["code"], set(result["modules"]), "\n".join(output) + done.stderr


@pytest.mark.parametrize(("command", "own_module", "others"), [
    ("worker", "worker.cli", ("fastapi", "infra.api.server", "producer.cli", "infra.localstack.cli")),
    ("up", "infra.localstack.cli", ("fastapi", "infra.api.server", "worker.cli")),
])  # fmt: skip
def test_a_command_named_like_its_entry_point_imports_that_module_alone(command, own_module, others):
    code, modules, output = _root(command, "--help")
    assert code == 0, output
    assert f"usage: renderfarm {command}" in output
    assert own_module in modules
    assert not modules & set(others), sorted(modules & set(others))


def test_a_command_of_an_entry_point_named_otherwise_still_runs():
    # `status` is registered by the `client` entry point: the root then loads every command
    code, _, output = _root("status", "--help")
    assert code == 0 and "usage: renderfarm status" in output, output


def test_the_root_help_and_an_unknown_command_list_every_command():
    code, _, output = _root("--help")
    assert code == 0, output
    for command in ("api", "worker", "up", "submit", "status", "wait", "keys", "bench"):
        assert command in output, command
    code, _, output = _root("client")  # an entry point's name that names no command
    assert code == 2 and "invalid choice: 'client'" in output and "'worker'" in output and "'status'" in output, output
