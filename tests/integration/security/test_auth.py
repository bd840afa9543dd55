"""API keys per tenant: stored hashed, managed by ``renderfarm keys``, checked on every /v1 route,
and never written to a log."""

from __future__ import annotations

import argparse
import json
import logging

import httpx
import pytest

from infra.api import keys_cli
from infra.api.auth import KeyStore, RedactKeys, hash_key, redact
from infra.cli import commands

pytestmark = pytest.mark.integration

V1_ROUTES = [("GET", "/v1/jobs/0123"), ("GET", "/v1/batches/0123"), ("DELETE", "/v1/jobs/0123"),
             ("DELETE", "/v1/batches/0123"), ("GET", "/v1/workers"), ("GET", "/v1/queues"),
             ("POST", "/v1/jobs"), ("POST", "/v1/batches")]


def _dump(client) -> str:
    """Every key and value in the Redis, as one string."""
    parts = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        value = {"hash": client.hgetall, "set": client.smembers, "string": client.get,
                 "list": lambda k: client.lrange(k, 0, -1), "zset": lambda k: client.zrange(k, 0, -1)}.get(
            kind, lambda k: "")(key)
        parts.append(f"{key}={value}")
    return "\n".join(parts)


def test_keys_are_stored_hashed_and_authenticate_until_revoked(keystore: KeyStore, redis_server):
    info, key = keystore.create("acme", name="ci runner")
    assert key.startswith(f"rf_{info.key_id}_") and len(key) > 50
    secret = key.split("_", 2)[2]
    dump = _dump(redis_server.client())
    assert secret not in dump and key not in dump and hash_key(key) in dump
    principal = keystore.authenticate(key)
    assert principal.tenant == "acme" and principal.key_id == info.key_id
    assert keystore.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert keystore.authenticate("") is None and keystore.authenticate("x" * 10_000) is None
    listed = keystore.list("acme")
    assert [i.key_id for i in listed if i.key_id == info.key_id] == [info.key_id]
    assert listed[-1].name == "ci runner" and info.key_id in [i.key_id for i in keystore.list()]
    assert keystore.revoke(info.key_id).tenant == "acme"
    assert keystore.authenticate(key) is None
    assert info.key_id not in [i.key_id for i in keystore.list()]
    assert keystore.revoke(info.key_id) is None


@pytest.mark.parametrize("bad", ["", "Acme", "a b", "-x", "x" * 64, "ü"])
def test_tenant_names_are_checked(keystore: KeyStore, bad):
    with pytest.raises(ValueError, match="tenant must be"):
        keystore.create(bad)


def _keys_cli(capsys, *args) -> tuple[int, str, str]:
    """Run ``renderfarm keys ARGS`` in-process (the full CLI's parser imports the worker, and
    with it torch, which would cost ~20 s per call); returns exit code, stdout, stderr."""
    parser = argparse.ArgumentParser(prog="renderfarm")
    keys_cli.register(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["keys", *args])
    code = parsed.func(parsed)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_creates_lists_and_revokes(farm_env, keystore, capsys):
    assert "infra.api.keys_cli:register" in [entry.value for entry in commands()]
    code, key, err = _keys_cli(capsys, "create", "--tenant", "cli-tenant", "--name", "laptop")
    key = key.strip()
    assert code == 0 and "\n" not in key and keystore.authenticate(key).tenant == "cli-tenant"
    key_id = keystore.authenticate(key).key_id
    secret = key.split("_", 2)[2]
    assert key_id in err and secret not in err
    code, listed, _ = _keys_cli(capsys, "list", "--tenant", "cli-tenant")
    assert code == 0 and key_id in listed and "laptop" in listed and secret not in listed
    code, everything, _ = _keys_cli(capsys, "list", "--json")
    assert key_id in [json.loads(line)["key_id"] for line in everything.splitlines()] and secret not in everything
    code, revoked, _ = _keys_cli(capsys, "revoke", key_id)
    assert code == 0 and key_id in revoked and keystore.authenticate(key) is None
    code, _, err = _keys_cli(capsys, "revoke", key_id)
    assert code == 1 and "no key" in err
    code, _, err = _keys_cli(capsys, "create", "--tenant", "Not Valid")
    assert code == 2 and "tenant must be" in err


@pytest.mark.parametrize("method,path", V1_ROUTES)
def test_every_v1_route_needs_a_key(secure_api, method, path):
    missing = httpx.request(method, secure_api.url + path, json={"prompt": "x"} if method == "POST" else None)
    assert missing.status_code == 401 and "X-API-Key" in missing.json()["detail"]
    invalid = httpx.request(method, secure_api.url + path, headers={"X-API-Key": "rf_000000000000_" + "A" * 43})
    assert invalid.status_code == 401 and "A" * 43 not in invalid.text


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/", "/openapi.json"])
def test_open_routes_need_no_key(secure_api, path):
    assert httpx.get(secure_api.url + path).status_code == 200


def test_openapi_documents_the_key_header(secure_api):
    spec = httpx.get(secure_api.url + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["ApiKey"] == {
        "type": "apiKey", "in": "header", "name": "X-API-Key",
        "description": spec["components"]["securitySchemes"]["ApiKey"]["description"]}
    assert spec["paths"]["/v1/jobs/{job_id}"]["get"]["security"] == [{"ApiKey": []}]
    assert "security" not in spec["paths"]["/healthz"]["get"]


def test_a_valid_key_is_accepted_and_a_revoked_one_refused_at_once(secure_api, make_tenant, keystore):
    tenant = make_tenant("revoke-me", secure_api.url)
    assert tenant.http.get("/v1/queues").status_code == 200
    keystore.revoke(tenant.key_id)
    assert tenant.http.get("/v1/queues").status_code == 401


def test_two_key_headers_are_refused(secure_api, make_tenant):
    tenant = make_tenant("two-headers", secure_api.url)
    r = httpx.get(secure_api.url + "/v1/queues", headers=[("X-API-Key", tenant.key), ("X-API-Key", tenant.key)])
    assert r.status_code == 401


def test_keys_never_reach_the_api_log(secure_api, make_tenant):
    tenant = make_tenant("log-check", secure_api.url)
    secret = tenant.key.split("_", 2)[2]
    tenant.http.get("/v1/queues")
    tenant.http.get(f"/v1/jobs/{tenant.key}")               # a key pasted into a path
    tenant.http.get("/v1/queues", params={"api_key": tenant.key})  # and into a query string
    httpx.get(secure_api.url + "/v1/queues", headers={"X-API-Key": tenant.key + "x"})
    log = secure_api.log_path.read_text()
    assert "/v1/queues" in log and f"rf_{tenant.key_id}_***" in log
    assert secret not in log


def test_redaction_filter_masks_keys_in_messages_and_args():
    key = "rf_0123456789ab_" + "Zz9-_" * 9
    assert redact(f"GET /v1/jobs/{key} 404") == "GET /v1/jobs/rf_0123456789ab_*** 404"
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s"',
                               ("127.0.0.1", "GET", f"/x?k={key}"), None)
    assert RedactKeys().filter(record) and key not in record.getMessage()
    assert "rf_0123456789ab_***" in record.getMessage()


def test_without_auth_required_keys_are_optional(api_server, farm_env, make_tenant):
    url = farm_env["RENDERFARM_API_URL"]
    assert httpx.get(url + "/v1/queues").status_code == 200
    tenant = make_tenant("optional", url)
    assert tenant.http.get("/v1/queues").status_code == 200
    assert httpx.get(url + "/v1/queues", headers={"X-API-Key": "nonsense"}).status_code == 401
