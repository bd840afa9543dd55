"""The unmodified ``webuiapi`` (AUTOMATIC1111's API client) and ``openai`` (the official SDK)
packages from PyPI against the session farm: real API, Redis, SeaweedFS and tiny-model workers.
The images they get back are the farm's own renders: the same pixels a RenderClient gets for
the same request, with an infotext naming the real sampler."""

from __future__ import annotations

import base64
import io
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from PIL import Image

from infra.api.auth import KeyStore
from infra.schemas import RenderRequest
from infra.storage.images import parse_parameters, read_parameters

pytestmark = pytest.mark.integration


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# -- webuiapi ----------------------------------------------------------------------------------------


def test_webuiapi_txt2img_renders_on_the_farm(webui, client):
    result = webui.txt2img(prompt="a lighthouse at dusk", negative_prompt="blurry", seed=1234, width=64, height=64,
                           steps=3, cfg_scale=6.5, sampler_name="DPM++ 2M", scheduler="Karras", batch_size=2,
                           n_iter=2)
    assert len(result.images) == 4 and all(im.size == (64, 64) for im in result.images)
    assert result.info["all_seeds"] == [1234, 1235, 1236, 1237] and result.info["sampler_name"] == "DPM++ 2M Karras"
    assert result.parameters["prompt"] == "a lighthouse at dusk" and result.parameters["n_iter"] == 2
    for seed, image, infotext in zip(result.info["all_seeds"], result.images, result.info["infotexts"]):
        assert image.info["parameters"] == infotext  # the PNG's own parameters chunk
        fields = parse_parameters(infotext)
        assert (fields["Sampler"], fields["Seed"], fields["Steps"], fields["CFG scale"], fields["Size"],
                fields["Model"]) == ("DPM++ 2M Karras", str(seed), "3", "6.5", "64x64", "tiny")
        assert fields["negative_prompt"] == "blurry"
    # the same request through the farm's own client renders the same pixels
    direct = client.submit_batch([RenderRequest(prompt="a lighthouse at dusk", negative_prompt="blurry", seed=1235,
                                                width=64, height=64, num_inference_steps=3, guidance_scale=6.5,
                                                scheduler="dpmpp_2m_karras", model="tiny")])
    [job] = client.wait(direct.batch_id, timeout=600)
    assert np.array_equal(_pixels(client.fetch_image(job)), _pixels(result.images[1]))
    jobs = [client.job(job_id) for job_id in result.info["job_ids"]]
    assert {j.request.scheduler for j in jobs} == {"dpmpp_2m_karras"} and {j.batch_id for j in jobs} == {
        result.info["batch_id"]}


def test_webuiapi_defaults_and_a_random_seed(webui):
    result = webui.txt2img(prompt="a teapot", seed=-1, width=64, height=64, steps=2, batch_size=3)
    seeds = result.info["all_seeds"]
    assert seeds == [seeds[0], seeds[0] + 1, seeds[0] + 2] and result.info["seed"] == seeds[0] >= 0
    assert [parse_parameters(t)["Sampler"] for t in result.info["infotexts"]] == ["Euler a"] * 3  # webuiapi's default


def test_a_request_without_a_sampler_names_the_models_own_scheduler(api_server, workers):
    response = httpx.post(f"{api_server.url}/sdapi/v1/txt2img", timeout=600,
                          json={"prompt": "a red fox", "width": 64, "height": 64, "steps": 2, "seed": 3})
    assert response.status_code == 200, response.text
    text = read_parameters(base64.b64decode(response.json()["images"][0]))
    assert parse_parameters(text)["Sampler"] == "DDIM", text  # the tiny model ships DDIM: never "Default"


def test_webuiapi_reads_models_samplers_and_progress(webui):
    assert "tiny" in webui.util_get_model_names()
    assert {"Euler a", "DPM++ 2M", "DDIM", "PLMS", "UniPC", "LMS"} <= set(webui.util_get_sampler_names())
    progress = webui.get_progress()
    assert 0 <= progress["progress"] <= 1 and "job_count" in progress["state"]
    with pytest.raises(RuntimeError) as refused:
        webui.txt2img(prompt="x", sampler_name="DPM adaptive", width=64, height=64, steps=2)
    assert refused.value.args[0] == 422 and "sampler_name" in refused.value.args[1]


# -- openai --------------------------------------------------------------------------------------------


def test_openai_sdk_b64_json(openai_client):
    response = openai_client.images.generate(model="tiny", prompt="a paper boat on a pond", n=2, size="64x64",
                                             response_format="b64_json", extra_body={"seed": 77, "steps": 3})
    assert response.size == "64x64" and response.output_format == "png" and len(response.data) == 2
    for seed, item in zip((77, 78), response.data):
        assert item.url is None
        data = base64.b64decode(item.b64_json)
        image = Image.open(io.BytesIO(data))
        assert image.format == "PNG" and image.size == (64, 64)
        fields = parse_parameters(read_parameters(data))
        assert (fields["Seed"], fields["Steps"], fields["prompt"]) == (str(seed), "3", "a paper boat on a pond")


def test_openai_sdk_url_is_a_presigned_get(openai_client):
    response = openai_client.images.generate(prompt="a paper boat", size="64x64", response_format="url",
                                             output_format="webp", extra_body={"steps": 2})
    [item] = response.data
    assert item.b64_json is None and "X-Amz-Signature=" in item.url
    fetched = httpx.get(item.url, timeout=30)
    assert fetched.status_code == 200 and Image.open(io.BytesIO(fetched.content)).format == "WEBP"


def test_openai_sdk_errors(openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.images.generate(prompt="x", size="100x100")
    assert (bad.value.param, bad.value.code, bad.value.type) == ("size", "invalid_value", "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as unsupported:
        openai_client.images.generate(prompt="x", style="vivid")
    assert unsupported.value.code == "unsupported_parameter" and unsupported.value.param == "style"
    with pytest.raises(openai.NotFoundError) as unknown:
        openai_client.images.generate(prompt="x", model="dall-e-3")
    assert unknown.value.code == "model_not_found"


def test_openai_sdk_bearer_is_the_farms_api_key(api_server, workers, redis_server):
    from openai import AuthenticationError, OpenAI

    _, key = KeyStore(redis_server.client()).create("bearer-tenant", name="openai sdk")
    with OpenAI(base_url=f"{api_server.url}/v1", api_key=key, max_retries=0) as sdk:
        response = sdk.images.generate(prompt="a bird", size="64x64", extra_body={"steps": 2})
    job_id = urlsplit(response.data[0].url).path.rsplit("/", 1)[-1].split(".")[0]
    as_tenant = httpx.get(f"{api_server.url}/v1/jobs/{job_id}", headers={"X-API-Key": key}, timeout=10)
    assert as_tenant.status_code == 200 and as_tenant.json()["state"] == "succeeded"
    assert httpx.get(f"{api_server.url}/v1/jobs/{job_id}", timeout=10).status_code == 404, "another tenant's job"
    with OpenAI(base_url=f"{api_server.url}/v1", api_key=key[:-4] + "abcd", max_retries=0) as sdk:
        with pytest.raises(AuthenticationError) as refused:
            sdk.images.generate(prompt="a bird", size="64x64")
    assert refused.value.code == "invalid_api_key"
