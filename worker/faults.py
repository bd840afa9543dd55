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
``RENDERFARM_TEST_COUNTERS=1``
    count, per job, completed renders (``rf:test:renders``) and object writes that really
    wrote (``rf:test:writes``) in Redis hashes, so a test can prove nothing ran twice.

None of these is a setting: they are read from the environment here, and only here.
"""

from __future__ import annotations

import logging
import os
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


class FaultyRenderer:
    """Wraps a renderer; raises or slows down as the ``RENDERFARM_TEST_*`` variables say."""

    def __init__(self, inner, *, poison: str = "", oom_above: int = 0, step_delay_s: float = 0.0):
        self.inner = inner
        self.model = inner.model
        self.recipe = getattr(inner, "recipe", None)
        self.poison, self.oom_above, self.step_delay_s = poison, oom_above, step_delay_s

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
    if not (poison or oom_above or delay):
        return renderer
    log.warning("FAULT INJECTION ON: poison=%r oom_above=%d step_delay_s=%g", poison, oom_above, delay)
    return FaultyRenderer(renderer, poison=poison, oom_above=oom_above, step_delay_s=delay)


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
