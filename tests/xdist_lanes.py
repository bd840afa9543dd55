"""A pytest-xdist scheduler with a lane for the test files that mostly wait.

``make test`` hands whole test files to its workers (``--dist loadfile``). Most files are bound
by the CPU: they render, compile or import torch. A few mostly wait (the fault scenarios and the
``renderfarm up`` tests), and their worker leaves its core idle for most of their run. With three workers
and this scheduler, the last worker (the lane) takes those files first, one after the other,
while the other two take the CPU-bound files; a worker whose own kind has run out takes the
other kind, so no worker idles while a file is left.

The lane's files are named in :data:`WAITING_FILES`. Their length is set by timers, not by
work: each runs a stack of real processes on the ``null`` model and waits out leases,
heartbeat timeouts, restarts and step delays. In the suite's report (``test-artifacts/files.json``:
each file's wall seconds and the CPU seconds of its process and the children it reaped) they
used 0.26 to 0.76 CPU seconds per wall second on a 2-vCPU EPYC, where the compile and render
files use 0.75 to 1.3. The lane is a heuristic for the order only: every file still
runs once, whole, on one worker.

Measured on that EPYC (AMD family 25 model 17), caches filled, the same tree one run after the
other: two workers 982.7 s with the machine 79 % busy (1,564 CPU s, 392 idle); three workers with
this lane 813.3 s (1,558 CPU s, 71 idle); three workers in plain ``loadfile`` order 863.9 s
(1,636 CPU s, 93 idle), where the three longest compile and render files started together.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

#: Test files whose wall time is mostly waiting (leases, timeouts, restarts, step delays), by path
#: from the repository root.
WAITING_FILES = frozenset({
    "tests/faults/test_up_scenarios.py",
    "tests/faults/test_worker_scenarios.py",
    "tests/faults/test_scenarios.py",
    "tests/faults/test_recovery.py",
    "tests/faults/test_sentinel.py",
    "tests/faults/test_broker_reconnect.py",
    "tests/integration/test_stack_up.py",
})


class LaneScheduling(LoadFileScheduling):
    """``--dist loadfile`` with one lane: the last worker takes :data:`WAITING_FILES` first,
    the others take every other file first; either takes the other kind once its own has run
    out. With fewer than three workers it is plain ``loadfile``."""

    def _assign_work_unit(self, node: Any) -> None:
        nodes = self.nodes
        if len(nodes) >= 3:
            lane = node is max(nodes, key=lambda n: int(n.gateway.id.removeprefix("gw")))
            wanted = next((scope for scope in self.workqueue if (scope in WAITING_FILES) == lane), None)
            if wanted is not None:  # else only the other kind is left: the first of it
                self.workqueue.move_to_end(wanted, last=False)
        super()._assign_work_unit(node)
