"""``GET /healthz`` (readiness: Redis) and ``GET /livez`` (liveness: the process answers).

Place in the data flow: beside it; load balancers and Kubernetes probes ask, nothing else reads it.
Readiness depends on Redis only: without Redis the API can neither accept nor report a job. An
S3 outage leaves it serving (submissions and statuses work; workers ride the outage out), so it
reports ``degraded`` with HTTP 200 instead of leaving the load balancer. The S3 check is shared
and cached (:class:`infra.api.probes.Cached`), so probes cost one Redis PING each.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from infra.api.deps import FarmDep
from infra.api.models import Health
from infra.api.probes import Cached

router = APIRouter(tags=["farm"])


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _s3_check(request: Request, farm) -> Cached:
    cached = getattr(request.app.state, "s3_check", None)
    if cached is None:
        cached = request.app.state.s3_check = Cached(farm.storage.ping, farm.settings.health_s3_cache_s)
    return cached


@router.get("/livez", response_model=dict[str, str])
def livez() -> dict[str, str]:
    """Liveness: the process answers HTTP (no Redis, no S3)."""
    return {"status": "ok"}


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(request: Request, farm: FarmDep) -> JSONResponse:
    """Readiness: 200 when Redis answers (``ok``, or ``degraded`` when S3 does not), else 503.
    Workers whose circuit breaker is open are listed in ``unhealthy_workers`` (present only when
    there are some): they do not make the API itself unhealthy, since it still serves."""
    checks = {}
    try:
        farm.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:
        checks["redis"] = _error(exc)
    try:
        _s3_check(request, farm).get()
        checks["s3"] = "ok"
    except Exception as exc:
        checks["s3"] = _error(exc)
    if checks["redis"] != "ok":
        status = "unavailable"
    else:
        status = "ok" if checks["s3"] == "ok" else "degraded"
    body = Health(status=status, checks=checks)
    if checks["redis"] == "ok":
        unhealthy = [w["name"] for w in farm.live_workers() if w.get("healthy") is False]
        body.unhealthy_workers = unhealthy or None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=503 if status == "unavailable" else 200)
