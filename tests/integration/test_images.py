"""Image inputs through the real farm: uploads to SeaweedFS, the status API's checks, a ``tiny``
worker rendering txt2img, img2img and inpainting in one batch, and the bad-input table (each case
a clear 4xx, nothing recorded); an https input is fetched by the running API from a real HTTPS
server on loopback, with the private-address switch on, and refused with it off."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from infra.api.inputs import fetch_url
from infra.localstack import ApiServer, WorkerProcess, free_port
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.inputs import InputRefused
from producer import RenderClient
from producer.client import RenderFarmError

pytestmark = pytest.mark.integration
DB = 11
SIZE = 64
MAX_BYTES = 200_000
MAX_PIXELS = 1_000_000
LORAS = [{"name": "brand", "source": "tiny-lora-brand"}, {"name": "style", "source": "tiny-lora-style"}]


def png(width: int = SIZE, height: int = SIZE, *, seed: int = 0, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    rng = np.random.default_rng(seed)
    shape = (height, width, 3) if mode == "RGB" else (height, width)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def env(farm_env, redis_server) -> dict[str, str]:
    redis_server.client(DB).flushdb()
    return {**farm_env, "RENDERFARM_REDIS_URL": redis_server.db_url(DB),
            "RENDERFARM_API_URL": f"http://127.0.0.1:{free_port()}", "RENDERFARM_INPUT_MAX_BYTES": str(MAX_BYTES),
            "RENDERFARM_INPUT_MAX_PIXELS": str(MAX_PIXELS), "RENDERFARM_LORAS": json.dumps(LORAS)}


@pytest.fixture(scope="module")
def api(env, run_dir) -> Iterator[ApiServer]:
    with ApiServer(int(env["RENDERFARM_API_URL"].rsplit(":", 1)[1]), env, name="api-images", run_dir=run_dir) as s:
        yield s


@pytest.fixture(scope="module")
def http(api, env) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=env["RENDERFARM_API_URL"], timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def worker(start_worker, api, env) -> WorkerProcess:
    return start_worker("tiny", env, name="images-1")


def upload(http: httpx.Client, data: bytes, name: str = "f.png") -> httpx.Response:
    return http.post("/v1/uploads", files={"file": (name, data)})


def test_an_upload_answers_its_content_key_once(http, s3_server, env):
    data = png(seed=5)
    first, again = upload(http, data), upload(http, data, "other-name.png")
    assert first.status_code == again.status_code == 201, first.text
    body = first.json()
    assert body == again.json() and body["key"].startswith("inputs/") and body["key"].endswith(".png")
    assert (body["width"], body["height"], body["format"]) == (SIZE, SIZE, "PNG")
    stored = s3_server.client().get_object(Bucket=env["RENDERFARM_S3_BUCKET"], Key=body["key"])
    assert stored["Body"].read() == data and stored["Metadata"]["width"] == str(SIZE)


def _job(**fields) -> dict:
    return {"prompt": "a product photo", "model": "tiny", "width": SIZE, "height": SIZE, "num_inference_steps": 4,
            **fields}


def _bomb() -> bytes:  # 1,200 × 1,200 = 1.44 M pixels > MAX_PIXELS, a few KB compressed
    buf = io.BytesIO()
    Image.new("L", (1200, 1200)).save(buf, "PNG")
    return buf.getvalue()


def test_bad_inputs_get_a_clear_4xx_and_record_nothing(http, redis_server):
    photo = upload(http, png(seed=1)).json()["key"]
    wide = upload(http, png(SIZE * 2, SIZE, seed=2)).json()["key"]
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, "GIF")
    cases = {
        "not an image": (upload(http, b"%PDF-1.7 not an image"), 422, "not an image"),
        "decompression bomb": (upload(http, _bomb()), 422, "decompression-bomb"),
        "over the byte limit": (upload(http, png(400, 400, seed=3)), 413, "over the limit"),
        "unsupported format": (upload(http, gif.getvalue(), "a.gif"), 415, "GIF"),
        "mask size differs": (http.post("/v1/jobs", json=_job(init_image=photo, mask_image=wide)), 422, "same size"),
        "no such key": (http.post("/v1/jobs", json=_job(init_image="inputs/missing.png")), 422, "no image"),
        "private URL": (http.post("/v1/jobs", json=_job(init_image="https://127.0.0.1/photo.png")), 422,
                        "not a public address"),
        "http URL": (http.post("/v1/jobs", json=_job(init_image="http://example.com/photo.png")), 422, "https"),
        "unknown adapter": (http.post("/v1/jobs", json=_job(loras=[{"name": "nobody", "weight": 1}])), 422,
                            "no adapter 'nobody'"),
        "strength 0": (http.post("/v1/jobs", json=_job(init_image=photo, strength=0)), 422, "greater than 0"),
        "strength 1.5": (http.post("/v1/jobs", json=_job(init_image=photo, strength=1.5)), 422, "less than or equal"),
        "mode the family lacks": (http.post("/v1/jobs", json=_job(model="tiny-ernie-image", init_image=photo)), 422,
                                  "cannot render mode 'img2img'"),
    }
    table = {name: response.status_code for name, (response, _, _) in cases.items()}
    print("\nbad-input table:\n" + "\n".join(f"  {name:24} {code}" for name, code in table.items()))
    for name, (response, status, words) in cases.items():
        assert response.status_code == status, (name, response.text)
        assert words in response.text, (name, response.text)
    assert redis_server.client(DB).keys("rf:job:*") == []  # nothing was recorded


def test_every_mode_renders_in_one_batch(worker, env, tmp_path: Path):
    photo, mask = tmp_path / "photo.png", tmp_path / "mask.png"
    photo.write_bytes(png(80, 96, seed=7))  # any size: resized to the request's
    mask_px = np.zeros((96, 80), np.uint8)
    mask_px[:, 40:] = 255
    Image.fromarray(mask_px).save(mask)
    jobs = [_job(seed=1), _job(seed=2, init_image=photo, strength=0.5), _job(seed=3, init_image=str(photo)),
            _job(seed=4, init_image=photo, mask_image=mask, strength=0.75), _job(seed=5)]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        accepted = client.submit_batch(jobs)  # the client uploads the local files itself
        done = client.wait(accepted.batch_id, timeout=600)
        assert [j.state for j in done] == ["succeeded"] * len(jobs), [(j.state, j.error) for j in done]
        expected = [("txt2img", None), ("img2img", "0.5"), ("img2img", "0.8"), ("inpaint", "0.75"), ("txt2img", None)]
        for job, (mode, strength) in zip(done, expected):
            assert job.attempts == 1 and (job.result.width, job.result.height) == (SIZE, SIZE)
            params = parse_parameters(read_parameters(client.fetch_bytes(job)) or "")
            assert params.get("Mode", "txt2img") == mode and params.get("Denoising strength") == strength
            if mode != "txt2img":
                assert job.request.init_image == params["Init image"] and job.request.init_image.startswith("inputs/")
        with pytest.raises(RenderFarmError) as refused:
            client.upload(mask.with_suffix(".txt")) if mask.with_suffix(".txt").write_text("no") else None
        assert refused.value.status_code == 422


def test_a_batch_of_mixed_modes_and_adapters(worker, env, tmp_path: Path, http):
    photo = tmp_path / "photo.png"
    photo.write_bytes(png(seed=8))
    brand = [{"name": "brand", "weight": 0.8}]
    jobs = [_job(seed=1, loras=brand), _job(seed=2), _job(seed=3, init_image=photo, strength=0.5, loras=brand),
            _job(seed=4, loras=[{"name": "style", "weight": 0.5}, *brand]), _job(seed=5, init_image=photo),
            _job(seed=6, loras=brand)]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
        assert [(j.state, j.attempts) for j in done] == [("succeeded", 1)] * len(jobs), [j.error for j in done]
        params = [parse_parameters(read_parameters(client.fetch_bytes(j)) or "") for j in done]
    assert [p.get("Lora weights") for p in params] == ["brand: 0.8", None, "brand: 0.8", "style: 0.5, brand: 0.8",
                                                      None, "brand: 0.8"]
    hashes = [p.get("Lora hashes") for p in params]
    assert hashes[0] == hashes[2] == hashes[5] and len(hashes[0].split(": ")[1]) == 12
    assert hashes[3].startswith("style: ") and hashes[1] is None
    assert [p.get("Mode") for p in params] == [None, None, "img2img", None, "img2img", None]
    assert [item["name"] for item in http.get("/sdapi/v1/loras").json()] == ["brand", "style"]


def test_an_input_that_fails_at_the_worker_fails_its_job_alone(worker, env, http, s3_server):
    """An object whose metadata passes the API's check but whose bytes do not decode: the worker's
    group bisects, the bad job fails with the reason, its batch-mates succeed once."""
    photo = upload(http, png(seed=21)).json()["key"]
    s3_server.client().put_object(Bucket=env["RENDERFARM_S3_BUCKET"], Key="inputs/broken.png", Body=b"\x89PNG broken",
                                  Metadata={"width": str(SIZE), "height": str(SIZE)})
    jobs = [_job(seed=s, init_image=key, strength=0.5)
            for s, key in ((1, photo), (2, "inputs/broken.png"), (3, photo), (4, photo))]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
    assert [j.state for j in done] == ["succeeded", "failed", "succeeded", "succeeded"], [j.error for j in done]
    assert [j.attempts for j in done if j.state == "succeeded"] == [1, 1, 1]
    assert "not an image" in done[1].error.message or "decode" in done[1].error.message, done[1].error


@pytest.fixture(scope="module")
def private_api(env, run_dir, https_folder) -> Iterator[ApiServer]:
    """A second status API on the module's farm with RENDERFARM_INPUT_ALLOW_PRIVATE on, trusting
    the loopback site's certificate through its CA bundle (SSL_CERT_FILE); TLS stays verified."""
    extra = {"RENDERFARM_INPUT_ALLOW_PRIVATE": "true", "SSL_CERT_FILE": str(https_folder.cert)}
    with ApiServer(free_port(), {**env, **extra}, name="api-images-private", run_dir=run_dir) as s:
        yield s


