"""Fault injection for the fault-injection tests (``tests/faults``): off unless its variables are set.

Data flow: worker → **this wrapper** → the real renderer. It wraps the worker's renderer and
makes chosen requests fail the way real ones do, so that the tests drive the worker's real
recovery paths (bisection, out-of-memory split, timeouts, cancellation) in real processes:

``RENDERFARM_TEST_POISON_PROMPT=<marker>``
    a group whose prompts contain ``<marker>`` raises ``RuntimeError`` (a poison request).
``RENDERFARM_TEST_OOM_ABOVE=<K>``
    a group of more than ``K`` requests raises ``torch.OutOfMemoryError``.
``RENDERFARM_TEST_STEP_DELAY_S=<seconds>``
    each denoising step takes this long; the null renderer is given
    ``num_inference_steps`` steps, so a batch is slow enough to be interrupted.
``RENDERFARM_TEST_HANG_PROMPT=<marker>``
    a group whose prompts contain ``<marker>`` hangs at its first step, forever, without
    reporting progress (a render wedged in a driver call: the render watchdog's case).
``RENDERFARM_TEST_KILL_PROMPT=<marker>``
    a group whose prompts contain ``<marker>`` ends the worker process with ``os._exit(137)``
    after its first step (a request that crashes its worker: bisection across attempts).
``RENDERFARM_TEST_COUNTERS=1``
    count, per job, completed renders (``rf:test:renders``) and object writes that really
    wrote (``rf:test:writes``) in Redis hashes, so a test can prove nothing ran twice.

None of these is a setting: they are read from the environment here, and only here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import redis
from PIL import Image

from infra import keys
from infra.schemas import RenderRequest

log = logging.getLogger("renderfarm.worker")

POISON_ENV = "RENDERFARM_TEST_POISON_PROMPT"
OOM_ENV = "RENDERFARM_TEST_OOM_ABOVE"
DELAY_ENV = "RENDERFARM_TEST_STEP_DELAY_S"
COUNTERS_ENV = "RENDERFARM_TEST_COUNTERS"
HANG_ENV = "RENDERFARM_TEST_HANG_PROMPT"
KILL_ENV = "RENDERFARM_TEST_KILL_PROMPT"


class FaultyRenderer:
    """Wraps a renderer; raises or slows down as the ``RENDERFARM_TEST_*`` variables say."""

    def __init__(self, inner, *, poison: str = "", oom_above: int = 0, step_delay_s: float = 0.0, hang: str = "",
                 kill: str = ""):
        self.inner = inner
        self.model = inner.model
        self.recipe = getattr(inner, "recipe", None)
        self.poison, self.oom_above, self.step_delay_s = poison, oom_above, step_delay_s
        self.hang, self.kill = hang, kill

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def render(self, requests: Sequence[RenderRequest],
               on_step: Callable[[int, int], None] | None = None) -> list[Image.Image]:
        """Like the wrapped renderer's ``render``; raises RuntimeError for a poison prompt and
        ``torch.OutOfMemoryError`` for a group larger than ``oom_above`` (before any step)."""
        if self.poison and any(self.poison in r.prompt for r in requests):
            raise RuntimeError(f"poison request: prompt contains {self.poison!r}")
        if self.oom_above and len(requests) > self.oom_above:
            import torch

            raise torch.OutOfMemoryError(f"injected: out of memory on a group of {len(requests)} "
                                         f"(limit {self.oom_above})")
        if self.hang and any(self.hang in r.prompt for r in requests):
            log.warning("FAULT INJECTION: render of %d hangs forever", len(requests))
            threading.Event().wait()
        if self.kill and any(self.kill in r.prompt for r in requests):
            if on_step is not None:
                on_step(1, max(r.num_inference_steps for r in requests))
            log.warning("FAULT INJECTION: render of %d kills the worker", len(requests))
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(137)
        if not self.step_delay_s:
            return self.inner.render(requests, on_step=on_step)
        if getattr(self.inner, "model", None) == "null":
            total = max(r.num_inference_steps for r in requests)
            for step in range(1, total + 1):
                time.sleep(self.step_delay_s)
                if on_step is not None:
                    on_step(step, total)
            return self.inner.render(requests)

        def slow_step(step: int, total: int) -> None:
            time.sleep(self.step_delay_s)
            if on_step is not None:
                on_step(step, total)

        return self.inner.render(requests, on_step=slow_step)


def wrap_renderer(renderer, env: Mapping[str, str] = os.environ):
    """The renderer itself, or a :class:`FaultyRenderer` around it when a fault variable is set."""
    poison = env.get(POISON_ENV, "")
    oom_above = int(env.get(OOM_ENV, "0") or 0)
    delay = float(env.get(DELAY_ENV, "0") or 0)
    hang, kill = env.get(HANG_ENV, ""), env.get(KILL_ENV, "")
    if not (poison or oom_above or delay or hang or kill):
        return renderer
    log.warning("FAULT INJECTION ON: poison=%r oom_above=%d step_delay_s=%g hang=%r kill=%r", poison, oom_above,
                delay, hang, kill)
    return FaultyRenderer(renderer, poison=poison, oom_above=oom_above, step_delay_s=delay, hang=hang, kill=kill)


def counters(client: redis.Redis, env: Mapping[str, str] = os.environ) -> tuple[Callable, Callable] | None:
    """``(on_rendered(job_ids), on_written(job_id))`` that count into Redis, or None when
    ``RENDERFARM_TEST_COUNTERS`` is not set."""
    if env.get(COUNTERS_ENV) != "1":
        return None

    def on_rendered(job_ids: Sequence[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hincrby(keys.TEST_RENDERS, job_id, 1)
        pipe.execute()

    def on_written(job_id: str) -> None:
        client.hincrby(keys.TEST_WRITES, job_id, 1)

    return on_rendered, on_written
