"""``GET /healthz``: liveness, and readiness of Redis and S3.

Place in the data flow: beside it; load balancers and Kubernetes probes ask, nothing else reads it.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from infra.api.deps import FarmDep
from infra.api.models import Health

router = APIRouter(tags=["farm"])


@router.get("/healthz", response_model=Health, responses={503: {"model": Health}})
def healthz(farm: FarmDep) -> JSONResponse:
    """200 when Redis and S3 answer, else 503 with the failing check. Workers whose circuit
    breaker is open are listed in ``unhealthy_workers`` (present only when there are some):
    they do not make the API itself unhealthy, since it still serves."""
    checks = {}
    for name, probe in (("redis", farm.redis.ping), ("s3", farm.storage.ping)):
        try:
            probe()
            checks[name] = "ok"
        except Exception as exc:
            checks[name] = f"{type(exc).__name__}: {exc}"[:300]
    ok = all(v == "ok" for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    if checks["redis"] == "ok":
        unhealthy = [w["name"] for w in farm.live_workers() if w.get("healthy") is False]
        body.unhealthy_workers = unhealthy or None
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)
