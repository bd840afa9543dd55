"""The producer's RenderClient against the real API: ``submit`` sends its body as JSON, so one
render is accepted (the API reads the body as an object, not as a string)."""

from __future__ import annotations

from infra.schemas import RenderRequest
from producer.client import RenderClient


def test_submit_is_accepted_as_a_json_object(api_server, farm_env):
    with RenderClient(api_url=farm_env["RENDERFARM_API_URL"]) as client:
        from_dict = client.submit({"prompt": "a mug", "model": "tiny", "width": 64, "height": 64, "seed": 1})
        from_model = client.submit(RenderRequest(prompt="一个杯子", model="tiny", width=64, height=64, seed=2))
        assert from_dict.job_id != from_model.job_id
        assert client.status(from_model.job_id).request.prompt == "一个杯子"
