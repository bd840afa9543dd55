"""One ``renderfarm up`` per data directory, and the processes an earlier one left behind.

Place in the data flow: beside it. :class:`infra.localstack.stack.LocalStack` keeps the pids of
its children in ``<data dir>/up.json`` while it runs. A new stack on the same data directory
reads it first: if the ``up`` that wrote it still runs, the new one refuses to start (two
redis-servers on one AOF would corrupt it); if that ``up`` died (``kill -9``), it stops what is
left in order (:func:`drain`): the workers first, which got SIGTERM through
``PR_SET_PDEATHSIG`` and finish their batch into the storage that is still up, then
redis-server and SeaweedFS, which do not die with ``up`` for that reason. Only then do they start
again on the same files. :mod:`infra.localstack.guard` does the same drain when no new ``up``
comes.

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


def start_time(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks after boot (proc(5) ``stat`` field 22), or None
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
    return entry.get("start") is not None and start_time(int(entry["pid"])) == entry["start"]


def record(data_dir: Path, processes: Sequence[ManagedProcess]) -> None:
    """Write ``<data_dir>/up.json``: this process and its running ``processes`` (name, pid,
    start time, and ``last``: true for those that do not die with it, the storage, which must be
    stopped after the others), atomically. Call it after each start or restart of a child."""
    if not Path("/proc").is_dir():
        return
    children = [{"name": p.name, "pid": p.pid, "start": start_time(p.pid), "last": not p.die_with_parent}
                for p in processes if p.pid is not None and p.running]
    body = {"pid": os.getpid(), "start": start_time(os.getpid()), "children": children}
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{FILE_NAME}.{os.getpid()}"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, data_dir / FILE_NAME)


def read(data_dir: Path) -> dict:
    """The body of ``<data_dir>/up.json`` (``pid``, ``start``, ``children``), or {} when there is none."""
    try:
        return dict(json.loads((data_dir / FILE_NAME).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def owner_alive(body: dict) -> bool:
    """Whether the ``up`` that wrote ``body`` (:func:`read`) still runs."""
    return _same(body)


def release(data_dir: Path, pid: int | None = None) -> None:
    """Remove ``<data_dir>/up.json`` if process ``pid`` (default: this one) wrote it."""
    with contextlib.suppress(OSError):
        if read(data_dir).get("pid") == (os.getpid() if pid is None else pid):
            (data_dir / FILE_NAME).unlink()


def claim(data_dir: Path, *, workers_wait_s: float = 90.0, say: Callable[[str], None] = print) -> list[str]:
    """Make sure no earlier ``up`` or its children still use ``data_dir``; returns the names of
    the leftover children that were waited for (empty when there were none).

    Raises:
        DataDirBusy: the ``up`` that recorded the file is still running (not this process).
    """
    body = read(data_dir)
    owner = int(body.get("pid", 0))
    if owner and owner != os.getpid() and owner_alive(body):
        raise DataDirBusy(f"another renderfarm up (pid {owner}) uses the data directory {data_dir}; stop it first, "
                          "or choose another with --data-dir")
    left = [c for c in body.get("children", []) if _alive_group(c)]
    if left:
        say(f"waiting for {', '.join(c['name'] for c in left)} of an earlier renderfarm up (pid {owner}) "
            f"on {data_dir} to stop …")
        drain(body, workers_wait_s=workers_wait_s)
    release(data_dir, owner)
    return [c["name"] for c in left]


def drain(body: dict, *, workers_wait_s: float = 90.0, storage_wait_s: float = 15.0) -> None:
    """Stop the children recorded in ``body`` (:func:`read`) of an ``up`` that is gone, in order:
    first the workers and the API (SIGTERM: a worker finishes its batch, so its renders reach
    Redis and S3 once), waiting up to ``workers_wait_s`` seconds, then the storage
    (redis-server, SeaweedFS: ``last``), waiting up to ``storage_wait_s``; each group still
    alive after its wait gets SIGKILL."""
    children = body.get("children", [])
    for last, wait_s in ((False, workers_wait_s), (True, storage_wait_s)):
        group = [c for c in children if bool(c.get("last")) == last and _alive_group(c)]
        for child in group:
            _signal(child, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while any(_alive_group(c) for c in group) and time.monotonic() < deadline:
            time.sleep(0.1)
        deadline += 10.0
        for child in group:
            while _alive_group(child) and time.monotonic() < deadline:
                _signal(child, signal.SIGKILL)
                time.sleep(0.05)


def _signal(entry: dict, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(int(entry["pid"]), sig)


def _alive_group(entry: dict) -> bool:
    return _same(entry) or bool(group_members(int(entry["pid"])))
