"""The chart's secure defaults: auth on, the bundled Redis behind a password
from a Secret with protected mode on, and NetworkPolicies (Redis reachable only from this
release's API, workers and catalog job; the API only on its port; workers not at all)."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest

from tests.deploy.conftest import CHART, by_kind, run_helm

K8S_VERSION = "1.30.0"


def _env(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"][0].get("env", [])


def _component(doc: dict) -> str:
    return doc["metadata"]["labels"]["app.kubernetes.io/component"]


def test_auth_is_required_by_default(render):
    (env,) = [d for d in by_kind(render(), "ConfigMap") if d["metadata"]["name"].endswith("-env")]
    assert env["data"]["RENDERFARM_AUTH_REQUIRED"] == "true"
    off = [d for d in by_kind(render("default", "--set", "auth.required=false"), "ConfigMap")
           if d["metadata"]["name"].endswith("-env")]
    assert off[0]["data"]["RENDERFARM_AUTH_REQUIRED"] == "false"


def test_bundled_redis_has_a_password_from_a_secret_and_protected_mode(render):
    docs = render()
    secrets = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-redis")]
    assert len(secrets) == 1
    password = base64.b64decode(secrets[0]["data"]["redis-password"]).decode()
    assert len(password) == 32 and password.isalnum()
    assert secrets[0]["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    conf = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-redis"))
    assert "protected-mode yes" in conf["data"]["redis.conf"] and "protected-mode no" not in conf["data"]["redis.conf"]
    (redis,) = by_kind(docs, "StatefulSet")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    # the password reaches redis-server through a private config written from REDIS_PASSWORD, not the
    # argv (the server's run by tests/deploy/test_chart_redis.py, which checks its /proc cmdline)
    assert 'requirepass "%s"' in container["command"][2] and "$REDIS_PASSWORD" in container["command"][2]
    assert not any("REDIS_PASSWORD)" in part for part in container["command"])
    ref = next(e for e in container["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secrets[0]["metadata"]["name"], "key": "redis-password"}
    # every client of Redis (API, workers, catalog) gets the password before the URL that uses it
    for deploy in by_kind(docs, "Deployment"):
        names = [e["name"] for e in _env(deploy)]
        assert names.index("REDIS_PASSWORD") < names.index("RENDERFARM_REDIS_URL"), deploy["metadata"]["name"]
        url = next(e for e in _env(deploy) if e["name"] == "RENDERFARM_REDIS_URL")["value"]
        assert url.startswith("redis://:$(REDIS_PASSWORD)@")


def test_a_given_or_existing_password_is_used(render):
    docs = render("default", "--set", "redis.bundled.auth.password=s3cret-Pass")
    secret = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-redis"))
    assert base64.b64decode(secret["data"]["redis-password"]).decode() == "s3cret-Pass"
    docs = render("default", "--set", "redis.bundled.auth.existingSecret=mine")
    assert not [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-redis")]
    (redis,) = by_kind(docs, "StatefulSet")
    ref = next(e for e in _env(redis) if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert ref["name"] == "mine"


def test_a_password_that_would_break_the_url_is_refused(helm):
    out = run_helm(helm, "template", "farm", str(CHART), "--set", "redis.bundled.auth.password=a@b/c", check=False)
    assert out.returncode != 0 and "URL-safe" in out.stderr


def test_network_policies(render):
    docs = render()
    policies = {_component(p): p for p in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {"redis", "api", "worker"}
    for policy in policies.values():
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    (rule,) = policies["redis"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["api", "worker", "catalog"]}]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "farm"
    assert "namespaceSelector" not in peer  # only this namespace's pods
    (api_rule,) = policies["api"]["spec"]["ingress"]
    assert api_rule == {"ports": [{"protocol": "TCP", "port": 8000}]}
    assert policies["worker"]["spec"]["ingress"] == [] and policies["worker"]["spec"]["policyTypes"] == ["Ingress"]
    # the pods the Redis policy admits carry those labels
    for deploy in by_kind(docs, "Deployment"):
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] in {"api", "worker"}
    assert not by_kind(render("default", "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


@pytest.mark.parametrize("extra", [("--set", "catalog.enabled=true",
                                    "--set-json", 'catalog.inline={"c.csv": "prompt\\na fox\\n"}')])
def test_catalog_job_reaches_redis_with_the_password(render, extra):
    (cron,) = by_kind(render("default", *extra), "CronJob")
    pod = cron["spec"]["jobTemplate"]["spec"]["template"]
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "catalog"
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("RENDERFARM_REDIS_URL")


def test_metrics_token_from_a_secret(render):
    api = next(d for d in by_kind(render("default", "--set", "metrics.tokenSecret.name=scrape"), "Deployment")
               if _component(d) == "api")
    ref = next(e for e in _env(api) if e["name"] == "RENDERFARM_METRICS_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "scrape", "key": "metrics-token"}
    # none given, auth on: the chart's own scrape token, generated once into a kept Secret
    docs = render()
    api = next(d for d in by_kind(docs, "Deployment") if _component(d) == "api")
    ref = next(e for e in _env(api) if e["name"] == "RENDERFARM_METRICS_TOKEN")["valueFrom"]["secretKeyRef"]
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == ref["name"]]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"][ref["key"]])) >= 32
    api = next(d for d in by_kind(render("default", "--set", "auth.required=false"), "Deployment")
               if _component(d) == "api")
    assert "RENDERFARM_METRICS_TOKEN" not in [e["name"] for e in _env(api)]


def _env_config(docs: list[dict]) -> dict[str, str]:
    (env,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-env")]
    return env["data"]


def test_durable_ack_is_local_by_default_on_the_bundled_aof_redis(render):
    """A 202 waits for the AOF fsync (the durable ack): RENDERFARM_DURABLE_ACK=local, which
    confirms with WAITAOF, so the bundled Redis must have the AOF on and be at least 7.2."""
    docs = render()
    assert _env_config(docs)["RENDERFARM_DURABLE_ACK"] == "local"
    conf = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-redis"))
    lines = conf["data"]["redis.conf"].splitlines()
    assert "appendonly yes" in lines and "appendfsync everysec" in lines
    (redis,) = by_kind(docs, "StatefulSet")
    tag = redis["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[1]
    assert tuple(int(p) for p in tag.split("-")[0].split(".")[:2]) >= (7, 2), tag


@pytest.mark.parametrize(("args", "expected"), [
    (("--set", "redis.durableAck=off"), "off"),
    (("--set", "redis.durableAck=replicas"), "replicas"),
    (("--set", "config.RENDERFARM_DURABLE_ACK=off"), "off"),  # config wins, as for auth
])
def test_durable_ack_can_be_chosen(render, args, expected):
    assert _env_config(render("default", *args))["RENDERFARM_DURABLE_ACK"] == expected


def test_an_unknown_durable_ack_mode_is_refused(helm):
    out = run_helm(helm, "template", "farm", str(CHART), "--set", "redis.durableAck=always", check=False)
    assert out.returncode != 0 and "durableAck" in out.stderr, out.stderr
