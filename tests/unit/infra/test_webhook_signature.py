"""Webhook signatures (infra/api/webhooks.py): what a receiver checks with ``verify_signature``."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from infra.api.webhooks import build_body, sign, verify_signature

SECRET = "whsec-unit"
BODY = build_body("b" * 32, {"total": "2", "created_at": "1700000000.5"}, {"succeeded": "1", "failed": "1"},
                  1700000100.0)
NOW = 1700000200


def test_round_trip():
    header = sign(SECRET, NOW, BODY)
    assert header.startswith("sha256=") and len(header) == len("sha256=") + 64
    # the documented construction: HMAC-SHA256 over "<timestamp>.<body>"
    assert header == "sha256=" + hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert verify_signature(SECRET, str(NOW), BODY, header, now=NOW)
    assert verify_signature(SECRET, NOW, BODY, header, now=NOW + 299)


@pytest.mark.parametrize("change", ["body", "timestamp", "secret", "stale", "future", "header", "missing"])
def test_anything_changed_fails(change):
    header = sign(SECRET, NOW, BODY)
    args = dict(secret=SECRET, timestamp=str(NOW), body=BODY, header=header, now=NOW)
    if change == "body":
        args["body"] = BODY.replace(b'"failed":1', b'"failed":0')
    elif change == "timestamp":
        args["timestamp"] = str(NOW + 1)
    elif change == "secret":
        args["secret"] = SECRET + "x"
    elif change == "stale":
        args["now"] = NOW + 301
    elif change == "future":
        args["now"] = NOW - 301
    elif change == "header":
        args["header"] = "sha1=" + header[7:]
    else:
        args["header"] = None
    assert not verify_signature(**args)


def test_malformed_input_is_false_not_an_exception():
    assert not verify_signature(SECRET, "yesterday", BODY, sign(SECRET, NOW, BODY), now=NOW)
    assert not verify_signature("", str(NOW), BODY, sign("", NOW, BODY), now=NOW)
    assert not verify_signature(SECRET, None, BODY, "sha256=00", now=NOW)


def test_body_shape():
    import json

    body = json.loads(BODY)
    assert body == {"event": "batch.finished", "batch_id": "b" * 32, "total": 2,
                    "counts": {"queued": 0, "running": 0, "succeeded": 1, "failed": 1, "canceled": 0},
                    "created_at": "2023-11-14T22:13:20.500000+00:00", "finished_at": "2023-11-14T22:15:00+00:00"}
