"""Declared pools (``RENDERFARM_POOLS`` as the Helm chart writes it), routing a request to a pool,
and the worker's start-up check of ``--pool``/``--model``. No Redis needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from infra import keys
from infra.pools import (
    OFFLINE_UPSCALERS,
    PoolConfigError,
    PoolSpec,
    pool_for_model,
    worker_pool,
)
from infra.routing import NoPoolError, Router
from infra.schemas import RenderRequest
from infra.settings import Settings

#: Exactly what deploy/helm/renderfarm/templates/configmap-env.yaml renders (keys and types).
CHART_POOLS = [
    {"name": "h100-sdxl", "model": "sdxl", "device_class": "cuda", "max_pixels": 1048576, "max_batch": 16,
     "queue": "renderfarm.h100-sdxl"},
    {"name": "l4-sdxl", "model": "sdxl", "device_class": "cuda", "max_pixels": 262144, "max_batch": 8,
     "queue": "renderfarm.l4-sdxl"},
    {"name": "l4-sdxl-b", "model": "sdxl", "device_class": "cuda", "max_pixels": 262144, "max_batch": 8,
     "queue": "renderfarm.l4-sdxl-b"},
    {"name": "cpu-tiny", "model": "tiny", "device_class": "cpu", "max_pixels": 65536, "max_batch": 8,
     "queue": "renderfarm.cpu-tiny"},
]


ROOT = Path(__file__).resolve().parents[3]


def _req(model: str, width: int = 512, height: int = 512) -> RenderRequest:
    return RenderRequest(prompt="p", model=model, width=width, height=height)


def test_settings_read_the_charts_json(monkeypatch):
    monkeypatch.setenv("RENDERFARM_POOLS", json.dumps(CHART_POOLS))
    pools = Settings().pools
    assert [p.name for p in pools] == [p["name"] for p in CHART_POOLS]
    assert pools[0] == PoolSpec(**CHART_POOLS[0]) and pools[0].queue == keys.queue("h100-sdxl")
    monkeypatch.setenv("RENDERFARM_POOLS", "")
    assert Settings().pools == []


@pytest.mark.parametrize("bad,needle", [
    ({"name": "a", "model": "m", "queue": "renderfarm.b"}, "queue must be 'renderfarm.a'"),
    ({"name": "A:b", "model": "m"}, "pool name"),
    ({"name": "a", "model": "m", "max_pixels": 0}, "max_pixels"),
    ({"name": "a", "model": "m", "max_batch": 0}, "max_batch"),
    ({"name": "a", "model": "m", "max_pixel": 5}, "max_pixel"),  # a typo is an error, not ignored
])
def test_invalid_pool_declarations_are_refused(bad, needle):
    with pytest.raises(ValidationError) as info:
        Settings(pools=[bad])
    assert needle in str(info.value)


def test_a_pool_declared_twice_is_refused():
    with pytest.raises(ValidationError, match="declared twice"):
        Settings(pools=[{"name": "a", "model": "m"}, {"name": "a", "model": "n"}])


def test_routing_picks_the_smallest_pool_that_fits_then_the_first_declared():
    router = Router([PoolSpec(**p) for p in CHART_POOLS])
    assert router.pool_for("sdxl", 512, 512) == "l4-sdxl"       # fits both: the smaller; ties: first declared
    assert router.pool_for("sdxl", 1024, 1024) == "h100-sdxl"   # only the large pool fits
    assert router.pool_for("tiny", 256, 256) == "cpu-tiny"


def test_unroutable_requests_name_the_model_or_the_size_and_the_job_index():
    router = Router([PoolSpec(**p) for p in CHART_POOLS])
    with pytest.raises(NoPoolError) as info:
        router.route_all([_req("sdxl"), _req("nope"), _req("tiny", 512, 512), _req("sdxl", 2048, 1024)])
    errors = info.value.errors
    assert [e["index"] for e in errors] == [1, 2, 3]
    assert errors[0]["type"] == "no_pool_for_model" and errors[0]["field"] == "model" and "'nope'" in errors[0]["msg"]
    assert errors[1]["type"] == "over_max_pixels" and errors[1]["field"] is None
    assert "262,144 pixels is over max_pixels 65,536 of pool 'cpu-tiny'" in errors[1]["msg"]
    assert "max_pixels 1,048,576 of pool 'h100-sdxl'" in errors[2]["msg"]


def test_without_declared_pools_each_model_is_its_own_pool_of_any_size():
    router = Router([])
    assert router.route_all([_req("stabilityai/sd-turbo", 2048, 2048), _req("tiny")]) == [
        pool_for_model("stabilityai/sd-turbo"), "tiny"]


def test_worker_pool_check():
    pools = [PoolSpec(**p) for p in CHART_POOLS]
    assert worker_pool([], "anything", "tiny") is None
    assert worker_pool(pools, "l4-sdxl", "sdxl").max_batch == 8
    assert worker_pool(pools, None, "tiny").name == "cpu-tiny"
    with pytest.raises(PoolConfigError, match="declared with model 'sdxl'.*--model 'tiny'"):
        worker_pool(pools, "l4-sdxl", "tiny")
    with pytest.raises(PoolConfigError, match="not declared"):
        worker_pool(pools, "a100", "sdxl")
    with pytest.raises(PoolConfigError, match="--pool is required"):
        worker_pool(pools, None, "sdxl")


def test_worker_refuses_to_start_on_a_pool_declared_with_another_model(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "RENDERFARM_POOLS": json.dumps(CHART_POOLS),
           "RENDERFARM_REDIS_URL": "redis://127.0.0.1:9/0", "RENDERFARM_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "infra.cli", "worker", "--model", "null", "--pool", "cpu-tiny"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "pool 'cpu-tiny' is declared with model 'tiny'" in run.stderr and "--model 'null'" in run.stderr


def test_the_charts_rendered_pools_are_what_settings_and_workers_read():
    """The chart's RENDERFARM_POOLS parses into Settings, and every worker Deployment it renders
    (``--model``, ``--pool``) passes the worker's start-up check and consumes its pool's queue."""
    helm = Path(sys.executable).parent / "helm"
    if not helm.exists():
        pytest.skip("helm is not installed (make helm-tools)")
    out = subprocess.run([str(helm), "template", "farm", str(ROOT / "deploy/helm/renderfarm"), "-f",
                          str(ROOT / "deploy/helm/values-three-pools.yaml")], capture_output=True, text=True,
                         check=True, timeout=120, env={**os.environ, "HELM_CACHE_HOME": "/tmp/rf-helm/cache",
                                                       "HELM_CONFIG_HOME": "/tmp/rf-helm/config",
                                                       "HELM_DATA_HOME": "/tmp/rf-helm/data"}).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    env = next(d["data"] for d in docs if d["kind"] == "ConfigMap" and "RENDERFARM_POOLS" in d.get("data", {}))
    pools = Settings(pools=env["RENDERFARM_POOLS"]).pools
    deployments = [d for d in docs if d["kind"] == "Deployment" and "renderfarm.io/queue" in d["metadata"]
                   .get("annotations", {})]
    assert len(pools) == len(deployments) == 3
    for deployment in deployments:
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        spec = worker_pool(pools, args[args.index("--pool") + 1], args[args.index("--model") + 1])
        assert spec.queue == deployment["metadata"]["annotations"]["renderfarm.io/queue"]


def test_an_upscaler_the_pool_lacks_is_refused_and_only_the_diffusion_size_counts():
    pools = [PoolSpec(name="cpu-tiny", model="tiny", max_pixels=256 * 256, upscalers=("tiny-esrgan-x4",))]
    router = Router(pools)
    ok = RenderRequest(prompt="a", model="tiny", width=256, height=256, upscale=4, upscaler="tiny-esrgan-x4")
    assert router.route_all([ok]) == ["cpu-tiny"]  # 1024² upscaled, 256² diffused: within max_pixels
    bad = ok.model_copy(update={"upscaler": "esrgan-x4-arch"})
    with pytest.raises(NoPoolError) as info:
        router.route_all([ok, bad])
    error = info.value.errors[0]
    assert error["index"] == 1 and error["type"] == "unknown_upscaler" and error["field"] == "upscaler"
    assert "has no upscaler 'esrgan-x4-arch'" in error["msg"]


def test_without_declared_pools_only_the_allowed_upscalers_are_accepted():
    """No pool declared: a request may name only RENDERFARM_UPSCALERS (default: the offline builds),
    never a hub file the worker would download on request."""
    offline = RenderRequest(prompt="a", model="tiny", width=64, height=64, upscale=4, upscaler="tiny-esrgan-x4")
    hub = offline.model_copy(update={"upscaler": "owner/repo/RealESRGAN_x4plus.pth"})
    alias = offline.model_copy(update={"upscaler": "sd-x4-upscaler"})  # an alias of a hub id: downloads too
    assert Router([]).route_all([offline]) == ["tiny"]
    with pytest.raises(NoPoolError) as info:
        Router([]).route_all([offline, hub, alias])
    assert [e["index"] for e in info.value.errors] == [1, 2]
    error = info.value.errors[0]
    assert error["type"] == "unknown_upscaler" and error["field"] == "upscaler"
    assert error["input"] == "owner/repo/RealESRGAN_x4plus.pth" and "RENDERFARM_UPSCALERS" in error["msg"]
    own = Router([], upscalers=["/models/RealESRGAN_x4plus.pth"])
    assert own.route_all([offline.model_copy(update={"upscaler": "/models/RealESRGAN_x4plus.pth"})]) == ["tiny"]
    with pytest.raises(NoPoolError, match="RENDERFARM_UPSCALERS"):
        own.route_all([offline])
    with pytest.raises(NoPoolError, match="it has: none"):
        Router([], upscalers=()).route_all([offline])


def test_the_upscalers_setting():
    assert Settings().upscaler_names == OFFLINE_UPSCALERS
    assert Settings(upscalers=" /models/a.pth, ,tiny-esrgan-x4,/models/a.pth").upscaler_names == (
        "/models/a.pth", "tiny-esrgan-x4")
    assert Settings(upscalers="").upscaler_names == ()


def test_upscale_and_upscaler_go_together():
    with pytest.raises(ValidationError, match="go together"):
        RenderRequest(prompt="a", upscale=2)
    with pytest.raises(ValidationError, match="go together"):
        RenderRequest(prompt="a", upscaler="tiny-esrgan-x4")
    with pytest.raises(ValidationError):
        RenderRequest(prompt="a", upscale=3, upscaler="tiny-esrgan-x4")
