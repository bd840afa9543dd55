"""The process supervisor of the local stack: child processes in their own process groups, with a
log file, a readiness check and a clean stop that leaves no orphans.

Place in the data flow: beside it. :mod:`infra.localstack.services` builds redis-server,
SeaweedFS, the status API and the workers on :class:`ManagedProcess`; ``renderfarm up``,
``renderfarm demo``, the benchmarks and the test fixtures all run the farm through it.

Every child runs in its own process group with its output in ``<run dir>/<name>.log``;
:meth:`ManagedProcess.stop` signals the whole group (SIGTERM, then SIGKILL after a timeout) and
waits until no member of the group is left. Ports are TCP ports on 127.0.0.1 (free ones from
:mod:`infra.localstack.ports`); run dirs come from :mod:`infra.localstack.run_dirs`; times are seconds.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

_default_run_dir: Path | None = None


def _fallback_run_dir() -> Path:
    """One temp directory per Python process, for processes created without a run dir."""
    global _default_run_dir
    if _default_run_dir is None:
        _default_run_dir = Path(tempfile.mkdtemp(prefix="renderfarm-run-"))
    return _default_run_dir


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``.

    Reads ``/proc`` on Linux, so that zombies nobody reaps do not count as alive; elsewhere it
    falls back to probing the group with signal 0 (and returns ``[pgid]`` when any member is left).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces and parentheses): state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the child: ask Linux to SIGTERM us when the parent dies, so a crash leaves no orphans."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class ProcessExited(RuntimeError):
    """A managed process ended before it became ready; the message holds the tail of its log."""


_started: "weakref.WeakSet[ManagedProcess]" = weakref.WeakSet()


def started_processes() -> list["ManagedProcess"]:
    """Every :class:`ManagedProcess` started in this Python process that still exists as an object."""
    return sorted(_started, key=lambda p: p.name)


class ManagedProcess:
    """One child process in its own process group, with a log file and a readiness check.

    Either subclass it (override :meth:`command` and :meth:`is_ready`) or pass ``command`` and
    ``ready`` directly. ``env`` is laid over ``os.environ`` for the child (a ``None`` value
    removes that variable). The log is appended to
    ``<run_dir>/<name>.log`` across restarts, each start marked by a header line.

    Use it as a context manager (start, wait until ready, stop on exit), or call
    :meth:`start`, :meth:`wait_ready` and :meth:`stop`. A process still running when the
    interpreter exits is stopped by an ``atexit`` hook; if the interpreter is killed outright,
    Linux sends the child SIGTERM (``PR_SET_PDEATHSIG``), and the child's own shutdown takes
    its group down.

    Note: ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, so start
    managed processes from a thread that outlives them (normally the main thread).
    """

    #: Seconds :meth:`stop` waits after SIGTERM before it sends SIGKILL.
    stop_timeout: float = 10.0
    #: Seconds :meth:`wait_ready` waits by default.
    ready_timeout: float = 60.0
    #: Seconds between two readiness checks.
    poll_interval: float = 0.1
    #: Whether Linux sends the child SIGTERM when the thread that started it exits
    #: (``PR_SET_PDEATHSIG``). A child that must outlive its parent for a while (the local
    #: stack's storage, stopped after the workers by :mod:`infra.localstack.guard`) sets False.
    die_with_parent: bool = True

    def __init__(
        self,
        name: str,
        command: Sequence[str] | None = None,
        *,
        ready: Callable[[], bool] | None = None,
        env: Mapping[str, str | None] | None = None,
        run_dir: Path | str | None = None,
        cwd: Path | str | None = None,
        stop_timeout: float | None = None,
        ready_timeout: float | None = None,
    ) -> None:
        self.name = name
        self._command = list(command) if command is not None else None
        self._ready = ready
        self.env: dict[str, str | None] = dict(env or {})
        self.run_dir = Path(run_dir) if run_dir is not None else _fallback_run_dir()
        self.cwd = cwd
        if stop_timeout is not None:
            self.stop_timeout = stop_timeout
        if ready_timeout is not None:
            self.ready_timeout = ready_timeout
        self.log_path = self.run_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.returncode: int | None = None

    # -- to override ------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The argv of the child."""
        if self._command is None:
            raise NotImplementedError(f"{type(self).__name__} must define command()")
        return list(self._command)

    def is_ready(self) -> bool:
        """Whether the child serves; exceptions count as "not yet". Default: it is running."""
        if self._ready is not None:
            return bool(self._ready())
        return self.running

    @property
    def url(self) -> str:
        """Where the process listens, for humans and clients ("" when it does not listen)."""
        return ""

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Pid of the child (also its process group id), or None before the first start."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the child process itself is alive."""
        return self.proc is not None and self.proc.poll() is None

    def returncode_now(self) -> int | None:
        """The child's exit code if it has ended (reaped or not), else None."""
        return self.proc.poll() if self.proc is not None else self.returncode

    def child_env(self) -> dict[str, str]:
        """The full environment the child gets: ``os.environ`` overlaid with ``self.env``."""
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        return {key: value for key, value in merged.items() if value is not None}

    def start(self) -> "ManagedProcess":
        """Start the child (not waiting for readiness). Raises RuntimeError if it already runs."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        argv = self.command()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {datetime.now().isoformat(timespec='seconds')} start: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.child_env(),
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") and self.die_with_parent else None,
            )
        self.pgid = self.proc.pid
        self.returncode = None
        _started.add(self)
        return self

    def wait_ready(self, timeout: float | None = None) -> "ManagedProcess":
        """Poll :meth:`is_ready` until it is true, for at most ``timeout`` seconds
        (default :attr:`ready_timeout`).

        Raises:
            ProcessExited: the child ended first (the message holds its log tail).
            TimeoutError: not ready in time (the message holds its log tail).
        """
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ProcessExited(
                    f"{self.name} exited with code {code} before it was ready; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if self.is_ready():
                    return self
            except Exception:  # noqa: BLE001 - any failure of the probe means "not yet"
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval)

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the child and everything in its process group; returns the child's exit code.

        Sends SIGTERM to the group, waits up to ``timeout`` seconds (default
        :attr:`stop_timeout`) for the child and every other member of the group, then sends
        SIGKILL to whatever is left and waits for it. Idempotent: stopping a stopped process
        returns the last exit code.
        """
        if self.proc is None or self.pgid is None:
            return self.returncode
        timeout = self.stop_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        _signal_group(self.pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._kill_and_reap()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once (a crash, for fault tests) and reap it."""
        if self.proc is None or self.pgid is None:
            return self.returncode
        return self._kill_and_reap()

    def _kill_and_reap(self) -> int | None:
        """SIGKILL what is left of the group, reap the child, and wait until the group is empty."""
        assert self.proc is not None and self.pgid is not None
        if self.proc.poll() is None or group_members(self.pgid):
            _signal_group(self.pgid, signal.SIGKILL)
        self.returncode = self.proc.wait()
        deadline = time.monotonic() + 10.0
        while group_members(self.pgid):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.name}: process group {self.pgid} survived SIGKILL")
            _signal_group(self.pgid, signal.SIGKILL)
            time.sleep(0.05)
        self.proc = None
        return self.returncode

    def restart(self, timeout: float | None = None) -> "ManagedProcess":
        """Stop (if running), start again with the same arguments, and wait until ready
        (at most ``timeout`` seconds, default :attr:`ready_timeout`)."""
        self.stop()
        return self.start().wait_ready(timeout)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child process alone (not its group)."""
        if self.proc is not None:
            self.proc.send_signal(sig)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log ("" when there is no log yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> "ManagedProcess":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<{type(self).__name__} {self.name} {state} {self.url}>"


@atexit.register
def _stop_all_at_exit() -> None:
    for process in started_processes():
        with contextlib.suppress(Exception):
            process.stop()
