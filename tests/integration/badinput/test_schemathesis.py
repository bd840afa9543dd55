"""schemathesis against the live status API's ``/openapi.json``: every operation with generated
valid and invalid input (positive and negative modes), then stateful sequences along the links
schemathesis infers (submit → read / cancel the job or batch it returned). The one assertion:
no response is a 5xx.

The API under test is its own farm on Redis database 1 (apart from the session's workers): auth
required (a key for tenant ``fuzz``), no rate limits, one declared pool (``fuzz-null``, the
``null`` model, the default model) and one ``null``-model worker serving it. A generated request
for any other model is a 422 at submit; one the pool can serve is rendered, so the compatible
APIs' synchronous routes (A1111's txt2img, OpenAI's images/generations) answer with real images
instead of timing out, and no operation is exempt from the check.
A summary (cases per operation, status codes) is printed at the end of the run and written to
``<run dir>/schemathesis-summary.json``.
"""

from __future__ import annotations

import collections
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from infra.api.auth import KeyStore
from infra.api.server import create_app
from infra.localstack import ApiServer, WorkerProcess, free_port, start_workers
from infra.settings import Settings

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 40
STATEFUL_EXAMPLES = 25
TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


POOLS = [{"name": "fuzz-null", "model": "null", "max_batch": 8}]


@pytest.fixture(scope="module")
def fuzz_api(farm_env, run_dir, redis_server, request):
    redis_url = redis_server.db_url(1)
    redis_server.client(db=1).flushdb()
    env = {**farm_env, "RENDERFARM_REDIS_URL": redis_url, "RENDERFARM_AUTH_REQUIRED": "true",
           "RENDERFARM_RATE_LIMIT_REQUESTS_PER_S": "0", "RENDERFARM_RATE_LIMIT_JOBS_PER_S": "0",
           "RENDERFARM_POOLS": json.dumps(POOLS), "RENDERFARM_DEFAULT_MODEL": "null",
           "RENDERFARM_SYNC_TIMEOUT_S": "120"}
    worker = WorkerProcess("null", env, "fuzz-null-1", 8, run_dir=run_dir)
    with ApiServer(free_port(), env, name="api-fuzz", run_dir=run_dir) as server:
        start_workers([worker])
        try:
            _, key = KeyStore(redis_server.client(db=1)).create("fuzz", name="schemathesis")
            server.key = key
            yield server
        finally:
            worker.stop()
    summary = {op: dict(counts) for op, counts in sorted(TALLY.items())}
    total = sum(sum(c.values()) for c in TALLY.values())
    (run_dir / "schemathesis-summary.json").write_text(json.dumps({"cases": total, "by_operation": summary},
                                                                  indent=1))
    failures = sum(n for c in TALLY.values() for code, n in c.items() if code.startswith("5"))
    lines = [f"{total} calls, {failures} answered 5xx"]
    lines += [f"  {op}: {dict(sorted(counts.items()))}" for op, counts in summary.items()
              if set(counts) != {"405"}]  # the probes of methods an operation does not have are left out
    request.config.rf_schemathesis_summary = lines  # printed by tests/badinput/conftest.py


def _load(spec: dict):
    loaded = schemathesis.openapi.from_dict(spec)
    loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return loaded


# The app's own description, built without a server, so that pytest can parametrize by
# operation at collection time (schemathesis' lazy fixture loader does not work with pytest 9).
# test_live_schema_is_the_one_tested checks that the live API serves the same document.
SPEC = create_app(Settings()).openapi()
schema = _load(SPEC)


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_api):
    return _load(httpx.get(fuzz_api.url + "/openapi.json").json())


def test_live_schema_is_the_one_tested(fuzz_api):
    assert httpx.get(fuzz_api.url + "/openapi.json").json() == json.loads(json.dumps(SPEC))


def _record(case, response, label: str = "") -> None:
    TALLY[f"{label}{case.method.upper()} {case.path}"][str(response.status_code)] += 1


def _no_5xx(case, response) -> None:
    case.validate_response(response, checks=[not_a_server_error])


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx(case, fuzz_api):
    response = case.call(base_url=fuzz_api.url, headers={"X-API-Key": fuzz_api.key}, timeout=60)
    _record(case, response)
    _no_5xx(case, response)


