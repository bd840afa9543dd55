"""Webhook signatures (infra/api/webhooks/signing.py): Standard Webhooks headers made with the
``standardwebhooks`` library, verified as a receiver would, and per-tenant secrets."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

import pytest
from standardwebhooks.webhooks import Webhook

from infra.api.webhooks.delivery import build_body
from infra.api.webhooks.signing import sign_headers, verify_signature

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
BODY = build_body("b" * 32, {"total": "2", "created_at": "1700000000.5"}, {"succeeded": "1", "failed": "1"},
                  1700000100.0)


def test_round_trip_with_the_library():
    now = int(time.time())
    headers = sign_headers(SECRET, "b" * 32, now, BODY)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature"}
    # the specification's construction: v1, base64 HMAC-SHA256 of "id.timestamp.body"
    mac = hmac.new(b"k" * 32, f"{'b' * 32}.{now}.".encode() + BODY, hashlib.sha256).digest()
    assert headers["webhook-signature"] == "v1," + base64.b64encode(mac).decode()
    assert verify_signature(SECRET, headers, BODY)
    assert Webhook(SECRET).verify(BODY, headers) is not None


@pytest.mark.parametrize("change", ["body", "timestamp", "secret", "stale", "id", "missing"])
def test_anything_changed_fails(change):
    now = int(time.time())
    headers = sign_headers(SECRET, "b" * 32, now - (600 if change == "stale" else 0), BODY)
    body, secret = BODY, SECRET
    if change == "body":
        body = BODY.replace(b'"total":2', b'"total":3')
    elif change == "timestamp":
        headers["webhook-timestamp"] = str(now + 1)
    elif change == "secret":
        secret = "whsec_" + base64.b64encode(b"o" * 32).decode()
    elif change == "id":
        headers["webhook-id"] = "c" * 32
    elif change == "missing":
        del headers["webhook-signature"]
    assert not verify_signature(secret, headers, body)
