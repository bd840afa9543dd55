"""schemathesis against the live status API's ``/openapi.json``: every operation with generated
valid and invalid input (positive and negative modes), then stateful sequences along the links
schemathesis infers (submit → read / cancel the job or batch it returned). The one assertion:
no response is a 5xx.

The API under test is its own process with auth required (a key for tenant ``fuzz``), no rate
limits, and Redis database 1, so that the jobs it accepts never reach the session's workers. The
compatible APIs' synchronous renders (A1111's txt2img, OpenAI's images/generations) therefore wait
for a worker that never comes: there, and only there, a 504 after ``RENDERFARM_SYNC_TIMEOUT_S``
(0.5 s here) is the expected answer to a valid request.
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

from infra.api.app import create_app
from infra.api.auth import KeyStore
from infra.localstack import ApiServer, free_port
from infra.settings import Settings

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 40
STATEFUL_EXAMPLES = 25
TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def fuzz_api(farm_env, run_dir, redis_server, request):
    redis_url = redis_server.db_url(1)
    env = {**farm_env, "RENDERFARM_REDIS_URL": redis_url, "RENDERFARM_AUTH_REQUIRED": "true",
           "RENDERFARM_RATE_LIMIT_REQUESTS_PER_S": "0", "RENDERFARM_RATE_LIMIT_JOBS_PER_S": "0",
           "RENDERFARM_DEFAULT_MODEL": "fuzz-unserved", "RENDERFARM_SYNC_TIMEOUT_S": "0.5"}
    with ApiServer(free_port(), env, name="api-fuzz", run_dir=run_dir) as server:
        _, key = KeyStore(redis_server.client(db=1)).create("fuzz", name="schemathesis")
        server.key = key
        yield server
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


#: Operations that wait for their renders (see the module docstring): 504 is their timeout here.
SYNCHRONOUS = {"POST /sdapi/v1/txt2img", "POST /v1/images/generations"}


def _no_5xx(case, response) -> None:
    if f"{case.method.upper()} {case.path}" in SYNCHRONOUS and response.status_code == 504:
        return
    case.validate_response(response, checks=[not_a_server_error])


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx(case, fuzz_api):
    response = case.call(base_url=fuzz_api.url, headers={"X-API-Key": fuzz_api.key}, timeout=60)
    _record(case, response)
    _no_5xx(case, response)


def test_stateful_sequences_never_answer_5xx(fuzz_schema, fuzz_api):
    machine = fuzz_schema.as_state_machine()

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
