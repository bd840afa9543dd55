"""The supervisor of the local stack: every child that ``renderfarm up`` starts (redis-server,
SeaweedFS, the status API, the workers) is restarted with exponential backoff when it crashes,
on the same port and data directory, and one that keeps crashing stops the stack.

Place in the data flow: beside it. :mod:`infra.localstack.cli` polls a :class:`Supervisor` once
a second; its :class:`ServiceEvent` records go to the console and, through
:mod:`infra.localstack.events`, to the stack's Redis, where ``/healthz`` and the dashboard read
them. The policy is that of a process supervisor or a Kubernetes Deployment's restart policy
("CrashLoopBackOff": the delay doubles after each crash in a row, up to a cap; Kubernetes docs,
"Pod Lifecycle", container restart policy). Times are seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from infra.localstack.processes import ManagedProcess


@dataclass(frozen=True)
class ServiceEvent:
    """One thing that happened to a supervised child.

    Attributes:
        service: the child's name (``redis``, ``seaweedfs``, ``api``, ``null-1``, …).
        kind: ``exited`` (it died on its own), ``restarted`` (started again, not ready yet),
            ``ready`` (it answers again), ``gave_up`` (it crashed too often; the stack stops).
        at: wall-clock time of the event, epoch seconds.
        message: one line for humans (the console, the dashboard).
        down_s: for ``ready``: seconds from its exit until it answered again.
    """

    service: str
    kind: str
    message: str
    at: float = field(default_factory=time.time)
    down_s: float | None = None

    def __str__(self) -> str:
        return self.message

    def line(self) -> str:
        """The message prefixed with the local time of the event (``HH:MM:SS``)."""
        return f"{datetime.fromtimestamp(self.at):%H:%M:%S} {self.message}"


class CrashLoop(RuntimeError):
    """A child crashed ``give_up_after`` times within ``give_up_window_s``; the message names it
    and its log file (``.service`` and ``.log_path`` hold them)."""

    def __init__(self, message: str, service: str, log_path: str):
        super().__init__(message)
        self.service = service
        self.log_path = log_path


class Supervisor:
    """Restarts crashed children with exponential backoff; gives up on one that crash-loops.

    A child that exited on its own is stopped (its process group reaped) and started again with
    the same arguments (same port, same data directory) after ``base_s`` × 2^(crashes − 1)
    seconds, at most ``max_s``; its crash count is reset once it has stayed up
    ``healthy_after_s`` seconds. :meth:`poll` never blocks on a start: it probes the restarted
    child's readiness on later polls and reports ``ready`` (with the seconds it was down) once
    it answers, so one slow child never holds the others back.

    Args:
        processes: the children to supervise; they must have been started once.
        base_s, max_s, healthy_after_s: backoff parameters, seconds.
        give_up_after, give_up_window_s: a child that exits this many times within this many
            seconds makes :meth:`poll` raise :class:`CrashLoop` instead of restarting it again.
        on_event: called with each :class:`ServiceEvent` (``str(event)`` is its line).
    """

    def __init__(self, processes: Sequence[ManagedProcess], *, base_s: float = 1.0, max_s: float = 60.0,
                 healthy_after_s: float = 60.0, give_up_after: int = 5, give_up_window_s: float = 60.0,
                 on_event: Callable[[ServiceEvent], None] | None = None):
        self.processes = list(processes)
        self.base_s, self.max_s, self.healthy_after_s = base_s, max_s, healthy_after_s
        self.give_up_after, self.give_up_window_s = give_up_after, give_up_window_s
        self.on_event = on_event or (lambda event: None)
        self.crashes: dict[str, int] = {p.name: 0 for p in self.processes}
        self.restarts: dict[str, int] = {p.name: 0 for p in self.processes}
        #: per child, the exit event of an outage not yet over (it is down or not ready yet)
        self.down: dict[str, ServiceEvent] = {}
        self._started = {p.name: time.monotonic() for p in self.processes}
        self._exits: dict[str, deque[float]] = {p.name: deque() for p in self.processes}
        self._due: dict[str, float] = {}

    def backoff_s(self, crashes: int) -> float:
        """Seconds to wait before the restart that follows the ``crashes``-th crash in a row."""
        return min(self.max_s, self.base_s * 2 ** max(0, crashes - 1))

    def poll(self) -> None:
        """Notice crashed children, schedule their restarts, start those whose backoff has
        passed, and report restarted children that answer again. Call it about once a second.

        Raises:
            CrashLoop: a child crashed ``give_up_after`` times within ``give_up_window_s``
                seconds (it is left stopped; the caller stops the rest).
        """
        for p in self.processes:
            now = time.monotonic()
            if p.name in self._due:
                if now >= self._due[p.name]:
                    del self._due[p.name]
                    p.start()
                    self._started[p.name] = now
                    self.restarts[p.name] += 1
                    self._emit(p.name, "restarted",
                               f"{p.name} restarted (pid {p.pid}, restart {self.restarts[p.name]})")
                continue
            if p.proc is None:
                continue
            if p.proc.poll() is None:
                if p.name in self.down and _answers(p):
                    exited = self.down.pop(p.name)
                    down_s = round(time.time() - exited.at, 1)
                    self._emit(p.name, "ready", f"{p.name} answers again after {down_s:.1f} s down", down_s=down_s)
                continue
            self._crashed(p, now)

    def _crashed(self, p: ManagedProcess, now: float) -> None:
        if now - self._started[p.name] >= self.healthy_after_s:
            self.crashes[p.name] = 0
        self.crashes[p.name] += 1
        code = p.proc.returncode if p.proc is not None else None
        p.stop()  # reap it and whatever is left of its process group
        exits = self._exits[p.name]
        exits.append(now)
        while exits and now - exits[0] > self.give_up_window_s:
            exits.popleft()
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if len(exits) >= self.give_up_after:
            message = (f"{p.name} crashed {len(exits)} times within {self.give_up_window_s:.0f} s (last: {why}); "
                       f"stopping the stack. Its log: {p.log_path}")
            self._emit(p.name, "gave_up", message)
            raise CrashLoop(message, p.name, str(p.log_path))
        delay = self.backoff_s(self.crashes[p.name])
        self._due[p.name] = now + delay
        event = self._emit(p.name, "exited", f"{p.name} {why}; restarting in {delay:.1f} s "
                                             f"(crash {self.crashes[p.name]} in a row)")
        self.down.setdefault(p.name, event)

    def _emit(self, service: str, kind: str, message: str, down_s: float | None = None) -> ServiceEvent:
        event = ServiceEvent(service, kind, message, down_s=down_s)
        self.on_event(event)
        return event


def _answers(p: ManagedProcess) -> bool:
    try:
        return bool(p.is_ready())
    except Exception:  # noqa: BLE001 - any failure of the probe means "not yet"
        return False