def test_stateful_sequences_never_answer_5xx(fuzz_schema, fuzz_api):
    # The sequences run over the routes the OpenAPI links join (jobs and batches: a POST's ids are
    # read back, cancelled, listed); every route, the compatible APIs and uploads included, is
    # fuzzed call by call above. Over the whole schema the machine spends its few steps on the
    # link-free routes and, depending on the ids it draws, may never follow a link at all.
    machine = fuzz_schema.include(path_regex=r"^/v1/(jobs|batches)").as_state_machine()

    class WithKey(machine):
        def get_call_kwargs(self, case):
            return {"base_url": fuzz_api.url, "headers": {"X-API-Key": fuzz_api.key}, "timeout": 60}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            _record(case, response, "stateful ")
            _no_5xx(case, response)

    WithKey.run(settings=settings(max_examples=STATEFUL_EXAMPLES, stateful_step_count=8, deadline=None,
                                  derandomize=True, suppress_health_check=list(HealthCheck)))
    stateful = {op: c for op, c in TALLY.items() if op.startswith("stateful ")}
    # the links were followed: ids from POST answers were read back (200), not just guessed (404)
    assert any(c.get("200") for op, c in stateful.items() if op.startswith("stateful GET /v1/jobs/")), stateful


def test_the_synchronous_routes_render_through_the_worker(fuzz_api):
    """Generated bodies almost never pass the compatible APIs' own checks (a random sampler name,
    size or model is their 422/400), so the synchronous path is also driven with the smallest
    valid bodies: they come back 200 with the null worker's images, not a timeout."""
    headers = {"X-API-Key": fuzz_api.key}
    for path, body in (("/sdapi/v1/txt2img", {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 2}),
                       ("/v1/images/generations", {"prompt": "a lighthouse", "size": "256x256"})):
        response = httpx.post(fuzz_api.url + path, json=body, headers=headers, timeout=120)
        TALLY[f"explicit POST {path}"][str(response.status_code)] += 1
        assert response.status_code == 200, (path, response.text[:500])
        assert (response.json().get("images") or response.json().get("data")), response.text[:500]


def _image(size=(64, 64), fmt="PNG", mode="RGB") -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size).save(buf, fmt)
    return buf.getvalue()


def test_the_bad_input_images_are_4xx_on_every_route(fuzz_api):
    """The input-image cases by hand on each route that takes images (generated bodies rarely
    reach them): not an image, a decompression bomb (over RENDERFARM_INPUT_MAX_PIXELS), an
    unsupported format, a mask of another size, a private URL, strength out of range."""
    import base64

    headers = {"X-API-Key": fuzz_api.key}
    bomb, gif, text = _image((5000, 4000), mode="1"), _image((8, 8), "GIF"), b"not an image at all"
    photo = httpx.post(fuzz_api.url + "/v1/uploads", files={"file": ("p.png", _image())}, headers=headers).json()["key"]
    small = httpx.post(fuzz_api.url + "/v1/uploads", files={"file": ("m.png", _image((32, 32), mode="L"))},
                       headers=headers).json()["key"]
    job = {"prompt": "x", "width": 64, "height": 64}
    b64 = {name: base64.b64encode(data).decode() for name, data in (("bomb", bomb), ("gif", gif), ("text", text))}
    calls = {
        "upload not an image": ("/v1/uploads", {"files": {"file": ("a", text)}}, 422),
        "upload bomb": ("/v1/uploads", {"files": {"file": ("a", bomb)}}, 422),
        "upload gif": ("/v1/uploads", {"files": {"file": ("a", gif)}}, 415),
        "job mask size": ("/v1/jobs", {"json": {**job, "init_image": photo, "mask_image": small}}, 422),
        "job private url": ("/v1/jobs", {"json": {**job, "init_image": "https://10.1.2.3/a.png"}}, 422),
        "job strength": ("/v1/jobs", {"json": {**job, "init_image": photo, "strength": 1.01}}, 422),
        "a1111 bomb": ("/sdapi/v1/img2img", {"json": {"prompt": "x", "init_images": [b64["bomb"]]}}, 422),
        "a1111 gif": ("/sdapi/v1/img2img", {"json": {"prompt": "x", "init_images": [b64["gif"]]}}, 415),
        "openai not an image": ("/v1/images/edits", {"files": {"image": ("a.png", text)}, "data": {"prompt": "x"}},
                                400),
        "openai bomb": ("/v1/images/edits", {"files": {"image": ("a.png", bomb)}, "data": {"prompt": "x"}}, 400),
    }
    for name, (path, kwargs, status) in calls.items():
        response = httpx.post(fuzz_api.url + path, headers=headers, timeout=60, **kwargs)
        TALLY[f"explicit POST {path}"][str(response.status_code)] += 1
        assert response.status_code == status, (name, response.text[:300])
