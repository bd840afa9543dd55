"""The Helm chart deploy/helm/renderfarm: lint, Kubernetes schema validation, queue names, grace
periods, PDBs, Redis, S3 and the catalog CronJob. ScaledObjects: test_scaledobjects.py."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest

from infra import keys
from tests.deploy.conftest import CHART, KEDA_KINDS, VALUES, by_kind, run_helm, values_of

K8S_VERSION = "1.30.0"   # the oldest Kubernetes the chart targets, in kubernetes-validate's schemas
VALUE_SETS = ["default", "three-pools", "redis-sentinel"]


def workers(docs: list[dict]) -> list[dict]:
    return [d for d in by_kind(docs, "Deployment")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]


def worker_args(deploy: dict) -> list[str]:
    return deploy["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint(helm, values):
    args = ["lint", "--strict", str(CHART)] + [a for f in VALUES[values] for a in ("-f", str(f))]
    out = run_helm(helm, *args)
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", VALUE_SETS)
def test_manifests_validate_strict(render, values):
    """Every non-KEDA object passes kubernetes-validate's strict schema check."""
    docs = render(values)
    checked = 0
    for doc in docs:
        if doc["kind"] in KEDA_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_kubernetes_validate_cli_strict(render, tmp_path):
    """The same check through the CLI the docs show (``kubernetes-validate --strict``)."""
    import yaml

    docs = [d for d in render("three-pools") if d["kind"] not in KEDA_KINDS]
    path = tmp_path / "three-pools.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    cli = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSION, str(path)]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(" passed for resource ") == len(docs), out.stdout


def worker_parser() -> argparse.ArgumentParser:
    from worker.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser


@pytest.mark.parametrize("values", VALUE_SETS)
def test_worker_queue_matches_scaler_and_declaration(render, values):
    """The queue a worker consumes (its parsed CLI args → infra.keys.queue) equals the queue
    of the pool the ScaledObject reads, the annotation and the RENDERFARM_POOLS declaration."""
    docs = render(values)
    parser = worker_parser()
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind(docs, "ScaledObject")}
    env = by_kind(docs, "ConfigMap")
    declared = {p["name"]: p for cm in env if "RENDERFARM_POOLS" in cm["data"]
                for p in json.loads(cm["data"]["RENDERFARM_POOLS"])}
    expected = {p["name"] for p in values_of(values)["pools"]}
    seen = set()
    for deploy in workers(docs):
        args = parser.parse_args(worker_args(deploy))
        assert args.command == "worker"
        pool = args.pool
        queue = keys.queue(pool)
        seen.add(pool)
        assert deploy["metadata"]["annotations"]["renderfarm.io/queue"] == queue
        assert deploy["metadata"]["labels"]["renderfarm.io/pool"] == pool
        assert declared[pool]["queue"] == queue
        assert declared[pool]["model"] == args.model
        so = scaled[deploy["metadata"]["name"]]
        trigger = so["spec"]["triggers"][0]
        if trigger["type"] == "metrics-api":
            scaler_pool = trigger["metadata"]["url"].rsplit("/v1/queues/", 1)[1]
        else:
            scaler_pool = re.search(r'pool="([^"]+)"', trigger["metadata"]["query"]).group(1)
        assert keys.queue(scaler_pool) == queue
    assert seen == expected


@pytest.mark.parametrize("values", VALUE_SETS)
def test_grace_period_covers_longest_batch(render, values):
    pools = {p["name"]: p for p in values_of(values)["pools"]}
    for deploy in workers(render(values)):
        pool = deploy["metadata"]["labels"]["renderfarm.io/pool"]
        grace = deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= pools[pool]["longestBatchSeconds"] > 0
        assert grace >= int(deploy["metadata"]["annotations"]["renderfarm.io/longest-batch-seconds"])


def test_grace_period_below_longest_batch_is_refused(helm):
    out = run_helm(helm, "template", "farm", str(CHART), "--set", "pools[0].name=p", "--set", "pools[0].model=tiny",
                   "--set", "pools[0].longestBatchSeconds=300", "--set", "pools[0].terminationGracePeriodSeconds=60",
                   check=False)
    assert out.returncode != 0 and "shorter than longestBatchSeconds" in out.stderr


