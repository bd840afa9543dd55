"""Submission below the HTTP layer (:mod:`infra.submission`): a process that cannot import FastAPI
or Starlette submits a batch with :class:`~infra.submission.submitter.Submitter` against a real
redis-server, and the farm sees it exactly as one the API submitted (records, wait lanes,
idempotency, webhook enrolment); a refused input image raises the domain error the API maps to
a 422, with nothing recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from infra import keys
from infra.broker.lanes import backlog
from infra.pools import pool_for_model
from infra.state.job_store import JobStore

DB = 11

#: Runs in a fresh interpreter where importing fastapi, starlette or uvicorn raises ImportError.
SUBMIT = "import sys\nfor m in ('fastapi', 'starlette', 'uvicorn'):\n    sys.modules[m] = None\n" + textwrap.dedent("""
    import json
    import redis
    from infra.broker.app import make_celery
    from infra.schemas import RenderRequest
    from infra.settings import Settings
    from infra.state.job_store import JobStore
    from infra.storage.s3 import Storage
    from infra.submission.input_refs import InputError, InputResolver
    from infra.submission.submitter import Submitter

    url = sys.argv[1]
    client = redis.Redis.from_url(url, decode_responses=True)
    settings = Settings(redis_url=url, s3_endpoint_url="http://127.0.0.1:9")  # never reached below
    inputs = InputResolver(Storage(settings, max_attempts=1), max_bytes=1 << 20, max_pixels=1 << 20)
    submitter = Submitter(JobStore(client), make_celery(settings), "tiny", client, inputs=inputs)
    requests = [RenderRequest(prompt="a fox"), RenderRequest(prompt="a hen", seed=7)]
    first = submitter.submit(requests, idempotency_key="k1", webhook_url="https://example.com/hook", tenant="t1")
    again = submitter.submit(requests, idempotency_key="k1", tenant="t1")
    try:
        submitter.submit([RenderRequest(prompt="ok"),
                          RenderRequest(prompt="x", init_image="https://127.0.0.1/in.png")], tenant="t2")
        refused = None
    except InputError as exc:
        refused = {"status": exc.status, "index": exc.index, "field": exc.field, "reason": exc.reason}
    print(json.dumps({"first": first.model_dump(), "again": again.model_dump(), "refused": refused}))
""")


def test_a_process_without_fastapi_submits_what_the_farm_then_holds(redis_db, redis_server):
    r = redis_db(DB)
    out = subprocess.run([sys.executable, "-c", SUBMIT, redis_server.url.rsplit("/", 1)[0] + f"/{DB}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    first = answer["first"]
    assert answer["again"] == first  # the idempotency key returned the first batch, nothing new

    batch = JobStore(r).get_batch(first["batch_id"], tenant="t1")
    assert batch is not None and batch.total == 2 and batch.counts["queued"] == 2
    assert [j.job_id for j in batch.jobs] == first["job_ids"]
    assert [j.request.model for j in batch.jobs] == ["tiny", "tiny"]
    assert batch.jobs[0].request.seed is not None and batch.jobs[1].request.seed == 7
    assert backlog(r)[pool_for_model("tiny")][0] == 2  # both jobs wait in their pool's lane
    assert r.zscore(keys.WEBHOOKS_PENDING, first["batch_id"]) == 0  # enrolled for its webhook

    refused = answer["refused"]
    assert refused is not None, "an input URL on a private address was accepted"
    assert (refused["status"], refused["index"], refused["field"]) == (422, 1, "init_image")
    assert "URL refused" in refused["reason"]
    assert JobStore(r).recent_batches("t2") == []  # nothing of the refused submission was recorded
    assert backlog(r)[pool_for_model("tiny")][0] == 2
