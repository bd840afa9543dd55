"""``GET /healthz`` (readiness: Redis) and ``GET /livez`` (liveness: the process answers).

Place in the data flow: beside it; load balancers and Kubernetes probes ask, nothing else reads it.
Readiness depends on Redis only: without Redis the API can neither accept nor report a job. An
S3 outage leaves it serving (submissions and statuses work; workers ride the outage out), so it
reports ``degraded`` with HTTP 200 instead of leaving the load balancer.

Cost: probes are unauthenticated and frequent. One evaluation (:class:`infra.api.probes.Readiness`:
a Redis PING and the S3 check) serves every probe of the process for
``RENDERFARM_HEALTH_CACHE_S`` (1 s), the S3 check's answer is kept for
``RENDERFARM_HEALTH_S3_CACHE_S`` (10 s), and the probe path writes nothing to Redis. The S3
check is one ``HeadBucket`` without retries and with 2 s connect and read timeouts
(:meth:`infra.storage.s3.Storage.ping`), so an evaluation ends well inside the chart's
``timeoutSeconds: 5`` and reports an outage it sees rather than retrying through it.

Disclosure: a caller gets ``{"status": …}`` and the HTTP code, which is all a probe needs. The
checks' error texts (hosts, ports) and the names of workers whose circuit breaker is open go only
to a caller that may read ``/metrics`` (:func:`infra.api.routes.telemetry.may_scrape`: the scrape
token or an admin tenant's key; anyone while no token is set and auth is off, as on the local stack).
"""

from __future__ import annotations

import threading
from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from infra.api.deps import Farm, FarmDep
from infra.api.models import Health
from infra.api.probes import Readiness
from infra.api.routes.telemetry import may_scrape
from infra.state.stack_events import read_down, read_events

router = APIRouter(tags=["farm"])
_created = threading.Lock()


def _unhealthy_workers(farm: Farm) -> list[str]:
    return [w["name"] for w in farm.live_workers() if w.get("healthy") is False]


def _stack_lines(farm: Farm) -> list[str]:
    lines = []
    for event in read_events(farm.redis, 10):
        at = datetime.fromtimestamp(float(event.get("at", 0)), tz=timezone.utc)
        lines.append(f"{at:%Y-%m-%d %H:%M:%S} UTC {event.get('message', '')}")
    return lines


def readiness(request: Request, farm: Farm) -> Readiness:
    """The process's shared :class:`Readiness` (made on first use, kept in ``app.state``)."""
    with _created:
        shared = getattr(request.app.state, "readiness", None)
        if shared is None:
            shared = request.app.state.readiness = Readiness(
                farm.redis.ping, farm.storage.ping, lambda: _unhealthy_workers(farm),
                ttl_s=farm.settings.health_cache_s, s3_ttl_s=farm.settings.health_s3_cache_s,
                stack_down=lambda: read_down(farm.redis), stack_events=lambda: _stack_lines(farm))
        return shared


@router.get("/livez", response_model=dict[str, str])
def livez() -> dict[str, str]:
    """Liveness: the process answers HTTP (no Redis, no S3)."""
    return {"status": "ok"}


@router.get("/healthz", response_model=Health, response_model_exclude_none=True,
            responses={503: {"model": Health}})
def healthz(request: Request, farm: FarmDep) -> JSONResponse:
    """Readiness: 200 when Redis answers (``ok``, or ``degraded`` when S3 does not or a service of
    ``renderfarm up`` is down), else 503 (``unavailable``). One answer serves every probe for
    ``RENDERFARM_HEALTH_CACHE_S``.

    The body is ``{"status": …}`` alone, unless the caller may read ``/metrics`` (the scrape token
    or an admin tenant's key; anyone while auth is off and no token is set): then ``checks`` holds
    each check's ``ok`` or error (``stack``: the services of ``renderfarm up`` that are down),
    ``unhealthy_workers`` the workers whose circuit breaker is open, and ``stack_events`` the
    newest lines of ``renderfarm up``'s supervisor (what restarted, when and why; each present
    only when there are some). Such workers do not make the API unhealthy: it still
    serves."""
    shared = readiness(request, farm)
    status, checks = shared.status()
    body = Health(status=status)
    if may_scrape(request, farm):
        body.checks = checks
        if status != "unavailable":
            body.unhealthy_workers = shared.unhealthy_workers() or None
            body.stack_events = shared.stack_events() or None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503 if status == "unavailable" else 200)
