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
    record, per job, completed renders (``rf:test:renders``) and object writes that really
    wrote (``rf:test:writes``) in Redis hashes, so a test can prove nothing ran twice
    (:func:`read_counters` reads them).

None of these is a setting: they are read from the environment here, and only here.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
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
    """``(on_rendered(job_ids), on_written(job_id))`` that record into Redis, or None when
    ``RENDERFARM_TEST_COUNTERS`` is not set.

    Each call is one event, recorded as a field ``{job_id}|{token}`` of the hash, with a token
    drawn once per call and kept through its retries: a write that Redis made durable but whose
    reply a ``kill -9`` of redis-server cut off is retried (here, and by redis-py itself) without
    counting twice, which a plain ``HINCRBY`` would. :func:`read_counters` counts the fields.
    Redis away: retried for up to 60 s, then the error is raised.
    """
    if env.get(COUNTERS_ENV) != "1":
        return None
    from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

    @retry(retry=retry_if_exception_type((redis.ConnectionError, redis.TimeoutError)),
           wait=wait_exponential(multiplier=0.1, max=2.0), stop=stop_after_delay(60), reraise=True)
    def record(key: str, fields: list[str]) -> None:
        client.hset(key, mapping=dict.fromkeys(fields, 1))

    def on_rendered(job_ids: Sequence[str]) -> None:
        token = uuid.uuid4().hex
        record(keys.TEST_RENDERS, [f"{job_id}|{token}" for job_id in job_ids])

    def on_written(job_id: str) -> None:
        record(keys.TEST_WRITES, [f"{job_id}|{uuid.uuid4().hex}"])

    return on_rendered, on_written


def read_counters(client: redis.Redis) -> tuple[dict[str, int], dict[str, int]]:
    """What :func:`counters` recorded: per job id, the completed renders and the object writes
    that really wrote."""
    def count(key: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for field in client.hkeys(key):
            job_id = (field.decode() if isinstance(field, bytes) else field).split("|", 1)[0]
            found[job_id] = found.get(job_id, 0) + 1
        return found

    return count(keys.TEST_RENDERS), count(keys.TEST_WRITES)
