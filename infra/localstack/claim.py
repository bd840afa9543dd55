"""One ``renderfarm up`` per data directory, and the processes an earlier one left behind.

Place in the data flow: beside it. :class:`infra.localstack.stack.LocalStack` keeps the pids of
its children in ``<data dir>/up.json`` while it runs. A new stack on the same data directory
reads it first: if the ``up`` that wrote it still runs, the new one refuses to start (two
redis-servers on one AOF would corrupt it); if that ``up`` died (``kill -9``: its children got
SIGTERM through ``PR_SET_PDEATHSIG`` and may still be shutting down), it waits until they are
gone, and SIGKILLs the process groups of those that outlast ``wait_s``, so that redis-server
has closed its AOF and SeaweedFS its volumes before they start again on the same files.

A process is recognized by its pid and its start time (field 22 of ``/proc/<pid>/stat``,
proc(5)), so a pid reused by another program is never signalled. Linux only; elsewhere nothing
is recorded or awaited.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from infra.localstack.processes import ManagedProcess, group_members

FILE_NAME = "up.json"


class DataDirBusy(RuntimeError):
    """Another ``renderfarm up`` that is still running uses this data directory."""


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (proc(5) ``stat`` field 22), or None
    when no such process is alive."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _same(entry: dict) -> bool:
    """Whether the process recorded in ``entry`` (``pid``, ``start``) is still alive."""
    return entry.get("start") is not None and _start_time(int(entry["pid"])) == entry["start"]


def record(data_dir: Path, processes: Sequence[ManagedProcess]) -> None:
    """Write ``<data_dir>/up.json``: this process and its running ``processes`` (name, pid,
    start time), atomically. Call it after each start or restart of a child."""
    if not Path("/proc").is_dir():
        return
    children = [{"name": p.name, "pid": p.pid, "start": _start_time(p.pid)} for p in processes
                if p.pid is not None and p.running]
    body = {"pid": os.getpid(), "start": _start_time(os.getpid()), "children": children}
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{FILE_NAME}.{os.getpid()}"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, data_dir / FILE_NAME)


def release(data_dir: Path) -> None:
    """Remove ``<data_dir>/up.json`` if this process wrote it."""
    path = data_dir / FILE_NAME
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def claim(data_dir: Path, *, wait_s: float = 10.0, say: Callable[[str], None] = print) -> list[str]:
    """Make sure no earlier ``up`` or its children still use ``data_dir``; returns the names of
    the leftover children that were waited for (empty when there were none).

    Raises:
        DataDirBusy: the ``up`` that recorded the file is still running (not this process).
    """
    path = data_dir / FILE_NAME
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    owner = int(body.get("pid", 0))
    if owner != os.getpid() and _same(body):
        raise DataDirBusy(f"another renderfarm up (pid {owner}) uses the data directory {data_dir}; stop it first, "
                          "or choose another with --data-dir")
    left = [c for c in body.get("children", []) if _same(c)]
    if left:
        say(f"waiting for {', '.join(c['name'] for c in left)} of an earlier renderfarm up (pid {owner}) "
            f"on {data_dir} to exit …")
        for child in left:  # PR_SET_PDEATHSIG sent SIGTERM already; send it again to the whole group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(child["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while any(_alive_group(c) for c in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline += 10.0
        for child in left:
            while _alive_group(child) and time.monotonic() < deadline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(int(child["pid"]), signal.SIGKILL)
                time.sleep(0.05)
    with contextlib.suppress(OSError):
        path.unlink()
    return [c["name"] for c in left]


def _alive_group(entry: dict) -> bool:
    return _same(entry) or bool(group_members(int(entry["pid"])))
