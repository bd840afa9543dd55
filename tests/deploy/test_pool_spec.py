"""The chart's pools reach the farm whole: every field of ``infra.pools.PoolSpec`` a pool sets in
the values (camelCase there) is in the rendered ``RENDERFARM_POOLS`` and parses into the same
PoolSpec the API and the workers build; the values schema checks each one and refuses a bad one."""

from __future__ import annotations

import json
import re

import pytest

from infra.pools import FAMILIES, PoolSpec
from tests.deploy.conftest import CHART, by_kind, run_helm

#: A pool declaring every optional PoolSpec field (as --set-json writes values).
FULL_POOL = {"name": "cpu-sd15", "model": "sd15-arch", "maxPixels": 65536, "maxBatch": 4,
             "family": "sd1", "steps": 20, "sPerMpxStep": 0.08, "usePe": True, "batchInvariant": False,
             "upscalers": ["esrgan-x4-arch", "owner/repo/RealESRGAN_x4plus.pth"],
             "loras": [{"name": "brand", "source": "s3://adapters/brand.safetensors"},
                       {"name": "style", "source": "owner/style-lora", "weight_name": "style.safetensors"}],
             "controls": [{"name": "canny", "source": "lllyasviel/control_v11p_sd15_canny"}], "maxControls": 2,
             "controlSets": [["canny"]], "broker": "gpu-b"}


def _declared(docs: list[dict]) -> list[PoolSpec]:
    (env,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-env")]
    return [PoolSpec(**p) for p in json.loads(env["data"]["RENDERFARM_POOLS"])]


def _camel(field: str) -> str:
    return re.sub(r"_([a-z])", lambda m: m.group(1).upper(), field)


def test_a_pool_declaring_upscalers_and_every_optional_field_passes_them_through(render):
    (spec,) = _declared(render("default", "--set-json", f"pools=[{json.dumps(FULL_POOL)}]"))
    assert spec.upscalers == ("esrgan-x4-arch", "owner/repo/RealESRGAN_x4plus.pth")
    assert [(a.name, a.source, a.weight_name) for a in spec.loras] == [
        ("brand", "s3://adapters/brand.safetensors", None), ("style", "owner/style-lora", "style.safetensors")]
    assert (spec.family, spec.steps, spec.s_per_mpx_step, spec.use_pe, spec.batch_invariant) == (
        "sd1", 20, 0.08, True, False)
    assert [(c.name, c.source) for c in spec.controls] == [("canny", "lllyasviel/control_v11p_sd15_canny")]
    assert spec.max_controls == 2 and spec.control_sets == (("canny",),) and spec.broker == "gpu-b"
    assert (spec.name, spec.model, spec.max_pixels, spec.max_batch, spec.queue) == (
        "cpu-sd15", "sd15-arch", 65536, 4, "renderfarm.cpu-sd15")


def test_optional_fields_left_unset_keep_poolspec_defaults(render):
    (spec,) = _declared(render())
    assert spec == PoolSpec(name="cpu-tiny", model="tiny", device_class="cpu", max_pixels=262144, max_batch=8)
    # null means "unset" too, and workerDefaults supply what a pool leaves out
    (spec,) = _declared(render("default", "--set-json", 'pools=[{"name": "p", "model": "tiny", "steps": null}]',
                               "--set-json", 'workerDefaults.upscalers=["tiny-esrgan-x2"]'))
    assert spec.steps is None and spec.upscalers == ("tiny-esrgan-x2",)


def test_the_schema_knows_every_poolspec_field():
    """A PoolSpec field added without its chart key would be refused by the schema (and dropped
    by the template): every field but the derived ``queue`` has a camelCase key, and ``family``
    allows exactly the known families."""
    pool = json.loads((CHART / "values.schema.json").read_text())["definitions"]["pool"]["properties"]
    assert {_camel(f) for f in PoolSpec.model_fields if f != "queue"} <= set(pool)
    assert set(pool["family"]["enum"]) == {None, *FAMILIES}
    template = (CHART / "templates" / "configmap-env.yaml").read_text()
    for field in PoolSpec.model_fields:
        assert f'"{field}"' in template, field


@pytest.mark.parametrize("pool", [{"upscalers": "esrgan-x4-arch"}, {"upscalers": [""]}, {"family": "sd4"},
                                  {"steps": 0}, {"steps": 151}, {"sPerMpxStep": 0}, {"usePe": "yes"},
                                  {"batchInvariant": "auto"}, {"maxControls": 9},
                                  {"controls": [{"name": "canny"}]}, {"controlSets": [[]]}])
def test_the_schema_refuses_a_bad_optional_field(helm, pool):
    values = json.dumps([{"name": "p", "model": "tiny", **pool}])
    out = run_helm(helm, "template", "farm", str(CHART), "--set-json", f"pools={values}", check=False)
    assert out.returncode != 0 and "schema" in out.stderr.lower(), out.stderr


def test_worker_probes_follow_the_state_file_the_worker_writes(render, tmp_path):
    """The startup and readiness probes pass exactly when the file the worker writes says ready:
    they run the probe command against a state file written by worker.warmup's StartupState
    through loading, sizing and warming."""
    import subprocess

    from worker.warmup import StartupState

    (deployment,) = [d for d in by_kind(render(), "Deployment") if "-worker-" in d["metadata"]["name"]]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    path = env["RENDERFARM_WORKER_STATE_FILE"]
    startup, readiness = container["startupProbe"], container["readinessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900  # startupSeconds' default
    for probe in (startup, readiness):
        command = probe["exec"]["command"]
        assert path in command
        local = [str(tmp_path / "state") if part == path else part for part in command]
        warm = StartupState(str(tmp_path / "state"))
        for state in ("sizing", "warming"):
            assert subprocess.run(local).returncode != 0  # loading, sizing, warming: not started, not ready
            warm.enter(state)
        assert subprocess.run(local).returncode != 0
        warm.ready({"seconds": 1.0})
        assert subprocess.run(local).returncode == 0


def test_max_batch_left_unset_is_the_workers_measured_batch(render):
    (spec,) = _declared(render("default", "--set-json", 'pools=[{"name": "p", "model": "tiny", "maxBatch": null, '
                                                        '"sizes": [[512, 512], [384, 512]], "guidanceScale": 0}]'))
    assert spec.max_batch is None
    assert spec.sizes == ((512, 512), (384, 512)) and spec.guidance_scale == 0
