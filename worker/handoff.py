"""The hand-off between the worker's stages: what the render stage passes on, and the bounded
queue thread that carries it.

Place in the data flow: inside the worker, Celery's consumer thread starts a batch
(:mod:`worker.runner`) → render thread (:mod:`worker.render_stage`) → **hand-off** → post thread
(:mod:`worker.post_stage`: encode, upload, record). The render stage passes on one
:class:`RenderedGroup` per group that rendered and, after its last group, one :class:`BatchEnd`;
the post stage takes them in that order. Nothing else crosses between the two threads.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from PIL import Image

from infra.state.job_store import StartedJob
from worker.batch import BatchWork

log = logging.getLogger("renderfarm.worker")
T = TypeVar("T")


@dataclass
class RenderedGroup:
    """One group that rendered: its jobs and their images (in the same order), the denoising
    steps its render ran (counted by the step callback), and the wall seconds of the render
    (the group-size write and the pipeline call)."""

    work: BatchWork
    jobs: list[StartedJob]
    images: list[Image.Image]
    steps: int
    seconds: float


@dataclass
class BatchEnd:
    """The batch's end, after its last group: the post stage records the batch (metrics,
    requeues, its jobs no longer held)."""

    work: BatchWork


class StageThread(Generic[T]):
    """A daemon thread that hands each item :meth:`put` on a bounded queue to ``handle``, in
    order; started at the first :meth:`put`. ``put`` blocks while ``maxsize`` items wait
    (backpressure: what the items hold stays bounded). An exception of ``handle`` is logged
    with ``describe(item)`` and the thread goes on: the item's jobs stay running with their
    leases, which the heartbeat renews until the process ends, when the reaper recovers them."""

    def __init__(self, name: str, handle: Callable[[T], None], *, maxsize: int, describe: Callable[[T], str]):
        self.name, self.handle, self.describe = name, handle, describe
        self._queue: queue.Queue[T] = queue.Queue(maxsize=max(1, maxsize))
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def put(self, item: T) -> None:
        """Queue ``item`` for the thread (blocks while the queue is full)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._queue.put(item)

    def join(self) -> None:
        """Wait until every item put so far is handled (at once when none waits)."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                self.handle(item)
            except Exception:  # the jobs stay running with their leases: the reaper recovers them
                log.exception("%s failed", self.describe(item))
            finally:
                self._queue.task_done()
