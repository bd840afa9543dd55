"""Presigned image URLs expire: SeaweedFS refuses them after ``presign_expires_s`` (default 1 h)."""

from __future__ import annotations

import secrets
import time
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from infra.settings import Settings
from infra.storage.s3 import Storage

pytestmark = pytest.mark.integration

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 8


def _expires(url: str) -> int:
    return int(parse_qs(urlsplit(url).query)["X-Amz-Expires"][0])


def test_default_lifetime_is_one_hour():
    assert Settings.model_fields["presign_expires_s"].default == 3600


def test_seaweedfs_refuses_an_expired_url(farm_env):
    storage = Storage(Settings())
    key = f"presign-test/{secrets.token_hex(8)}.png"
    storage.put(key, PNG, "image/png", {})
    url = storage.presigned_url(key, expires_s=3)  # long enough for a loaded machine's first GET
    assert _expires(url) == 3
    assert httpx.get(url).content == PNG
    time.sleep(4.5)
    expired = httpx.get(url)
    assert expired.status_code == 403 and b"expired" in expired.content.lower()
    assert httpx.get(storage.presigned_url(key)).status_code == 200  # a fresh URL still works


def test_api_urls_use_the_configured_lifetime(tight_api, make_tenant, job_body, finish_as_worker, s3_server,
                                              farm_env):
    tenant = make_tenant(f"presign{secrets.token_hex(3)}", tight_api.url)
    accepted = tenant.http.post("/v1/jobs", json=job_body).json()
    key = f"{accepted['batch_id']}/{accepted['job_id']}.png"
    s3_server.client().put_object(Bucket=farm_env["RENDERFARM_S3_BUCKET"], Key=key, Body=PNG)
    finish_as_worker(accepted["job_id"], key)
    url = tenant.http.get(f"/v1/jobs/{accepted['job_id']}").json()["result"]["url"]
    assert _expires(url) == 2 and httpx.get(url).content == PNG
    time.sleep(3.5)
    assert httpx.get(url).status_code == 403
    # with the default settings, one hour
    default = Storage(Settings()).presigned_url(key)
    assert _expires(default) == 3600
