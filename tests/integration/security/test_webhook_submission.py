"""The SSRF policy at the edge: a batch whose webhook URL the policy refuses is a 422 naming the
field, and nothing is recorded; a public URL is accepted (infra/submission/url_policy.py)."""

from __future__ import annotations

import pytest

from infra import keys


@pytest.mark.integration
@pytest.mark.parametrize("url,needle", [("http://127.0.0.1:6379/", "loopback"),
                                       ("http://localhost/hook", "loopback"),
                                       ("http://169.254.169.254/latest", "link-local"),
                                       ("ftp://93.184.216.34/", "scheme")])
def test_submission_with_a_forbidden_webhook_is_a_422_naming_the_field(secure_api, make_tenant, job_body, url,
                                                                       needle, redis_server):
    tenant = make_tenant("hooks", secure_api.url)
    jobs = lambda: sum(1 for _ in redis_server.client().scan_iter(match="rf:job:*", count=1000))  # noqa: E731
    before = jobs()
    r = tenant.http.post("/v1/batches", json={"jobs": [job_body], "webhook_url": url})
    assert r.status_code == 422
    error = r.json()["detail"][0]
    assert error["loc"] == ["body", "webhook_url"] and needle in error["msg"]
    assert jobs() == before  # nothing was recorded


@pytest.mark.integration
def test_submission_with_a_public_webhook_is_accepted(secure_api, make_tenant, job_body, redis_server):
    tenant = make_tenant("hooks", secure_api.url)
    r = tenant.http.post("/v1/batches", json={"jobs": [job_body], "webhook_url": "https://93.184.216.34/hook"})
    assert r.status_code == 202
    assert redis_server.client().hget(keys.batch(r.json()['batch_id']), "webhook_url") == "https://93.184.216.34/hook"
