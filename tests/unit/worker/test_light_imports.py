"""What a worker imports before it loads a model: a worker of the ``null`` model (the farm's tests,
load tests) never needs torch or diffusers, so ``worker.main`` and the batching it uses
(:func:`pipeline.compat.compat_key`, :mod:`pipeline.memory`) must not import them.

Place in the data flow: queue → **worker** → pipeline. Each case runs in a fresh interpreter,
where ``sys.modules`` shows what was imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _imports(statement: str) -> set[str]:
    probe = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("statement", [
    "import worker.main",
    "from pipeline import compat_key",
    "from pipeline.memory import BatchLimits, current_bytes, is_oom_error; current_bytes('cpu'); "
    "is_oom_error(MemoryError())",
])  # fmt: skip
def test_the_worker_and_its_batching_import_neither_torch_nor_diffusers(statement):
    heavy = _imports(statement) & {"torch", "diffusers", "transformers"}
    assert not heavy, sorted(heavy)


def test_is_oom_error_still_knows_torchs_allocator_errors():
    import torch

    from pipeline.memory import is_oom_error

    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_oom_error(MemoryError())
    assert is_oom_error(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"))
    assert not is_oom_error(ValueError("bad size"))
