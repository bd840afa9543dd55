"""The local stack's TCP ports on 127.0.0.1: free ones handed out once, busy ones named.

Place in the data flow: beside it. The services (:mod:`infra.localstack.services`) and the test
fixtures take free ports from :func:`free_port` (never the same one twice in a process, never
one a caller chose: :func:`reserve`). ``renderfarm up`` listens on documented ports (the API on
8000, S3 on 8333, SeaweedFS's usual); before it starts anything, :func:`check_free` makes sure
each is free and otherwise says which process holds it and which option picks another port,
instead of a child dying with "address already in use" in its log.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

LOCALHOST = "127.0.0.1"

_handed_out: set[int] = set()


def free_port(offset_free: int | None = None) -> int:
    """A TCP port on 127.0.0.1 that is free now and not handed out before by this process.

    With ``offset_free``, the port ``p + offset_free`` is free too (SeaweedFS derives some gRPC
    ports as HTTP port + 10000). The port is only probed, not held: another program may still
    take it before the caller binds it, which is rare enough for tests and a local stack.
    """
    for _ in range(200):
        port = _unused_port()
        if port in _handed_out:
            continue
        if offset_free is not None:
            other = port + offset_free
            if other > 65535 or other in _handed_out or not port_is_free(other):
                continue
            _handed_out.add(other)
        _handed_out.add(port)
        return port
    raise RuntimeError("no free TCP port found on 127.0.0.1")


def reserve(*ports: int | None) -> None:
    """Never hand out ``ports`` from :func:`free_port` in this process: ports a caller chose for
    servers that bind later (``renderfarm up --api-port``: the API binds after SeaweedFS has
    picked its nine internal ports). ``None`` entries are ignored."""
    _handed_out.update(p for p in ports if p)


def _unused_port() -> int:
    """A port the kernel picks as unused on 127.0.0.1 now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOCALHOST, 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server could listen on TCP ``port`` of 127.0.0.1 now.

    The probe binds with ``SO_REUSEADDR`` as redis-server, SeaweedFS and uvicorn do, so sockets
    of earlier connections in ``TIME_WAIT`` (up to a minute after a stack stopped) do not count
    as "in use"; on Linux a socket that listens there still makes the bind fail (socket(7),
    ``SO_REUSEADDR``).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True



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
