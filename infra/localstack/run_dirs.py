"""Run directories of the local stack: one per stack for its logs and data, the oldest pruned.

Place in the data flow: beside it. :class:`infra.localstack.LocalStack` (``renderfarm up``,
the demo, the benchmarks) puts each child's log and the data of redis-server and SeaweedFS in
a fresh ``<base>/<YYYYmmdd-HHMMSS>-<pid>`` directory; the run dirs of stacks that are gone are
removed beyond the newest few.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

_RUN_DIR_RE = re.compile(r"^\d{8}-\d{6}-(\d+)$")


def new_run_dir(base: Path | str | None = None, *, keep: int = 5) -> Path:
    """A fresh directory for one stack's logs and data: ``<base>/<YYYYmmdd-HHMMSS>-<pid>``.

    ``base`` defaults to ``$RENDERFARM_CACHE_DIR/run``; when that cannot be created, a new temp
    directory is used. Older run dirs under ``base`` beyond the newest ``keep`` are removed,
    except those whose creating process is still alive.
    """
    if base is None:
        from infra.settings import Settings

        base = Settings().cache_dir / "run"
    base = Path(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
        path.mkdir(exist_ok=True)
    except OSError:
        return Path(tempfile.mkdtemp(prefix="renderfarm-run-"))
    _prune_run_dirs(base, keep=keep, current=path)
    return path


def _prune_run_dirs(base: Path, *, keep: int, current: Path) -> None:
    dirs = sorted((p for p in base.iterdir() if p.is_dir() and _RUN_DIR_RE.match(p.name)), reverse=True)
    for old in dirs[keep:]:
        match = _RUN_DIR_RE.match(old.name)
        assert match is not None  # dirs holds only matching names
        pid = int(match.group(1))
        if old != current and not _pid_alive(pid):
            shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
