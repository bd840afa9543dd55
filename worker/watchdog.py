"""The render watchdog: a worker whose render stops making progress gives its jobs up and exits.

Data flow: the render stage (:mod:`worker.render_stage`) reports progress here — a render starting, each
denoising step, a render ending — and **this thread** checks, every second, how long the
render in progress has gone without any. The heartbeat (:mod:`worker.heartbeat`) renews the
leases of every job the worker holds whether or not its render moves, so without this a render
wedged in C code (a hung driver call, a deadlocked collective) would hold its jobs forever.

After ``stall_s`` seconds without progress the watchdog calls ``on_stall`` (the worker
deregisters, so neither its ``current_jobs`` nor its ``reserved_jobs`` keep anything looking
alive) and ends the process with :data:`EXIT_STALLED` through ``os._exit``: a thread stuck in
C code cannot be interrupted from Python, and a normal exit would wait for it. The process's
supervisor (Kubernetes, or ``renderfarm up``) starts a fresh worker; the stuck jobs' leases are
no longer renewed, so they expire and the reaper requeues them (counted as a lost worker:
bisection across attempts, :mod:`infra.state.scripts`), to be rendered by healthy workers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("renderfarm.worker")

#: The exit status of a worker stopped by its watchdog (``EX_SOFTWARE`` of sysexits.h).
EXIT_STALLED = 70


class RenderWatchdog(threading.Thread):
    """Ends the process when a render makes no progress for ``stall_s`` seconds.

    Args:
        stall_s: longest a render may go without a denoising step or finishing, seconds
            (0 = the watchdog never fires).
        on_stall: called once, with a description, just before the process exits (deregister;
            must not block for long).
        exit: how the process ends (``os._exit``; a test passes its own).
        check_s: seconds between two checks.
    """

    def __init__(self, stall_s: float, *, on_stall: Callable[[str], object] | None = None,
                 exit: Callable[[int], object] = os._exit, check_s: float = 1.0):
        super().__init__(name="renderfarm-watchdog", daemon=True)
        self.stall_s, self.check_s = stall_s, check_s
        self.on_stall = on_stall or (lambda reason: None)
        self._exit = exit
        self._lock = threading.Lock()
        self._active = 0  # renders in progress (one render thread: 0 or 1)
        self._last = time.monotonic()
        self._what = ""
        self._limit = stall_s  # the render in progress's limit (see rendering)
        self._stop_event = threading.Event()
        self.fired = False

    @contextmanager
    def rendering(self, what: str, stall_s: float | None = None) -> Iterator[None]:
        """Watch the render inside this block (``what`` names it in the log); ``stall_s``, when
        larger than the watchdog's own, is this render's limit, seconds (a long video's,
        :func:`worker.budgets.render_budget`)."""
        with self._lock:
            self._active += 1
            self._last, self._what = time.monotonic(), what
            self._limit = max(self.stall_s, stall_s or 0.0)
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._last = time.monotonic()

    def progress(self) -> None:
        """The render moved (a denoising step)."""
        with self._lock:
            self._last = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds the render in progress has gone without progress (0 when none runs)."""
        with self._lock:
            return time.monotonic() - self._last if self._active else 0.0

    def check(self) -> bool:
        """One check: fires (``on_stall``, then exit) when the render is stalled. Returns whether it fired."""
        stalled = self.stalled_for()
        if self.stall_s <= 0 or self.fired or stalled <= self._limit:
            return False
        self.fired = True
        reason = (f"render of {self._what} made no progress for {stalled:.0f}s (its limit {self._limit:g}s; "
                  f"RENDERFARM_RENDER_STALL_S={self.stall_s:g}); giving its jobs up and exiting {EXIT_STALLED}")
        log.critical("watchdog: %s", reason)
        try:
            self.on_stall(reason)
        except Exception as exc:  # exit anyway: the leases expire without renewal
            log.warning("watchdog: %s", exc)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_STALLED)
        return True

    def run(self) -> None:
        while not self._stop_event.wait(self.check_s):
            if self.check():
                return

    def stop(self) -> None:
        """Stop watching (a warm shutdown)."""
        self._stop_event.set()
