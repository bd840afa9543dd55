"""Worker pools, their Celery queues, and routing a request to the pool that can render it.

Data flow: the producer side (:mod:`infra.api.submission`) routes each request to a pool here before
anything is recorded; the dispatcher (:mod:`infra.broker.dispatch`) feeds that pool's queue; a worker
(``worker.main``) consumes exactly one pool's queue and checks at start-up that its pool and
model match the declaration. All sides name queues with :func:`infra.keys.queue`, so the names cannot
drift apart.

A pool is "model × device class". Pools are declared in ``RENDERFARM_POOLS`` (settings field
``pools``), a JSON list as the Helm chart writes it::

    [{"name": "l4-sdxl", "model": "stabilityai/sdxl-turbo", "device_class": "cuda",
      "max_pixels": 1048576, "max_batch": 8, "queue": "renderfarm.l4-sdxl"}, …]

Routing with declared pools: among the pools serving the request's model, the one with the
*smallest* ``max_pixels`` that still fits ``width × height`` (ties: the first declared). Small
renders thus go to the smallest (cheapest) pool able to take them and large-memory pools stay
free for the renders only they can do. A request no pool can serve is refused with
:class:`NoPoolError`, naming the model or the size over the largest pool's ``max_pixels``.

With no pools declared, each model is its own pool, named by a slug of the model spec, and
every size is accepted (the behaviour before pools were declared).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra import keys

#: Pool names: what :func:`pool_for_model` produces, without ``:`` (the broker's priority separator).
POOL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


def pool_for_model(model: str) -> str:
    """The pool name of a model spec: a lowercase slug, e.g. ``stabilityai/sd-turbo`` → ``stabilityai--sd-turbo``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower().replace("/", "--")).strip("-.")
    return slug[:100] or "default"