@pytest.mark.parametrize("values", VALUE_SETS)
def test_pdbs_select_api_and_every_pool(render, values):
    docs = render(values)
    pdbs = by_kind(docs, "PodDisruptionBudget")

    def covered(labels: dict) -> bool:
        return any(all(labels.get(k) == v for k, v in p["spec"]["selector"]["matchLabels"].items()) for p in pdbs)

    targets = [d for d in by_kind(docs, "Deployment")]
    assert {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in targets} == {"api", "worker"}
    for d in targets:
        assert covered(d["spec"]["template"]["metadata"]["labels"]), d["metadata"]["name"]


@pytest.mark.parametrize("values", VALUE_SETS)
def test_cuda_pools_get_gpus_nodes_and_tolerations(render, values):
    pools = {p["name"]: p for p in values_of(values)["pools"]}
    for deploy in workers(render(values)):
        spec = deploy["spec"]["template"]["spec"]
        pool = pools[deploy["metadata"]["labels"]["renderfarm.io/pool"]]
        limits = spec["containers"][0]["resources"].get("limits", {})
        image = spec["containers"][0]["image"]
        if pool["deviceClass"] == "cuda":
            assert limits["nvidia.com/gpu"] == pool["gpus"] >= 1
            assert "worker-cuda" in image
            assert spec["nodeSelector"]["nvidia.com/gpu.product"]
            assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
            assert "--device" in worker_args(deploy) and "cuda" in worker_args(deploy)
        else:
            assert "nvidia.com/gpu" not in limits and "worker-cpu" in image
        mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["RENDERFARM_CACHE_DIR"].startswith(mounts["model-cache"])
        assert env["HF_HOME"].startswith(mounts["model-cache"])


def test_three_pools_cover_h100_l4_cpu(render):
    products = {d["spec"]["template"]["spec"].get("nodeSelector", {}).get("nvidia.com/gpu.product", "cpu")
                for d in workers(render("three-pools"))}
    assert products == {"NVIDIA-H100-80GB-HBM3", "NVIDIA-L4", "cpu"}
    caches = {next(iter(d["spec"]["template"]["spec"]["volumes"][0].keys() - {"name"}))
              for d in workers(render("three-pools"))}
    assert caches == {"persistentVolumeClaim", "hostPath", "emptyDir"}

def test_model_cache_volume_types(render, helm):
    def volume(*sets: str) -> dict:
        args = [a for s in sets for a in ("--set", s)]
        docs = render("default", *args)
        spec = workers(docs)[0]["spec"]["template"]["spec"]
        return next(v for v in spec["volumes"] if v["name"] == "model-cache"), docs

    vol, _ = volume()
    assert "emptyDir" in vol
    vol, _ = volume("workerDefaults.modelCache.type=hostPath")
    assert vol["hostPath"]["path"] == "/var/lib/renderfarm/models"
    vol, docs = volume("workerDefaults.modelCache.type=pvc")
    claims = by_kind(docs, "PersistentVolumeClaim")
    assert [c["metadata"]["name"] for c in claims] == [vol["persistentVolumeClaim"]["claimName"]]
    vol, docs = volume("workerDefaults.modelCache.type=pvc", "workerDefaults.modelCache.existingClaim=models")
    assert vol["persistentVolumeClaim"]["claimName"] == "models" and not by_kind(docs, "PersistentVolumeClaim")


def test_pool_overrides_keep_zero_and_false(render):
    """A pool's explicit 0/false beats a non-zero default (sprig's merge would drop them)."""
    docs = render("default", "--set", "workerDefaults.autoscaling.minReplicas=2",
                  "--set", "pools[0].name=p", "--set", "pools[0].model=tiny",
                  "--set", "pools[0].autoscaling.minReplicas=0", "--set", "pools[0].pdb.enabled=false")
    assert by_kind(docs, "ScaledObject")[0]["spec"]["minReplicaCount"] == 0
    assert all("worker" not in p["metadata"]["name"] for p in by_kind(docs, "PodDisruptionBudget"))


def test_fixed_replicas_without_autoscaling(render):
    docs = render("default", "--set", "workerDefaults.autoscaling.enabled=false")
    assert not by_kind(docs, "ScaledObject")
    assert workers(docs)[0]["spec"]["replicas"] == 1


