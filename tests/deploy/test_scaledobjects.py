"""KEDA ScaledObjects of the chart, checked field by field against what KEDA and its scalers need
(kubernetes-validate has no KEDA schemas), and the metrics-api path against the real route."""

from __future__ import annotations

import math

import pytest

from tests.deploy.conftest import by_kind, values_of

VALUE_SETS = ["default", "three-pools"]
SCALED_OBJECT_KEYS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                      "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
TRIGGER_KEYS = {"type", "name", "metadata", "metricType", "authenticationRef", "useCachedMetrics"}
REQUIRED_METADATA = {"metrics-api": {"url", "valueLocation", "targetValue"},
                     "prometheus": {"serverAddress", "query", "threshold"}}
ACTIVATION_KEY = {"metrics-api": "activationTargetValue", "prometheus": "activationThreshold"}
TARGET_KEY = {"metrics-api": "targetValue", "prometheus": "threshold"}


def check_behavior(direction: dict) -> None:
    assert set(direction) <= {"stabilizationWindowSeconds", "selectPolicy", "policies"}
    assert 0 <= direction.get("stabilizationWindowSeconds", 0) <= 3600
    assert direction.get("selectPolicy", "Max") in {"Max", "Min", "Disabled"}
    for pol in direction["policies"]:
        assert set(pol) == {"type", "value", "periodSeconds"}
        assert pol["type"] in {"Pods", "Percent"} and pol["value"] > 0 and 0 < pol["periodSeconds"] <= 1800


@pytest.mark.parametrize("values", VALUE_SETS)
def test_one_scaledobject_per_pool_targeting_its_deployment(render, values):
    docs = render(values)
    deployments = {d["metadata"]["name"]: d for d in by_kind(docs, "Deployment")}
    scaled = by_kind(docs, "ScaledObject")
    pools = values_of(values)["pools"]
    assert len(scaled) == len(pools)
    for so in scaled:
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        spec = so["spec"]
        assert set(spec) <= SCALED_OBJECT_KEYS
        ref = spec["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
        target = deployments[ref["name"]]
        assert target["metadata"]["labels"]["renderfarm.io/pool"] == so["metadata"]["labels"]["renderfarm.io/pool"]
        assert "replicas" not in target["spec"], "KEDA owns replicas; helm upgrade must not reset them"
        assert advanced_hpa_name(so) == ref["name"]


def advanced_hpa_name(so: dict) -> str:
    return so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_scale_from_zero_cooldown_and_behavior(render, values):
    pools = {p["name"]: p for p in values_of(values)["pools"]}
    for so in by_kind(render(values), "ScaledObject"):
        spec = so["spec"]
        pool = pools[so["metadata"]["labels"]["renderfarm.io/pool"]]
        assert spec["minReplicaCount"] == pool["autoscaling"]["minReplicas"]
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"] == pool["autoscaling"]["maxReplicas"]
        assert spec["pollingInterval"] > 0 and spec["cooldownPeriod"] > 0
        assert spec["advanced"]["restoreToOriginalReplicaCount"] is False
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        check_behavior(behavior["scaleUp"])
        check_behavior(behavior["scaleDown"])
    zero = [so for so in by_kind(render(values), "ScaledObject") if so["spec"]["minReplicaCount"] == 0]
    assert zero, "the chart's pools scale from zero"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_triggers_have_what_the_scaler_needs(render, values):
    docs = render(values)
    api_svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-api"))
    pools = {p["name"]: p for p in values_of(values)["pools"]}
    for so in by_kind(docs, "ScaledObject"):
        pool = so["metadata"]["labels"]["renderfarm.io/pool"]
        (trigger,) = so["spec"]["triggers"]
        assert set(trigger) <= TRIGGER_KEYS
        kind = trigger["type"]
        meta = trigger["metadata"]
        assert REQUIRED_METADATA[kind] <= set(meta)
        assert all(isinstance(v, str) for v in meta.values()), "KEDA trigger metadata is map[string]string"
        assert trigger["metricType"] == "AverageValue"   # per-replica target: ceil(outstanding / target)
        target = float(meta[TARGET_KEY[kind]])
        activation = float(meta[ACTIVATION_KEY[kind]])
        assert math.isfinite(target) and target > 0 and 0 <= activation < target
        assert target == pools[pool]["autoscaling"]["targetOutstandingPerReplica"]
        if kind == "metrics-api":
            assert meta["format"] == "json" and meta["valueLocation"] == "outstanding"
            host = f"http://{api_svc['metadata']['name']}.render.svc:{api_svc['spec']['ports'][0]['port']}"
            assert meta["url"] == f"{host}/v1/queues/{pool}"
            if trigger.get("authenticationRef", {}).get("name", "").endswith("-queues"):  # the chart's own
                assert meta["authMode"] == "bearer"
            elif "authenticationRef" in trigger:  # the user's: a tenant key in X-API-Key
                assert meta["authMode"] == "apiKey" and meta["keyParamName"] == "X-API-Key"
                assert meta["method"] == "header"
        else:
            assert f'pool="{pool}"' in meta["query"] and "renderfarm_outstanding_jobs" in meta["query"]
            assert meta["query"].startswith("max("), "every API replica exports the gauge: max, not sum"
            assert meta["serverAddress"].startswith("http")


def test_metrics_api_value_location_resolves_on_the_route(redis_server):
    """GET /v1/queues/{pool} answers one JSON object whose ``outstanding`` is the pool's number,
    zeros for an idle pool (so KEDA reads 0, not an error), the /v1/queues row otherwise."""
    from fastapi.testclient import TestClient

    from infra import keys
    from infra.api.server import create_app
    from infra.settings import Settings

    settings = Settings(redis_url=redis_server.url, s3_endpoint_url="http://127.0.0.1:9")
    import redis as redis_lib

    client_redis = redis_lib.Redis.from_url(redis_server.url)
    client_redis.delete(keys.queue("deploy-test"))
    with TestClient(create_app(settings)) as client:
        idle = client.get("/v1/queues/deploy-test")
        assert idle.status_code == 200
        assert idle.json()["outstanding"] == 0 and idle.json()["pool"] == "deploy-test"
        client_redis.rpush(keys.queue("deploy-test"), b"{}", b"{}", b"{}")
        try:
            row = client.get("/v1/queues/deploy-test").json()
            listed = next(r for r in client.get("/v1/queues").json() if r["pool"] == "deploy-test")
        finally:
            client_redis.delete(keys.queue("deploy-test"))
    assert row == listed and row["outstanding"] == 3 and row["queued"] == 3
