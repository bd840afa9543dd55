"""Image inputs through the real farm: uploads to SeaweedFS, the status API's checks, a ``tiny``
worker rendering txt2img, img2img and inpainting in one batch, and the bad-input table (each case
a clear 4xx, nothing recorded). The modes are checked on the infotext, on the pixels (an output
follows its init image; inpainting keeps the unmasked region) and on the denoising steps the
worker counted (strength sets them); an https input is fetched by the running API from a real
HTTPS server on loopback, with the private-address switch on, and refused with it off."""

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

from infra.localstack import ApiServer, WorkerProcess, free_port
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.input_images import InputRefused
from infra.submission.input_refs import fetch_url
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
    assert "the bytes are not an image Pillow can identify" in done[1].error.message, done[1].error


def _pixels(client: RenderClient, job) -> np.ndarray:
    """A succeeded job's image as float64 RGB, height × width × 3, values 0…255."""
    return np.asarray(Image.open(io.BytesIO(client.fetch_bytes(job))).convert("RGB"), dtype=np.float64)


def test_img2img_pixels_follow_the_init_image_and_strength_sets_the_steps(worker, env, http):
    """Same init image and seed: the same pixels; another init image: other pixels (a worker that
    ignored ``init_image`` would render the same txt2img image for all three). Strength sets the
    denoising steps the worker counted: ⌊4 × strength⌋ of 4 (diffusers' rule), txt2img all 4."""
    a, b = (upload(http, png(seed=s)).json()["key"] for s in (31, 32))
    follow = [_job(seed=7, init_image=key, strength=0.5) for key in (a, a, b)]
    strengths = (0.25, 0.75, 1.0)  # one job per strength: each renders alone, one pipeline call
    jobs = [*follow, _job(seed=7), *(_job(seed=7, init_image=a, strength=s) for s in strengths)]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        done = client.wait(client.submit_batch(jobs).batch_id, timeout=600)
        assert [j.state for j in done] == ["succeeded"] * len(jobs), [(j.state, j.error) for j in done]
        same, again, other = (_pixels(client, j) for j in done[:3])
        params = [parse_parameters(read_parameters(client.fetch_bytes(j)) or "") for j in done]
    assert np.array_equal(same, again), np.abs(same - again).max()
    # mean |difference| 0…255, measured in process on the tiny model (the worker's Renderer, these
    # two init images, strength 0.5, seeds 1–16): 0.82–1.34. Its autoencoder has random weights and
    # carries little of an image, so the change is small, but never 0; an ignored init image gives 0
    assert (diff := np.abs(same - other).mean()) > 0.2, f"another init image, mean |difference| {diff:.3f}"
    assert [j.result.denoising_steps for j in done[3:]] == [4, 1, 3, 4]
    assert [(p.get("Mode"), p.get("Denoising strength")) for p in params] == [
        *[("img2img", "0.5")] * 3, (None, None), *(("img2img", f"{s:g}") for s in strengths)]


INPAINT_SIZE = 128  # at 64 × 64 the latent is 8 × 8 and the tiny decoder mixes the two halves (margins overlap)


def _mask_png(*, half: bool) -> bytes:
    """INPAINT_SIZE² L-mode PNG: white (repaint) on the right half, or black all over (repaint nothing)."""
    mask = np.zeros((INPAINT_SIZE, INPAINT_SIZE), np.uint8)
    if half:
        mask[:, INPAINT_SIZE // 2:] = 255
    buf = io.BytesIO()
    Image.fromarray(mask).save(buf, "PNG")
    return buf.getvalue()


def inpaint_metrics(out: np.ndarray, reference: np.ndarray, photo: np.ndarray) -> dict[str, float]:
    """Mean |difference| (0…255 per channel) of ``out`` against ``reference`` and ``photo`` over the
    kept left half and the repainted right half (arrays height × width × 3)."""
    half = out.shape[1] // 2
    to_ref, to_photo = np.abs(out - reference), np.abs(out - photo)
    return {"ref_kept": to_ref[:, :half].mean(), "ref_repainted": to_ref[:, half:].mean(),
            "photo_kept": to_photo[:, :half].mean(), "photo_repainted": to_photo[:, half:].mean()}


def test_inpainting_keeps_the_unmasked_region(worker, env, http):
    """The right half is repainted, the left half kept. The tiny model's autoencoder has random
    weights, so even a kept region comes back as its reconstruction of the photo, not the photo:
    a job whose mask repaints nothing renders that reconstruction through the farm, and the kept
    half must stay close to it while the repainted half moves away. Measured in process on the
    tiny model (the worker's ``Renderer`` with these inputs and strength, seeds 1–16; mean
    |difference| 0…255): kept half vs the reconstruction 24.4–31.8, repainted half 50.1–55.1, a
    gap ≥ 19.0; against the photo (which no half is close to: the reconstruction is 70.0–71.0
    off it) repainted minus kept 11.4–13.3. A worker that dropped the mask (img2img) or the init
    image (txt2img) renders both jobs alike (gaps 0) and, against the photo, −2.3…+2.9. A third job
    inpaints another photo under the same mask: its kept half must differ from the first's (one that
    replaced the init image by a fixed grey one kept both halves alike and passed the checks above)."""
    photo, other = (upload(http, png(INPAINT_SIZE, INPAINT_SIZE, seed=s)).json()["key"] for s in (33, 34))
    half, nothing = (upload(http, _mask_png(half=h)).json()["key"] for h in (True, False))
    jobs = [_job(seed=5, width=INPAINT_SIZE, height=INPAINT_SIZE, init_image=image, mask_image=mask, strength=0.75)
            for image, mask in ((photo, half), (photo, nothing), (other, half))]
    with RenderClient(api_url=env["RENDERFARM_API_URL"]) as client:
        # the third job alone, after: each result's step count is then its own call's
        done = client.wait(client.submit_batch(jobs[:2]).batch_id, timeout=600)
        done += client.wait(client.submit_batch(jobs[2:]).batch_id, timeout=600)
        assert [j.state for j in done] == ["succeeded"] * 3, [(j.state, j.error) for j in done]
        inpainted, reconstruction, other_inpainted = (_pixels(client, j) for j in done)
        modes = [parse_parameters(read_parameters(client.fetch_bytes(j)) or "").get("Mode") for j in done]
    source = np.asarray(Image.open(io.BytesIO(png(INPAINT_SIZE, INPAINT_SIZE, seed=33))), dtype=np.float64)
    m = inpaint_metrics(inpainted, reconstruction, source)
    print("\ninpainting, mean |difference|:", {k: round(v, 1) for k, v in m.items()})
    assert m["ref_kept"] < 40 and m["ref_repainted"] - m["ref_kept"] > 10, m
    assert m["photo_repainted"] - m["photo_kept"] > 6, m
    # the kept half follows the photo: another photo under the same mask and seed keeps another half.
    # A worker that replaced the init image by anything fixed renders both bit for bit alike (the
    # farm's renders are deterministic: test_img2img's same-input jobs are equal), so any difference
    # shows the photo was used; measured 0.2 mean |difference| here (the tiny autoencoder carries
    # little of an image), exactly 0 with the init image replaced by a grey one
    kept_moves = np.abs(inpainted[:, :INPAINT_SIZE // 2] - other_inpainted[:, :INPAINT_SIZE // 2]).mean()
    print("kept half, photo 33 against photo 34:", round(kept_moves, 3))
    assert kept_moves > 0, "the kept half did not change with the photo: the init image was not used"
    assert modes == ["inpaint"] * 3 and [j.result.denoising_steps for j in done] == [3, 3, 3]


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
