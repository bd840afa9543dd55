"""Routing a request to the declared pool that can render it, before anything is recorded.

Data flow: submission (:mod:`infra.submission.submitter`) → **here**, each request of a batch →
its pool's name, or :class:`NoPoolError` listing every request no pool can serve → the job
records and the pool's wait lane. The pools themselves, their capabilities and the rule are
declared in :mod:`infra.pools`: among the pools serving the request's model, the one with the
*smallest* ``max_pixels`` that still fits ``width × height`` (ties: the first declared); with no
pools declared, each model is its own pool (:func:`infra.pools.pool_for_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infra.controls import DEFAULT_MAX_CONTROLS, ControlSpec, control_errors
from infra.pools import (
    FAMILIES,
    OFFLINE_FAMILIES,
    OFFLINE_UPSCALERS,
    LoraSpec,
    PoolSpec,
    capability_errors,
    check_unique,
    lora_errors,
    pool_for_model,
)


class NoPoolError(ValueError):
    """No declared pool can serve some requests of a submission; nothing was recorded.

    ``errors`` holds one dict per refused request (at most :attr:`MAX_ERRORS`): ``index`` (its
    position in the submission), ``type`` (``no_pool_for_model``, ``over_max_pixels``,
    ``unknown_upscaler``, ``unknown_lora``, ``unknown_control``, ``too_many_controls``,
    ``unsupported_ip_adapter``, or one of
    :func:`capability_errors`' ``unsupported_*`` / ``size_not_multiple``), ``field`` (``model``,
    ``upscaler``, ``controls``, the request field a capability check names, or None for the
    size), ``msg`` and ``input``.
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
        upscalers: the upscaler specs a request may name when no pool is declared
            (``RENDERFARM_UPSCALERS``); a declared pool's own ``upscalers`` apply instead.
        loras: the adapters a request may name when no pool is declared (``RENDERFARM_LORAS``);
            a declared pool's own ``loras`` apply instead.
        controls: the ControlNets a request's units may name when no pool is declared
            (``RENDERFARM_CONTROLS``, at most :data:`~infra.controls.DEFAULT_MAX_CONTROLS` units); a
            declared pool's own ``controls`` and ``max_controls`` apply instead.
    """

    def __init__(self, pools: Sequence[PoolSpec] = (), upscalers: Sequence[str] = OFFLINE_UPSCALERS,
                 loras: Sequence[LoraSpec] = (), controls: Sequence[ControlSpec] = ()):
        self.pools = check_unique(pools)
        self.controls = tuple(controls)
        self.upscalers = tuple(upscalers)
        self.loras = tuple(loras)
        self._by_name = {pool.name: pool for pool in self.pools}
        self._by_model: dict[str, list[PoolSpec]] = {}
        for pool in self.pools:  # sorted by max_pixels; the sort is stable, so ties keep declaration order
            self._by_model.setdefault(pool.model, []).append(pool)
        for candidates in self._by_model.values():
            candidates.sort(key=lambda p: p.max_pixels)

    def spec(self, name: str) -> PoolSpec | None:
        """The declared pool named ``name``; None for an undeclared one (one pool per model)."""
        return self._by_name.get(name)

    def family(self, pool: str, model: str) -> str | None:
        """The model family of ``pool`` (its declared or implied family; for an undeclared pool,
        the one ``model``'s offline name implies), or None when unknown."""
        spec = self._by_name.get(pool)
        return spec.model_family if spec is not None else OFFLINE_FAMILIES.get(model)

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
            NoPoolError: listing every request that no pool can serve, by index: its model, its
                size, or what the pool's model family cannot do (:func:`capability_errors`).
        """
        pools, total = [], 0
        errors: list[dict[str, Any]] = []
        for index, request in enumerate(requests):
            pool, error = self._route(request.model, request.width, request.height, request)
            if error is not None:
                total += 1
                if len(errors) < NoPoolError.MAX_ERRORS:
                    errors.append({"index": index, **error})
            pools.append(pool)
        if errors:
            raise NoPoolError(errors, total)
        return pools

    def _route(self, model: str, width: int, height: int, request: Any = None) -> tuple[str, dict[str, Any] | None]:
        pool, error = self._route_size(model, width, height)
        if error is None and request is not None:
            spec = self._by_name.get(pool)
            upscaler = getattr(request, "upscaler", None)
            if upscaler is not None and spec is not None and upscaler not in spec.upscalers:
                return "", {"type": "unknown_upscaler", "field": "upscaler", "input": upscaler,
                            "msg": f"pool {spec.name!r} has no upscaler {upscaler!r} (it has: "
                                   f"{', '.join(map(repr, spec.upscalers)) or 'none'})"}
            if upscaler is not None and spec is None and upscaler not in self.upscalers:
                return "", {"type": "unknown_upscaler", "field": "upscaler", "input": upscaler,
                            "msg": f"upscaler {upscaler!r} is not in RENDERFARM_UPSCALERS, the upscalers a request "
                                   f"may name while no pool is declared (it has: "
                                   f"{', '.join(map(repr, self.upscalers)) or 'none'})"}
            family = self.family(pool, model)
            ip_adapters = FAMILIES[family].ip_adapter if family in FAMILIES else True  # unknown: the worker decides
            errors = capability_errors(request, family, spec.max_frames if spec is not None else None) + (
                lora_errors(request, spec.loras, f"pool {spec.name!r}") if spec is not None
                else lora_errors(request, self.loras, "RENDERFARM_LORAS (no pool is declared)")) + (
                control_errors(request, spec.controls, f"pool {spec.name!r}", spec.max_controls, ip_adapters)
                if spec is not None
                else control_errors(request, self.controls, "RENDERFARM_CONTROLS (no pool is declared)",
                                    DEFAULT_MAX_CONTROLS, ip_adapters))
            if errors:
                return "", errors[0]
        return pool, error

    def _route_size(self, model: str, width: int, height: int) -> tuple[str, dict[str, Any] | None]:
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