def test_an_https_input_is_fetched_by_the_api_and_stored_by_its_sha256(worker, env, http, https_folder,
                                                                      private_api, s3_server, monkeypatch):
    data = png(seed=41)
    (https_folder.folder / "photo.png").write_bytes(data)
    url, digest = f"{https_folder.url}/photo.png", hashlib.sha256(data).hexdigest()
    refused = http.post("/v1/jobs", json=_job(init_image=url))  # the module's API: the switch is off
    assert refused.status_code == 422, refused.text
    assert "not a public address (loopback); set RENDERFARM_INPUT_ALLOW_PRIVATE=true" in refused.text
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # a CA bundle without the site's certificate
    with pytest.raises(InputRefused, match=r"fetching the image failed \(ConnectError\)"):
        fetch_url(url, max_bytes=MAX_BYTES, allow_private=True)
    with RenderClient(api_url=private_api.url) as client:
        [job] = client.wait(client.submit_batch([_job(seed=9, init_image=url, strength=0.5)]).batch_id, timeout=600)
        assert job.state == "succeeded", job.error
        params = parse_parameters(read_parameters(client.fetch_bytes(job)) or "")
    key = f"inputs/{digest}.png"
    assert job.request.init_image == key and (params["Mode"], params["Init image"]) == ("img2img", key)
    stored = s3_server.client().get_object(Bucket=env["RENDERFARM_S3_BUCKET"], Key=key)["Body"].read()
    assert hashlib.sha256(stored).hexdigest() == digest
