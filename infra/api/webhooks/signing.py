"""Per-tenant webhook signing secrets and the Standard Webhooks signature.

Place in the data flow: a tenant reads (or rotates) its secret through ``/v1/webhooks/secret``
(:mod:`infra.api.webhooks.routes`) → **stored here** in Redis → the webhook dispatcher
(:mod:`infra.api.webhooks.delivery`) signs each delivery of that tenant's batches with it → the receiver
verifies with any Standard Webhooks library (https://www.standardwebhooks.com/), in Python
``standardwebhooks.webhooks.Webhook(secret).verify(body, headers)``.

Each tenant has its own secret, so a tenant that knows its own cannot forge another's webhooks.
A secret is ``whsec_`` + base64 of 32 random bytes (the Standard Webhooks form), created on
first use and kept until rotated. It is stored as is (the farm must sign with it), under
``rf:tenant:{tenant}:webhook_secret`` (:mod:`infra.keys`).

Headers of a signed delivery (the specification's names): ``webhook-id`` (the batch id: the
same on every attempt, so receivers deduplicate on it), ``webhook-timestamp`` (epoch seconds of
the attempt), ``webhook-signature`` (``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``).
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from datetime import datetime, timezone

import redis
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from infra import keys

PREFIX = "whsec_"
ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER = "webhook-id", "webhook-timestamp", "webhook-signature"


def _new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def tenant_secret(client: redis.Redis, tenant: str) -> str:
    """``tenant``'s signing secret, created (once, race-free with SET NX) when it has none."""
    key = keys.webhook_secret(tenant)
    client.set(key, _new_secret(), nx=True)
    return client.get(key)


def rotate_secret(client: redis.Redis, tenant: str) -> str:
    """Replace ``tenant``'s signing secret with a fresh one and return it; the old one stops
    signing at once (deliveries already sent stay signed with it)."""
    secret = _new_secret()
    client.set(keys.webhook_secret(tenant), secret)
    return secret


def sign_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three Standard Webhooks headers for ``body`` (UTF-8 JSON), signed with ``secret``
    by the ``standardwebhooks`` library."""
    when = datetime.fromtimestamp(timestamp, tz=timezone.utc)
    signature = Webhook(secret).sign(msg_id, when, body.decode())
    return {ID_HEADER: msg_id, TIMESTAMP_HEADER: str(timestamp), SIGNATURE_HEADER: signature}


def verify_signature(secret: str, headers: Mapping[str, str], body: bytes) -> bool:
    """The receiver's check (``standardwebhooks``): True when the headers carry a valid
    signature of ``body`` by ``secret`` with a timestamp within 5 minutes of now. Never raises
    on malformed input."""
    try:
        Webhook(secret).verify(body, dict(headers))
    except (WebhookVerificationError, ValueError, TypeError):
        return False
    return True
