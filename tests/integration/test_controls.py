"""ControlNet and IP-Adapter units through the real farm: SeaweedFS uploads, the status API's
checks, a ``tiny`` worker with offline tiny ControlNets and an offline tiny IP-Adapter
(``RENDERFARM_CONTROLS``), and the real ``webuiapi`` client's ``ControlNetUnit`` on the A1111 front
door. The bad-unit table: each case a clear 4xx naming its
field, nothing recorded. The renders: weight 0 is the plain image within 1/255, another control
image another image, the control maps stored beside the image, the units in the PNG infotext."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from infra.localstack import ApiServer, WorkerProcess, free_port
from infra.storage.images import parse_parameters, read_parameters
from producer import RenderClient
from tests.control_images import shapes

pytestmark = pytest.mark.integration
DB = 10
SIZE = 64
CONTROLS = [{"name": "canny", "source": "tiny-controlnet-canny"}, {"name": "depth", "source": "tiny-controlnet-depth"},
            {"name": "style", "source": "tiny-ip-adapter-style", "kind": "ip-adapter"}]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_CONTROLS": json.dumps(CONTROLS)}


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-controls", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def http(api, env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env["RENDERFARM_API_URL"], timeout=600) as client:
        yield client


@pytest.fixture(scope="module")
def worker(start_worker, api, env) -> WorkerProcess:
    return start_worker("tiny", env, name="controls-1")


@pytest.fixture(scope="module")
def keys(http) -> dict[str, str]:
    """Object keys of two control images, uploaded."""
    return {name: http.post("/v1/uploads", files={"file": (f"{name}.png", png(shapes(seed)))}).json()["key"]
            for name, seed in (("a", 1), ("b", 7))}


def _job(*units: dict, **fields) -> dict:
    return {"prompt": "a bottle on a beach", "model": "tiny", "width": SIZE, "height": SIZE,
            "num_inference_steps": 3, "seed": 5, "controls": list(units), **fields}


def test_bad_units_get_a_clear_4xx_and_record_nothing(http, keys, redis_server):
    a = keys["a"]
    canny = {"type": "canny", "image": a}
    not_image = http.post("/v1/uploads", files={"file": ("x.png", b"%PDF-1.7 not an image")})
    bomb = io.BytesIO()  # 4,200 × 4,200 = 17.6 M pixels > RENDERFARM_INPUT_MAX_PIXELS (4096²), 17 KB compressed
    Image.new("L", (4200, 4200)).save(bomb, "PNG")
    bomb_upload = http.post("/v1/uploads", files={"file": ("bomb.png", bomb.getvalue())})
    cases = {
        "unknown type": (_job({**canny, "type": "pose"}), "no ControlNet or IP-Adapter 'pose'"),
        "two IP-Adapter units": (_job({"type": "style", "image": a}, {"type": "style", "image": a}),
                                 "at most one IP-Adapter unit per request"),
        "more units than allowed": (_job(canny, canny, canny, canny), "at most 3 control unit(s)"),
        "weight out of range": (_job({**canny, "weight": 2.5}), "less than or equal to 2"),
        "guidance_start > guidance_end": (_job({**canny, "guidance_start": 0.9, "guidance_end": 0.1}),
                                          "guidance_start (0.9) must be at most guidance_end (0.1)"),
        "unknown preprocessor": (_job({**canny, "preprocess": "openpose"}), "'none' or 'canny'"),
        "no such control image": (_job({**canny, "image": "inputs/missing.png"}), "no image"),
        "private URL": (_job({**canny, "image": "https://127.0.0.1/edges.png"}), "not a public address"),
        "family without ControlNet": (_job(canny, model="tiny-ernie-image"),
                                      "has no ControlNet pipeline for mode 'txt2img'"),
        "SD3 img2img with a unit": (_job(canny, model="tiny-sd3", init_image=a),
                                    "has no ControlNet pipeline for mode 'img2img'"),
        "IP-Adapter on FLUX.1": (_job({"type": "style", "image": a}, model="tiny-flux"),
                                 "takes no IP-Adapter units"),
    }
    table = {name: http.post("/v1/jobs", json=body) for name, (body, _) in cases.items()}
    print("\nbad-unit table:\n" + "\n".join(f"  {name:32} {r.status_code}" for name, r in table.items())
          + f"\n  {'control image not an image':32} {not_image.status_code}"
          + f"\n  {'control image a bomb':32} {bomb_upload.status_code}")
    for name, (_, words) in cases.items():
        assert table[name].status_code == 422, (name, table[name].text)
        assert words in table[name].text, (name, table[name].text)
        assert "controls" in table[name].text, (name, table[name].text)  # the field is named
    assert not_image.status_code == 422 and "not an image" in not_image.text
    assert bomb_upload.status_code == 422 and "decompression-bomb" in bomb_upload.text
    assert redis_server.client(DB).keys("rf:job:*") == []  # nothing was recorded


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)


def test_units_render_through_the_farm(worker, env, keys, s3_server, tmp_path):
    a, b = keys["a"], keys["b"]
    local_b = tmp_path / "b.png"  # the client uploads a local control image itself: the same key as b
    local_b.write_bytes(png(shapes(7)))
    jobs = [_job(), _job({"type": "canny", "image": a, "weight": 0.0}),
            _job({"type": "canny", "image": a, "preprocess": "canny", "weight": 0.8}),
            _job({"type": "canny", "image": local_b, "preprocess": "canny", "weight": 0.8}),
            _job({"type": "canny", "image": a, "preprocess": "canny", "low_threshold": 50},
                 {"type": "depth", "image": b, "guidance_end": 0.5}),
            _job(init_image=b, mask_image=a), _job({"type": "canny", "image": a}, init_image=b, mask_image=a)]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
        assert [(j.state, j.attempts) for j in done] == [("succeeded", 1)] * len(jobs), [j.error for j in done]
        images = [client.fetch_bytes(j) for j in done]
    plain, zero, edges_a, edges_b, two, inpainted, inpainted_unit = (_pixels(data) for data in images)
    assert np.abs(inpainted_unit - inpainted).mean() > 0.5  # inpaint with a unit: the unit counts
    assert np.abs(zero - plain).max() <= 1.0, np.abs(zero - plain).max()  # weight 0: the plain render
    assert np.abs(edges_a - edges_b).mean() > 0.5, np.abs(edges_a - edges_b).mean()  # only the image differs
    assert np.abs(edges_a - plain).mean() > 0.5
    params = [parse_parameters(read_parameters(data) or "") for data in images]
    assert "ControlNet 0" not in params[0]
    assert params[2]["ControlNet 0"].startswith("Module: canny, Model: canny, Weight: 0.8, Resize Mode: Just Resize, "
                                                "Threshold A: 100, Threshold B: 200")
    assert params[4]["ControlNet 1"].startswith("Module: none, Model: depth, Weight: 1")
    assert done[0].result.control_maps is None and done[3].request.controls[0].image == b
    s3 = s3_server.client()
    for job, count in zip(done[1:], (1, 1, 1, 2)):
        assert job.result.control_maps == [f"{job.batch_id}/{job.job_id}.control-{n}.png" for n in range(count)]
        assert job.result.preprocess_s is not None and job.result.preprocess_s > 0
    stored = s3.get_object(Bucket=env["RENDERFARM_S3_BUCKET"], Key=done[2].result.control_maps[0])["Body"].read()
    edges = np.asarray(Image.open(io.BytesIO(stored)))
    assert edges.shape == (SIZE, SIZE, 3) and set(np.unique(edges)) <= {0, 255} and edges.max() == 255


@pytest.fixture(scope="module")
def webui(api, worker):
    import webuiapi

    url = urlsplit(api.url)
    return webuiapi.WebUIApi(host=url.hostname, port=url.port)


def test_webuiapi_controlnet_units(webui, http):
    from webuiapi import ControlNetUnit

    assert webui.controlnet_model_list() == ["canny", "depth", "style"]
    assert webui.controlnet_module_list()[:2] == ["none", "canny"] and "ip-adapter_clip_sd15" in \
        webui.controlnet_module_list()
    units = [ControlNetUnit(image=shapes(1), module="canny", model="canny [d14c016b]", weight=0.8,
                            resize_mode="Just Resize", threshold_a=50, threshold_b=150, pixel_perfect=True),
             ControlNetUnit(image=shapes(7), module="none", model="depth", guidance_end=0.5)]
    result = webui.txt2img(prompt="a bottle on a beach", seed=9, width=SIZE, height=SIZE, steps=3,
                           controlnet_units=units)
    assert len(result.images) == 1 and result.images[0].size == (SIZE, SIZE)
    fields = parse_parameters(result.info["infotexts"][0])
    print("\nwebuiapi txt2img with two ControlNet units, infotext:\n  " + result.info["infotexts"][0])
    assert fields["ControlNet 0"].startswith("Module: canny, Model: canny, Weight: 0.8, Resize Mode: Just Resize, "
                                             "Threshold A: 50, Threshold B: 150")
    assert fields["ControlNet 1"].startswith("Module: none, Model: depth, Weight: 1, Resize Mode: Resize and Fill")
    disabled = webui.txt2img(prompt="a bottle on a beach", seed=9, width=SIZE, height=SIZE, steps=3,
                             controlnet_units=[ControlNetUnit(image=shapes(1), model="canny", enabled=False)])
    assert "ControlNet 0" not in parse_parameters(disabled.info["infotexts"][0])


def test_ip_adapter_units_through_the_farm_and_the_a1111_door(worker, env, keys, webui, s3_server):
    from webuiapi import ControlNetUnit

    a, b = keys["a"], keys["b"]
    jobs = [_job(), _job({"type": "style", "image": a}), _job({"type": "style", "image": b}),
            _job({"type": "style", "image": a, "weight": 0.0}),
            _job({"type": "canny", "image": b, "preprocess": "canny"}, {"type": "style", "image": a})]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
        assert [j.state for j in done] == ["succeeded"] * len(jobs), [j.error for j in done]
        plain, style_a, style_b, zero, both = (_pixels(client.fetch_bytes(j)) for j in done)
    assert np.abs(style_a - style_b).mean() > 0.5 and np.abs(style_a - plain).mean() > 0.5  # the reference steers it
    assert np.abs(zero - plain).max() <= 1.0  # weight 0: the plain render
    assert np.abs(both - style_a).mean() > 0.5  # with a ControlNet unit too
    s3 = s3_server.client()
    reference = s3.get_object(Bucket=env["RENDERFARM_S3_BUCKET"], Key=done[1].result.control_maps[0])["Body"].read()
    assert Image.open(io.BytesIO(reference)).size == (SIZE, SIZE) and len(done[4].result.control_maps) == 2
    unit = ControlNetUnit(image=shapes(1), module="ip-adapter_clip_sd15", model="style [0123abcd]", weight=0.9)
    result = webui.txt2img(prompt="a bottle on a beach", seed=9, width=SIZE, height=SIZE, steps=3,
                           controlnet_units=[unit])
    fields = parse_parameters(result.info["infotexts"][0])
    assert fields["ControlNet 0"].startswith("Module: none, Model: style, Weight: 0.9"), fields


@pytest.mark.parametrize(("unit", "field", "words"), [
    ({"module": "depth_midas"}, "module", "preprocessor 'depth_midas' is not available"),
    ({"model": "style", "module": "canny", "pixel_perfect": True}, "alwayson_scripts",
     "preprocess must be 'none', not 'canny'"),
    ({"model": "pose"}, "alwayson_scripts", "no ControlNet or IP-Adapter 'pose'"),
    ({"model": "None"}, "model", "name a ControlNet"),
    ({"control_mode": "ControlNet is more important"}, "control_mode", "only Balanced"),
    ({"module": "canny", "processor_res": 512}, "processor_res", "send 64, -1 or pixel_perfect true"),
    ({"guessmode": True}, "guessmode", "guessmode is not available"),
    ({"weight": 3}, "weight", "less than or equal to 2"),
    ({"resize_mode": "Outer Fit Plus"}, "resize_mode", "Just Resize, Crop and Resize or Resize and Fill"),
])
def test_a_unit_the_farm_cannot_honour_is_a_422_naming_the_field(http, unit, field, words):
    from webuiapi import ControlNetUnit

    args = {**ControlNetUnit(image=shapes(1), model="canny").to_dict(), **unit}
    for key in ("controlnet", "ControlNet", "controlNet"):
        response = http.post("/sdapi/v1/txt2img", json={"prompt": "a bottle", "width": SIZE, "height": SIZE,
                                                        "steps": 2, "alwayson_scripts": {key: {"args": [args]}}})
        assert response.status_code == 422, response.text
        assert field in json.dumps(response.json()["detail"][0]["loc"]) and words in response.text, response.text


def test_a_catalog_with_control_images_runs_twice_and_renders_nothing_the_second_time(worker, env, tmp_path):
    from producer.catalog import run_catalog

    for i in range(2):
        shapes(i + 2).save(tmp_path / f"edges{i}.png")
    (tmp_path / "products.csv").write_text("id,name,control_image,control_type,control_preprocess\n"
                                           "bottle,a bottle,edges0.png,canny,canny\n"
                                           "vase,a vase,edges1.png,depth,\nmug,a mug,,,\n", encoding="utf-8")
    params = {"width": SIZE, "height": SIZE, "num_inference_steps": 3}
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        reports = [run_catalog(tmp_path / "products.csv", "{name} on a beach", client=client, model="tiny",
                               params=params, poll_s=0.3) for _ in range(2)]
        first, second = reports
        print(f"\ncatalog with control_image: first run rendered {first['rendered']}, second run rendered "
              f"{second['rendered']} (skipped {second['skipped']})")
        assert (first["rendered"], first["failed"]) == (3, 0), first["failures"]
        assert (second["rendered"], second["skipped"], second["failed"]) == (0, 3, 0)
        by_id = {m["id"]: m for m in first["manifest"]}
        assert by_id["bottle"]["inputs"]["control_image"].startswith("inputs/") and "inputs" not in by_id["mug"]
        job = client.job(by_id["bottle"]["job_id"])
        assert parse_parameters(read_parameters(client.fetch_bytes(job)) or "")["ControlNet 0"].startswith(
            "Module: canny, Model: canny")


def test_openai_images_edit_takes_a_unit_as_multipart_fields(worker, http):
    import base64

    files = {"image": ("photo.png", png(shapes(4)), "image/png"), "control_image": ("edges.png", png(shapes(1)))}
    fields = {"prompt": "a bottle on a beach", "model": "tiny", "size": f"{SIZE}x{SIZE}", "response_format": "b64_json",
              "steps": "3", "control_type": "canny", "control_preprocess": "canny", "control_weight": "0.7"}
    response = http.post("/v1/images/edits", files=files, data=fields)
    assert response.status_code == 200, response.text
    text = read_parameters(base64.b64decode(response.json()["data"][0]["b64_json"])) or ""
    assert parse_parameters(text)["ControlNet 0"].startswith("Module: canny, Model: canny, Weight: 0.7")
    assert parse_parameters(text)["Mode"] == "img2img"
    missing = http.post("/v1/images/edits", files=files, data={k: v for k, v in fields.items() if k != "control_type"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "control_type", missing.text
