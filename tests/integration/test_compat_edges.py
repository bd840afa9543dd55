"""The compatible APIs' edges without a worker: validation in each API's own error shape, auth
and limits in that shape, the synchronous wait's timeout (jobs canceled, 504) and A1111's
progress. The ASGI app runs in-process on its own Redis database (7) of the session redis-server;
no worker serves it, so a valid render stays queued until the timeout."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from infra.api.auth import KeyStore
from infra.api.server import create_app
from infra.settings import Settings
from infra.state.job_store import JobStore

DB = 7
TIMEOUT_S = 0.6
RENDER = {"prompt": "a kite over a beach", "width": 64, "height": 64, "steps": 2}


def _app(redis_server, **overrides) -> TestClient:
    settings = Settings(redis_url=redis_server.db_url(DB), s3_endpoint_url="http://127.0.0.1:9", reaper_enabled=False,
                        webhooks_enabled=False, sync_timeout_s=TIMEOUT_S, **overrides)
    return TestClient(create_app(settings))


@pytest.fixture
def api(redis_server, redis_db):
    redis_db(DB)
    with _app(redis_server) as client:
        yield client


def _openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# -- AUTOMATIC1111 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, field, words", [
    ({"sampler_name": "DPM adaptive"}, "sampler_name", "not available on this farm"),
    ({"sampler_name": "Euler a", "scheduler": "karras"}, "scheduler", "no Karras schedule"),
    ({"enable_hr": True}, "enable_hr", "hires fix"),
    ({"restore_faces": True}, "restore_faces", "face restoration"),
    ({"alwayson_scripts": {"ADetailer": {"args": [{"ad_model": "face_yolov8n.pt"}]}}}, "alwayson_scripts",
     "an extension other than ControlNet"),
    ({"width": 100}, "width", "multiple of 8"),
    ({"steps": 0}, "steps", "greater than or equal to 1"),
    ({"batch_size": 20, "n_iter": 20}, "n_iter", "at most 100"),
    ({"prompt": "   "}, "prompt", "non-whitespace"),
    ({"override_settings": {"sd_model_checkpoint": "sdxl-unserved"}}, "override_settings", "not served"),
])
def test_txt2img_refuses_what_it_cannot_render_naming_the_field(api, redis_server, extra, field, words):
    response = api.post("/sdapi/v1/txt2img", json={**RENDER, **extra})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", field] and words in detail[0]["msg"], detail
    assert not redis_server.client(DB).keys("rf:job:*"), "nothing was submitted"


def test_txt2img_ignores_the_webui_fields_it_does_not_use(api):
    # what webuiapi sends by default, at its defaults: accepted (then it waits: no worker here)
    body = {**RENDER, "styles": [], "subseed": -1, "subseed_strength": 0.0, "eta": 1.0, "s_churn": 0,
            "tiling": False, "override_settings_restore_afterwards": True, "script_args": [], "alwayson_scripts": {},
            "sampler_index": "Euler a", "do_not_save_grid": False, "hr_scale": 2}
    response = api.post("/sdapi/v1/txt2img", json=body)
    assert response.status_code == 504 and response.json()["error"] == "SyncTimeout", response.text


def test_a_txt2img_that_times_out_cancels_its_jobs(api, redis_server):
    response = api.post("/sdapi/v1/txt2img", json={**RENDER, "batch_size": 2, "n_iter": 2, "seed": 5})
    assert response.status_code == 504
    body = response.json()
    assert set(body) == {"error", "detail", "body", "errors"} and f"{TIMEOUT_S:g} s" in body["detail"]
    store = JobStore(redis_server.client(DB))
    [batch] = store.recent_batches("public")
    assert batch.total == 4 and batch.counts["canceled"] == 4 and batch.done
    jobs = store.get_batch(batch.batch_id, limit=4).jobs
    assert [j.request.seed for j in jobs] == [5, 6, 7, 8]
    assert {j.request.scheduler for j in jobs} == {"default"}, "no sampler: the model's own scheduler"


def test_progress_covers_the_tenants_unfinished_batches(api):
    idle = api.get("/sdapi/v1/progress").json()
    assert idle["progress"] == 0 and idle["state"]["job_count"] == 0
    api.post("/v1/batches", json={"jobs": [{"prompt": f"a kite {i}", "width": 64, "height": 64} for i in range(3)]})
    busy = api.get("/sdapi/v1/progress").json()
    assert busy["state"]["job_count"] == 3 and busy["state"]["job_no"] == 0 and busy["progress"] == 0


def test_samplers_and_schedulers_lists(api):
    samplers = {s["name"]: s for s in api.get("/sdapi/v1/samplers").json()}
    assert {"Euler a", "DPM++ 2M", "DDIM", "PLMS", "UniPC"} <= set(samplers)
    assert samplers["DPM++ 2M"]["options"] == {"scheduler": "karras"}
    assert "k_dpmpp_2m" in samplers["DPM++ 2M"]["aliases"]
    assert [s["name"] for s in api.get("/sdapi/v1/schedulers").json()] == ["automatic", "uniform", "karras"]
    assert api.get("/sdapi/v1/sd-models").json()[0]["title"] == "tiny"


# -- OpenAI Images ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": "x", "size": "100x100"}, "size", "invalid_value"),
    ({"prompt": "x", "size": "big"}, "size", "invalid_value"),
    ({"prompt": "x", "n": 11}, "n", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": "x", "quality": "hd"}, "quality", "invalid_value"),
    ({"prompt": "x", "background": "transparent"}, "background", "invalid_value"),
    ({"prompt": "x", "stream": True}, "stream", "invalid_value"),
    ({"prompt": "x", "style": "vivid"}, "style", "unsupported_parameter"),
    ({"prompt": "x", "nonsense": 1}, "nonsense", "unknown_parameter"),
    ({"prompt": "x", "steps": 500}, "steps", "invalid_value"),
])
def test_images_refuses_bad_fields_in_openai_shape(api, redis_server, body, param, code):
    error = _openai_error(api.post("/v1/images/generations", json=body), 400)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert not redis_server.client(DB).keys("rf:job:*")


def test_images_unknown_model_and_broken_bodies(api):
    error = _openai_error(api.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3"}), 404)
    assert error["code"] == "model_not_found" and "tiny" in error["message"]
    error = _openai_error(api.post("/v1/images/generations", content=b"{not json",
                                   headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error"
    assert _openai_error(api.post("/v1/images/generations", json=["a list"]), 400)["code"] is None


def test_images_timeout_is_a_504_the_sdk_does_not_retry(api, redis_server):
    response = api.post("/v1/images/generations", json={"prompt": "a kite", "n": 2, "size": "64x64"})
    error = _openai_error(response, 504)
    assert error["code"] == "timeout" and response.headers["x-should-retry"] == "false"
    [batch] = JobStore(redis_server.client(DB)).recent_batches("public")
    assert batch.counts["canceled"] == 2


def test_auth_and_limits_answer_in_openai_shape(redis_server, redis_db):
    redis_db(DB)
    _, key = KeyStore(redis_server.client(DB)).create("acme")
    with _app(redis_server, auth_required=True, rate_limit_job_burst=3) as api:
        error = _openai_error(api.post("/v1/images/generations", json={"prompt": "x"}), 401)
        assert error["code"] == "invalid_api_key"
        bad = api.post("/v1/images/generations", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-123"})
        assert _openai_error(bad, 401)["code"] == "invalid_api_key", "with auth required, any bearer must be a key"
        too_many = api.post("/v1/images/generations", json={"prompt": "x", "n": 4},
                            headers={"Authorization": f"Bearer {key}"})
        assert _openai_error(too_many, 413)["code"] == "request_too_large"
        # the A1111 routes take the key as HTTP Basic auth's password, and keep FastAPI's shape
        assert api.get("/sdapi/v1/sd-models").status_code == 401
        assert api.get("/sdapi/v1/sd-models", auth=("user", key)).status_code == 200
        assert api.get("/sdapi/v1/sd-models", auth=("user", "wrong")).json() == {"detail": "invalid or revoked API key"}
    with _app(redis_server) as api:  # auth not required: a bearer that is no farm key is anonymous
        response = api.post("/v1/images/generations", json={"prompt": "x", "model": "nope"},
                            headers={"Authorization": "Bearer sk-anything"})
        assert _openai_error(response, 404)["code"] == "model_not_found"
        bad_key = api.post("/v1/images/generations", json={"prompt": "x"},
                           headers={"Authorization": "Bearer rf_0123456789ab_" + "x" * 40})
        assert _openai_error(bad_key, 401)["code"] == "invalid_api_key", "a farm-shaped key must be valid"
