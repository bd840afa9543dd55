"""The local stack's guard: when ``renderfarm up`` dies without stopping its children, stop
them in order, the workers before the storage they write to.

Place in the data flow: beside it. :class:`infra.localstack.stack.LocalStack` with a data
directory starts ``python -m infra.localstack.guard DATA_DIR PID START`` in its own session,
not tied to ``up`` (no ``PR_SET_PDEATHSIG``), so that neither a ``kill -9`` of ``up`` nor one of
its process group takes it along. It polls once every ``poll_s`` seconds whether ``up`` (pid and
start time, :mod:`infra.localstack.claim`) still runs; when ``up`` stopped on its own, it is
stopped with SIGTERM by ``up`` itself. When ``up`` vanished, its workers and API already got
SIGTERM from Linux, while redis-server and SeaweedFS did not: the guard waits until the workers
have finished their batches (their renders reach Redis and S3, so a new ``up`` does not render
them again), then stops the storage (:func:`infra.localstack.claim.drain`), and removes
``up.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from infra.localstack import claim


def watch(data_dir: Path, up_pid: int, up_start: int, *, poll_s: float = 0.5) -> None:
    """Return once ``up`` (``up_pid`` started at ``up_start`` clock ticks after boot) is gone
    and the children it recorded in ``data_dir`` are stopped."""
    while claim.owner_alive({"pid": up_pid, "start": up_start}):
        time.sleep(poll_s)
    body = claim.read(data_dir)
    if body.get("pid") == up_pid:
        claim.drain(body)
        claim.release(data_dir, up_pid)


def main(argv: list[str] | None = None) -> int:
    """``python -m infra.localstack.guard DATA_DIR PID START``; returns 0."""
    data_dir, pid, start = (argv if argv is not None else sys.argv[1:])[:3]
    watch(Path(data_dir), int(pid), int(start))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