class PoolSpec(BaseModel):
    """One declared pool, an item of ``RENDERFARM_POOLS``.

    ``max_pixels`` is the largest ``width × height`` (pixels) the pool accepts; ``max_batch`` the
    most jobs one worker renders per batch (a worker caps its batch size to it). ``queue``, when
    given, must be ``renderfarm.<name>``: it is the queue the worker started with ``--pool name``
    consumes.

    Raises:
        pydantic.ValidationError: an invalid name, a non-positive size, or a mismatched queue.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Pool name: 1–100 of a-z 0-9 . _ - (the chart requires a DNS label).")
    model: str = Field(min_length=1, max_length=200, description="The model spec its workers pin.")
    device_class: str = Field("cpu", min_length=1, max_length=40, description="cpu, cuda, …")
    max_pixels: int = Field(2048 * 2048, ge=64 * 64, description="Largest width × height, pixels.")
    max_batch: int = Field(8, ge=1, le=256, description="Most jobs per batch.")
    queue: str | None = Field(None, description="renderfarm.<name> (filled in when absent).")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not POOL_NAME_RE.match(v):
            raise ValueError(f"pool name must be 1–100 of a-z, 0-9, '.', '_', '-', starting alphanumeric; got {v!r}")
        return v

    @model_validator(mode="after")
    def _queue(self) -> "PoolSpec":
        expected = keys.queue(self.name)
        if self.queue is None:
            object.__setattr__(self, "queue", expected)
        elif self.queue != expected:
            raise ValueError(f"pool {self.name!r}: queue must be {expected!r} (what its workers consume), "
                             f"got {self.queue!r}")
        return self


def check_unique(pools: Sequence[PoolSpec]) -> list[PoolSpec]:
    """``pools`` as a list, or ValueError naming a pool name declared twice."""
    seen: set[str] = set()
    for pool in pools:
        if pool.name in seen:
            raise ValueError(f"pool {pool.name!r} is declared twice")
        seen.add(pool.name)
    return list(pools)


class NoPoolError(ValueError):
    """No declared pool can serve some requests of a submission; nothing was recorded.

    ``errors`` holds one dict per refused request (at most :attr:`MAX_ERRORS`): ``index`` (its
    position in the submission), ``type`` (``no_pool_for_model`` or ``over_max_pixels``),
    ``field`` (``model``, or None for the size), ``msg`` and ``input``.
    """

    MAX_ERRORS = 100

    def __init__(self, errors: list[dict[str, Any]], total: int):
        self.errors = errors
        self.total = total
        more = f" (and {total - len(errors)} more)" if total > len(errors) else ""
        super().__init__(f"job {errors[0]['index']}: {errors[0]['msg']}{more}")


class Router:
    """Maps requests to pool names (see the module docstring for the rule).

    Args:
        pools: the declared pools; empty means one pool per model.
    """

    def __init__(self, pools: Sequence[PoolSpec] = ()):
        self.pools = check_unique(pools)
        self._by_model: dict[str, list[PoolSpec]] = {}
        for pool in self.pools:  # sorted by max_pixels; the sort is stable, so ties keep declaration order
            self._by_model.setdefault(pool.model, []).append(pool)
        for candidates in self._by_model.values():
            candidates.sort(key=lambda p: p.max_pixels)

    def pool_for(self, model: str, width: int, height: int) -> str:
        """The pool for a render of ``model`` at ``width × height`` pixels.

        Raises:
            NoPoolError: with one error (index 0) naming the model no pool serves, or the size
                over the largest serving pool's ``max_pixels``.
        """
        pool, error = self._route(model, width, height)
        if error is not None:
            raise NoPoolError([{"index": 0, **error}], 1)
        return pool

    def route_all(self, requests: Sequence[Any]) -> list[str]:
        """The pool of each request (objects with ``model``, ``width``, ``height``; the model
        already resolved), in order.

        Raises:
            NoPoolError: listing every request that no pool can serve, by index.
        """
        pools, errors, total = [], [], 0
        for index, request in enumerate(requests):
            pool, error = self._route(request.model, request.width, request.height)
            if error is not None:
                total += 1
                if len(errors) < NoPoolError.MAX_ERRORS:
                    errors.append({"index": index, **error})
            pools.append(pool)
        if errors:
            raise NoPoolError(errors, total)
        return pools

    def _route(self, model: str, width: int, height: int) -> tuple[str, dict[str, Any] | None]:
        if not self.pools:
            return pool_for_model(model), None
        candidates = self._by_model.get(model)
        if not candidates:
            served = sorted(self._by_model)
            return "", {"type": "no_pool_for_model", "field": "model", "input": model,
                        "msg": f"no declared pool serves model {model!r} (served: {', '.join(map(repr, served))})"}
        pixels = width * height
        for pool in candidates:
            if pixels <= pool.max_pixels:
                return pool.name, None
        largest = candidates[-1]
        return "", {"type": "over_max_pixels", "field": None, "input": {"width": width, "height": height},
                    "msg": f"{width}×{height} = {pixels:,} pixels is over max_pixels {largest.max_pixels:,} of pool "
                           f"{largest.name!r}, the largest pool serving model {model!r}"}


class PoolConfigError(ValueError):
    """A worker's ``--pool``/``--model`` contradict the declared pools."""


def worker_pool(pools: Sequence[PoolSpec], pool: str | None, model: str) -> PoolSpec | None:
    """The declared pool a worker started with ``--pool pool --model model`` serves.

    Returns None when no pools are declared (the worker serves ``pool`` or the model's own pool).
    Without ``--pool``, the one declared pool serving ``model`` is taken.

    Raises:
        PoolConfigError: ``pool`` is not declared, is declared with another model, or ``pool``
            is omitted and not exactly one declared pool serves ``model``.
    """
    if not pools:
        return None
    by_name = {p.name: p for p in pools}
    if pool is None:
        serving = [p for p in pools if p.model == model]
        if len(serving) != 1:
            names = ", ".join(p.name for p in serving) or "none"
            raise PoolConfigError(f"--pool is required: model {model!r} is served by {len(serving)} declared "
                                  f"pool(s) ({names}); declared: {', '.join(by_name)}")
        return serving[0]
    spec = by_name.get(pool)
    if spec is None:
        raise PoolConfigError(f"pool {pool!r} is not declared in RENDERFARM_POOLS (declared: {', '.join(by_name)}); "
                              f"its jobs would never be routed to this worker")
    if spec.model != model:
        raise PoolConfigError(f"pool {pool!r} is declared with model {spec.model!r}, but this worker was started "
                              f"with --model {model!r}; it would render that pool's jobs with the wrong model")
    return spec
