"""``renderfarm bench submit``: seconds from one ``POST /v1/batches`` of N jobs to its 202 answer.

Place in the data flow: the producer's side of the first hop (producer → API → job records and
wait lanes in Redis). It starts a private local stack with no workers (its own redis-server on a
free port, SeaweedFS and the API; nothing consumes, so the timings are the submission alone) and
times, ``repeats`` times each, alternating:

* **POST**: one HTTP request whose body (N requests of the ``bench farm`` null shape, serialized
  beforehand) is sent as is, until the 202 answer: the API's parsing, validation, routing,
  quotas, job records and wait lanes, and its answer of N job ids;
* **client**: :meth:`producer.client.RenderClient.submit_batch` with the same number of
  ``RenderRequest`` objects: the above plus the client's own validation and serialization.

Per POST it also reads the API process's CPU seconds (``/proc/<pid>/stat``), which a busy
machine inflates far less than wall seconds. Every submission has its own requests (other
seeds) and idempotency key. The load average is recorded before and after.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from dataclasses import asdict, dataclass

from bench.farm.readings import cpu_seconds
from bench.farm.workload import FarmBenchConfig, load_average, requests_for

#: The target this command checks: seconds for 10,000 jobs in one POST.
TARGET_S = 0.5


@dataclass(frozen=True)
class SubmitBenchConfig:
    """What to measure: ``jobs`` per submission (1…10,000), ``repeats`` of each kind (median)."""

    jobs: int = 10_000
    repeats: int = 5


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def run_submit_bench(config: SubmitBenchConfig, log=print) -> dict:
    """Time ``config.repeats`` raw POSTs and client submissions of ``config.jobs`` jobs each
    against a private stack with no workers; returns runs and medians in seconds.

    Raises:
        ValueError: ``jobs`` outside 1…10,000 or ``repeats`` < 1.
        RuntimeError: the API did not answer 202 with one job id per job.
    """
    from infra.localstack import LocalStack
    from infra.localstack.ports import free_port
    from infra.localstack.stack import patched_environ
    from infra.schemas import BatchSubmission
    from producer.client import RenderClient

    if not 1 <= config.jobs <= 10_000 or config.repeats < 1:
        raise ValueError(f"jobs must be 1…10,000 and repeats >= 1, got {config.jobs} and {config.repeats}")
    shape = FarmBenchConfig(model="null").resolved()
    load_before = load_average()
    # no rate limits and no byte quota: every repeat's jobs stay queued (nothing consumes them)
    env = {"RENDERFARM_RATE_LIMIT_JOBS_PER_S": "0", "RENDERFARM_RATE_LIMIT_REQUESTS_PER_S": "0",
           "RENDERFARM_QUOTA_OUTSTANDING_BYTES": "0", "RENDERFARM_QUOTA_OUTSTANDING_JOBS": "0"}
    post_s: list[float] = []
    client_s: list[float] = []
    api_cpu_s: list[float] = []
    with patched_environ(env):
        stack = LocalStack(workers=0, model=shape.model, redis_url=f"redis://127.0.0.1:{free_port()}/0")
        log(f"starting a private stack with no workers in {stack.run_dir} …")
        with stack, patched_environ(stack.env), RenderClient(api_url=stack.api.url, timeout_s=600) as client:
            http = client.http  # the client's own connection and headers, for the raw POSTs
            pid = stack.api.pid
            assert pid is not None, "the local stack's API is not running"
            client.submit_batch(requests_for(shape, 8, offset=30_000_000))  # warm-up: connections, imports
            for r in range(config.repeats):
                body = BatchSubmission(jobs=requests_for(shape, config.jobs, offset=2 * r * config.jobs),
                                       idempotency_key=f"bench-{uuid.uuid4().hex}").model_dump_json(exclude_none=True)
                requests = requests_for(shape, config.jobs, offset=(2 * r + 1) * config.jobs)
                for what in ("post", "client") if r % 2 == 0 else ("client", "post"):
                    if what == "post":
                        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
                        response = http.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
                        post_s.append(round(time.perf_counter() - t0, 4))
                        api_cpu_s.append(round(cpu_seconds(pid) - cpu0, 3))
                        if response.status_code != 202 or len(response.json()["job_ids"]) != config.jobs:
                            raise RuntimeError(f"POST /v1/batches answered {response.status_code}: "
                                               f"{response.text[:300]}")
                    else:
                        t0 = time.perf_counter()
                        client.submit_batch(requests)
                        client_s.append(round(time.perf_counter() - t0, 4))
                log(f"round {r + 1}: POST {post_s[-1]:.3f} s (API CPU {api_cpu_s[-1]:.2f} s), client "
                    f"{client_s[-1]:.3f} s (load {load_average()[0]})")
    return {"benchmark": "submit", "config": asdict(config),
            "post": {"runs_s": post_s, "median_s": _median(post_s),
                     "jobs_per_s": round(config.jobs / statistics.median(post_s), 1)},
            "client": {"runs_s": client_s, "median_s": _median(client_s)},
            "api_cpu": {"runs_s": api_cpu_s, "median_s": _median(api_cpu_s)},
            "machine": {"load_average_before": load_before,
                        "load_average_after": load_average(), "nproc": os.cpu_count()}}


def submit_table(result: dict):
    """A rich Table of a :func:`run_submit_bench` result: what, median, runs, target."""
    from rich.table import Table

    jobs = result["config"]["jobs"]
    m = result["machine"]
    table = Table(title=f"bench submit: {jobs} jobs per POST /v1/batches, load {m['load_average_before'][0]} → "
                        f"{m['load_average_after'][0]} on {m['nproc']} CPUs")
    for column in ("what", "median s", "runs s", "target"):
        table.add_column(column)
    target = f"≤ {TARGET_S} s for 10,000" if jobs == 10_000 else ""
    table.add_row("POST → 202 (body serialized beforehand)", f"{result['post']['median_s']:.3f}",
                  " ".join(f"{s:.3f}" for s in result["post"]["runs_s"]), target)
    table.add_row("  API process CPU per POST", f"{result['api_cpu']['median_s']:.3f}",
                  " ".join(f"{s:.3f}" for s in result["api_cpu"]["runs_s"]), "")
    table.add_row("client.submit_batch (client JSON + POST)", f"{result['client']['median_s']:.3f}",
                  " ".join(f"{s:.3f}" for s in result["client"]["runs_s"]), "")
    return table
