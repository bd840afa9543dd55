"""``/v1/webhooks/secret``: the caller's own webhook signing secret (read, rotate).

Place in the data flow: a tenant → **here** → its secret in Redis
(:mod:`infra.api.webhooks.signing`), which the webhook dispatcher signs its batches' deliveries
with (Standard Webhooks headers ``webhook-id``, ``webhook-timestamp``, ``webhook-signature``).
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from infra.api.deps import FarmDep, Tenant
from infra.api.webhooks.signing import rotate_secret, tenant_secret

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


class WebhookSecret(BaseModel):
    """A tenant's webhook signing secret, in the Standard Webhooks form (``whsec_`` + base64)."""

    secret: str = Field(description="Verify deliveries with a Standard Webhooks library and this secret.")


@router.get("/secret", response_model=WebhookSecret)
def get_secret(farm: FarmDep, tenant: Tenant) -> WebhookSecret:
    """This tenant's signing secret (created on first use). Other tenants' secrets differ."""
    return WebhookSecret(secret=tenant_secret(farm.redis, tenant))


@router.post("/secret/rotate", response_model=WebhookSecret)
def rotate(farm: FarmDep, tenant: Tenant) -> WebhookSecret:
    """Replace this tenant's signing secret; deliveries from now on are signed with the new one."""
    return WebhookSecret(secret=rotate_secret(farm.redis, tenant))