@pytest.mark.parametrize("bad, why", [
    ("Bad_Name", "'Bad_Name' does not match pattern '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
    ("x" * 41, "maxLength: got 41, want 40"),
    ("-lead", "'-lead' does not match pattern '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
])
def test_pool_names_must_be_dns_labels(helm, bad, why):
    """values.schema.json refuses them before any template runs (the templates' own "pool name"
    checks stay for a chart rendered without its schema, ``--skip-schema-validation``)."""
    out = run_helm(helm, "template", "farm", str(CHART), "--set", f"pools[0].name={bad}",
                   "--set", "pools[0].model=tiny", check=False)
    assert out.returncode == 1 and f"at '/pools/0/name': {why}" in out.stderr, out.stderr


def test_bundled_redis_has_aof_and_a_volume(render):
    docs = render("default")
    conf = next(c for c in by_kind(docs, "ConfigMap") if c["metadata"]["name"].endswith("-redis"))["data"]["redis.conf"]
    assert re.search(r"^appendonly yes$", conf, re.M) and re.search(r"^maxmemory-policy noeviction$", conf, re.M)
    # a full Redis refuses writes before the container's memory limit would kill it
    (sts,) = by_kind(docs, "StatefulSet")
    limit = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    assert re.search(r"^maxmemory 1200mb$", conf, re.M) and limit == "2Gi"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    mounts = sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts
    api = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-api"))
    env = {e["name"]: e.get("value") for e in api["spec"]["template"]["spec"]["containers"][0]["env"]}
    svc = next(s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-redis"))
    assert env["RENDERFARM_REDIS_URL"] == f"redis://:$(REDIS_PASSWORD)@{svc['metadata']['name']}:6379/0"


def test_external_redis_url_replaces_the_bundled_one(render):
    docs = render("default", "--set", "redis.url=redis://redis.example:6379/2")
    assert not by_kind(docs, "StatefulSet")
    for d in by_kind(docs, "Deployment"):
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["RENDERFARM_REDIS_URL"]["value"] == "redis://redis.example:6379/2"
    docs = render("default", "--set", "redis.urlSecret.name=redis-cred")
    env = {e["name"]: e for e in workers(docs)[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["RENDERFARM_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "redis-cred", "key": "redis-url"}


def test_broker_shards_reach_every_process_from_a_secret(render):
    docs = render("default", "--set", "redis.brokerShards.secretName=broker-shards")
    for d in by_kind(docs, "Deployment"):
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["RENDERFARM_BROKERS"] == {"name": "RENDERFARM_BROKERS", "valueFrom": {"secretKeyRef": {
            "name": "broker-shards", "key": "brokers.json"}}}, d["metadata"]["name"]
    docs = render("default")
    assert all("RENDERFARM_BROKERS" not in {e["name"] for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
               for d in by_kind(docs, "Deployment"))


def s3_secrets(docs: list[dict]) -> list[dict]:
    """The chart's Secrets other than the bundled Redis's password and the API's scrape token."""
    return [d for d in by_kind(docs, "Secret")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") not in ("redis", "api")]


def test_s3_credentials_come_from_a_secret(render):
    docs = render("default")
    assert not s3_secrets(docs)          # no keys given: the pod's IAM role
    docs = render("default", "--set", "s3.accessKeyId=AK", "--set", "s3.secretAccessKey=SK")
    (secret,) = s3_secrets(docs)
    assert secret["stringData"] == {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": "SK"}
    for d in by_kind(docs, "Deployment"):
        env = {e["name"]: e for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[key]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": key}
            assert "value" not in env[key]
    docs = render("three-pools")
    assert not s3_secrets(docs)
    env = {e["name"]: e for e in workers(docs)[0]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "renderfarm-s3"


def test_catalog_cronjob_runs_the_catalog_command(render):
    assert not by_kind(render("default"), "CronJob")
    (cron,) = by_kind(render("three-pools"), "CronJob")
    values = values_of("three-pools")["catalog"]
    assert cron["spec"]["schedule"] == "0 2 * * *" and cron["spec"]["concurrencyPolicy"] == "Forbid"
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["catalog", values["file"], "--template", values["template"],
                                 "--model", values["model"], "--report", values["report"]]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/catalog", "/reports"} <= mounts


def test_pods_run_as_non_root(render):
    for d in by_kind(render("three-pools"), "Deployment"):
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("setting", ["pools[0].maxReplica=3", "pools[0].deviceClass=gpu",
                                     "pools[0].autoscaling.trigger=redis"])
def test_values_schema_refuses_typos(helm, setting):
    out = run_helm(helm, "template", "farm", str(CHART), "--set", "pools[0].name=p", "--set", "pools[0].model=tiny",
                   "--set", setting, check=False)
    assert out.returncode != 0 and "schema" in out.stderr.lower() + out.stdout.lower()
