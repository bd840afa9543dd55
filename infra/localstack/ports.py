"""Busy ports, named: which process holds a TCP port the local stack wants.

Place in the data flow: beside it. ``renderfarm up`` listens on documented ports (the API on
8000, S3 on 8333, SeaweedFS's usual); before it starts anything, :func:`check_free` makes sure
each is free and otherwise says which process holds it and which option picks another port,
instead of a child dying with "address already in use" in its log.
"""

from __future__ import annotations

from collections.abc import Iterable

from infra.localstack.processes import port_is_free


class PortBusy(OSError):
    """A port the stack needs is taken; the message names the holder and the option to change it."""


def holder(port: int) -> str | None:
    """``pid N (command line)`` of the process listening on TCP ``port``, when psutil can tell
    (it may not see other users' processes without privileges); None otherwise."""
    try:
        import psutil
    except ImportError:
        return None
    try:
        connections = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError):
        connections = [c for p in psutil.process_iter() for c in _own_connections(p)]
    pids = {c.pid for c in connections if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    for pid in sorted(p for p in pids if p):
        try:
            process = psutil.Process(pid)
            command = " ".join(process.cmdline()) or process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        return f"pid {pid} ({command[:200]})"
    return "a process of another user" if pids else None


def _own_connections(process) -> list:
    import psutil

    try:
        return [c._replace(pid=process.pid) for c in process.net_connections(kind="inet")]
    except (psutil.AccessDenied, psutil.NoSuchProcess, OSError):
        return []


def check_free(ports: Iterable[tuple[int, str]]) -> None:
    """Raise :class:`PortBusy` for the first ``(port, option)`` whose port on 127.0.0.1 is taken,
    naming the process that holds it and the ``option`` that chooses another."""
    for port, option in ports:
        if not port_is_free(port):
            who = holder(port)
            raise PortBusy(f"port {port} is in use{f' by {who}' if who else ''}; stop it, or choose another "
                           f"port with {option}")
