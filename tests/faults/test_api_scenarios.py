"""Fault scenarios i, l and p of the fault table: the API killed mid-submission, a worker with a skewed
clock, and one tenant flooding at its limits while another keeps working.

Each records one row of the fault table (``test-artifacts/faults.json``, see ``farm.py``) and
asserts that nothing accepted was lost and nothing ran twice:

- i: ``kill -9`` of the status API in the middle of a 10,000-job idempotent ``POST /v1/batches``,
  then the same request again (recovery: from the kill until the retry's 202); then two
  identical POSTs 50 ms apart;
- l: a worker whose wall clock is 60 s behind (libfaketime, or where it breaks Python a
  ``sitecustomize`` shifting Python's ``time.time``), from start to its jobs done;
- p: tenant A floods at its quota and rate limits for ``RENDERFARM_TEST_FLOOD_S`` seconds
  (default 30: A meets its 400-job quota every few seconds, so the counts asserted hold many
  times over; the full scenario runs 600) while tenant B submits one job every half second; B's
  waits (queued → running, p50/p95) are recorded, not asserted (no timed asserts); B is never
  overtaken by A's backlog, which is counted, not timed.
"""

from __future__ import annotations

import bisect
import glob
import os
import statistics
import threading
import time
import uuid

import httpx
import pytest

from infra import keys
from infra.api.auth import KeyStore
from infra.state.job_store import PUBLIC_TENANT
from infra.state.quota import Quotas

from .farm import LEASE_S, request

pytestmark = [pytest.mark.faults, pytest.mark.long]


def _body(n: int, base: int, idempotency_key: str | None = None, steps: int = 1) -> dict:
    body: dict = {"jobs": [request(base + i, steps=steps).model_dump(mode="json", exclude_none=True)
                           for i in range(n)]}
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    return body


def _post_until_accepted(url: str, body: dict, *, timeout: float = 120.0) -> tuple[list[str], list[int]]:
    """POST ``body`` to ``/v1/batches``, honouring 409's ``Retry-After``, until a 202; returns its
    job ids and every status code seen."""
    codes: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.post(f"{url}/v1/batches", json=body, timeout=120)
        codes.append(resp.status_code)
        if resp.status_code == 202:
            return resp.json()["job_ids"], codes
        assert resp.status_code == 409 and time.monotonic() < deadline, (resp.status_code, resp.text)
        time.sleep(min(float(resp.headers.get("Retry-After", "1")), 2.0))


def _assert_clean(row: dict, **expected) -> None:
    assert row["lost"] == 0 and row["run_twice"] == 0, row
    for key, value in expected.items():
        assert row[key] == value, row


def _batches(farm) -> list[str]:
    """The batch records in the farm's Redis (not their ``:jobs`` and ``:counts`` keys)."""
    return [k for k in farm.redis.scan_iter(match=f"{keys.PREFIX}batch:*", count=1000)
            if ":" not in k.split("}:", 1)[-1]]


CLAIM_S, HOLD_S = 8, 16  # scenario i's claim and quota hold, seconds (the defaults: 30 and 60)


# ---- i. kill -9 of the API mid-submission ------------------------------------------------------
# The claim a killed submission leaves and its quota reservation are held 30 and 60 s by default; the
# scenario waits out both, so it shortens them (still many times the submission's own seconds).
@pytest.mark.farm_settings(RENDERFARM_RATE_LIMIT_JOBS_PER_S="0", RENDERFARM_IDEMPOTENCY_CLAIM_S=str(CLAIM_S),
                           RENDERFARM_QUOTA_HOLD_S=str(HOLD_S))
def test_i_kill_9_the_api_mid_submission_then_retry(fault_farm):
    farm = fault_farm
    farm.add_workers(3, batch_size=64, step_delay_s=0.0)
    idem = f"scenario-i-{uuid.uuid4().hex}"
    body = _body(10_000, 0, idem)
    rkey = keys.idempotency(PUBLIC_TENANT, idem)
    first: dict = {}

    def post() -> None:
        try:
            first["response"] = httpx.post(f"{farm.api.url}/v1/batches", json=body, timeout=120)
        except httpx.HTTPError as exc:  # the kill cuts the connection
            first["error"] = type(exc).__name__

    sender = threading.Thread(target=post)
    sender.start()
    claimed = farm.wait_for(lambda: farm.redis.get(rkey), timeout=120, interval=0.001)
    farm.api.kill()
    killed = time.monotonic()
    sender.join()
    state_at_kill = farm.redis.get(rkey)
    killed_in = "claimed" if state_at_kill and state_at_kill.startswith(keys.IDEM_CLAIM) else "recorded"
    batches_at_kill = len(_batches(farm))
    farm.api.start().wait_ready()
    job_ids, codes = _post_until_accepted(farm.api.url, body)
    recovery = time.monotonic() - killed
    again, _ = _post_until_accepted(farm.api.url, body)  # and once more, now that it is settled
    assert len(job_ids) == 10_000 and again == job_ids, (len(job_ids), codes)
    if "response" in first:  # the first answer beat the kill: the retry returns that batch
        assert first["response"].status_code == 202 and first["response"].json()["job_ids"] == job_ids

    # two identical POSTs 50 ms apart: one batch, consistent answers
    twin_body = _body(2_000, 20_000, f"scenario-i-twins-{uuid.uuid4().hex}")
    answers: list[tuple[list[str], list[int]]] = []

    def twin(delay: float) -> None:
        time.sleep(delay)
        answers.append(_post_until_accepted(farm.api.url, twin_body))

    twins = [threading.Thread(target=twin, args=(d,)) for d in (0.0, 0.05)]
    for thread in twins:
        thread.start()
    for thread in twins:
        thread.join()
    (ids_a, codes_a), (ids_b, codes_b) = answers
    assert len(ids_a) == 2_000 and ids_a == ids_b, (codes_a, codes_b)
    batch_ids = {farm.store.get_job(j).batch_id for j in (job_ids[0], job_ids[-1], ids_a[0], ids_a[-1])}
    assert len(batch_ids) == 2  # one batch per idempotency key
    assert len(_batches(farm)) == 2  # and no other batch was ever written

    farm.wait(job_ids + ids_a, timeout=900)
    # the killed submission's reservation (held HOLD_S) is given back by the reaper
    farm.wait_for(lambda: Quotas(farm.redis).usage(PUBLIC_TENANT)[0] == 0, timeout=120)
    quota_left = Quotas(farm.redis).usage(PUBLIC_TENANT)[0]
    row = farm.account("i. kill -9 the API mid-submission (10,000 jobs), retry; two identical POSTs 50 ms apart",
                       job_ids + ids_a, recovery, killed_in=killed_in, batches_at_kill=batches_at_kill,
                       first_answer=first.get("error") or first["response"].status_code,
                       retry_codes=codes, twin_codes=[codes_a, codes_b], claim_seen=claimed[:6],
                       quota_outstanding_after=quota_left)
    _assert_clean(row, succeeded=12_000, failed=0, objects=12_000)


# ---- l. a worker whose clock is 60 s behind ----------------------------------------------------
def _libfaketime() -> str | None:
    """The path of Debian's libfaketime (package ``faketime``), or None."""
    for pattern in ("/usr/lib/*/faketime/libfaketime.so.1", "/usr/lib/faketime/libfaketime.so.1",
                    "/usr/local/lib/faketime/libfaketime.so.1"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


SKEW_S = 60.0
#: A Python timed wait under libfaketime: time.sleep and a threading.Event timeout, as the worker uses them.
_PROBE = ("import threading, time; time.sleep(0.05); threading.Event().wait(0.05); "
          "print(time.time())")


def _faketime_breaks_python(env: dict[str, str]) -> str | None:
    """Why Python's timed waits fail under libfaketime with ``env``, or None when they work.

    Seen with libfaketime 0.9.10 (Debian 12) and Python 3.11: with the monotonic clock faked
    (its default) ``threading.Event.wait(timeout)`` never returns (the condition wait's
    deadline is taken on the faked clock); with ``FAKETIME_DONT_FAKE_MONOTONIC=1``
    ``time.sleep`` raises ``OSError: [Errno 22]`` (Python sleeps with an absolute
    ``clock_nanosleep`` on CLOCK_MONOTONIC, whose deadline libfaketime shifts by the offset)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, **env}, capture_output=True,
                              text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "a threading.Event timeout never returns under libfaketime (monotonic clock faked)"
    if done.returncode != 0:
        return f"Python's timed waits fail under libfaketime: {done.stderr.strip().splitlines()[-1]}"
    return None


#: Where libfaketime cannot skew a Python process: this ``sitecustomize`` moves the wall clock
#: Python reads (``time.time``, ``time.time_ns``) by ``RENDERFARM_TEST_CLOCK_SKEW_S`` before any
#: module imports them (the farm's code, redis-py, Celery, kombu); C code's own clock reads and
#: ``datetime.now`` keep the host's clock.
_SITECUSTOMIZE = """import os as _os, time as _time
_skew = float(_os.environ["RENDERFARM_TEST_CLOCK_SKEW_S"])
_wall, _wall_ns = _time.time, _time.time_ns
_time.time = lambda: _wall() + _skew
_time.time_ns = lambda: _wall_ns() + int(_skew * 1e9)
"""


def _skewed_env(tmp_path) -> tuple[dict[str, str], str]:
    """The worker's environment for a clock ``SKEW_S`` behind, and how it is skewed: libfaketime
    (the whole process, C included) where it works with Python, else the ``sitecustomize`` shim."""
    lib = _libfaketime()
    if lib is not None:
        # the wall clock only where libfaketime allows it: a host with a wrong clock still has a
        # sane monotonic clock (libfaketime moves CLOCK_MONOTONIC to epoch-like values otherwise)
        for env in ({"LD_PRELOAD": lib, "FAKETIME": f"-{SKEW_S:.0f}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"},
                    {"LD_PRELOAD": lib, "FAKETIME": f"-{SKEW_S:.0f}s"}):
            broken = _faketime_breaks_python(env)
            if broken is None:
                return env, "libfaketime"
        how = f"Python's time.time shifted (libfaketime cannot skew Python here: {broken})"
    else:
        how = "Python's time.time shifted (libfaketime not installed)"
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "RENDERFARM_TEST_CLOCK_SKEW_S": str(-SKEW_S)}, how


def test_l_worker_clock_60_s_behind(fault_farm, tmp_path):
    farm = fault_farm
    skewed, how = _skewed_env(tmp_path)
    t0 = time.time()
    (worker,) = farm.add_workers(1, batch_size=8, step_delay_s=0.1, **skewed)
    t1 = time.time()
    entry = farm.registry_entry(worker.worker_name)
    # the worker's own clock (its started_at) really is 60 s behind: it started between t0 and t1
    assert t0 - 1 <= entry["started_at"] + SKEW_S <= t1 + 1, (t0, entry["started_at"], t1)
    listed = httpx.get(f"{farm.api.url}/v1/workers", timeout=10).json()
    (seen,) = [w for w in listed if w["name"] == worker.worker_name]
    assert seen["heartbeat_age_s"] < 3.0, seen  # alive, judged on Redis' clock

    job_ids = farm.submit([request(i, steps=5) for i in range(64)])  # 0.5 s a batch of 8: leases renew
    margins: list[float] = []

    def sample_leases() -> bool:
        now = farm.store.server_time()
        pipe = farm.redis.pipeline(transaction=False)
        for shard in keys.SHARDS:
            pipe.zrange(keys.leases(shard), 0, -1, withscores=True)
        margins.extend(score - now for leases in pipe.execute() for _, score in leases)
        return all(state in ("succeeded", "failed", "canceled") for state, _, _ in farm.states(job_ids))

    farm.wait_for(sample_leases, timeout=120, interval=0.05)
    statuses = farm.statuses(job_ids)
    listed = httpx.get(f"{farm.api.url}/v1/workers", timeout=10).json()
    row = farm.account("l. a worker whose clock is 60 s behind", job_ids, None, skewed_by=how,
                       worker_clock_skew_s=round(time.time() - (entry["started_at"] + (t1 - t0)), 1),
                       lease_margin_min_s=round(min(margins), 2), lease_margin_max_s=round(max(margins), 2),
                       lease_samples=len(margins))
    _assert_clean(row, succeeded=64, failed=0, objects=64)
    assert margins, "no lease was ever seen"
    # every lease ran out in the future, never later than one lease from now (Redis' clock): not
    # expired on arrival (early) nor 60 s long (late)
    assert 0 < min(margins) and max(margins) <= LEASE_S + 0.5, row
    assert all(s.attempts == 1 and s.worker == worker.worker_name for s in statuses)  # none expired, none retried
    assert all(s.started_at >= s.created_at and s.finished_at >= s.started_at for s in statuses)
    assert any(w["name"] == worker.worker_name for w in listed) and worker.running


# ---- p. one tenant floods at its limits, another keeps working ---------------------------------
FLOOD_S = float(os.environ.get("RENDERFARM_TEST_FLOOD_S", "30"))
A_QUOTA = 400


@pytest.mark.farm_settings(RENDERFARM_AUTH_REQUIRED="true", RENDERFARM_QUOTA_OUTSTANDING_JOBS=str(A_QUOTA),
                           RENDERFARM_RATE_LIMIT_REQUESTS_PER_S="20", RENDERFARM_RATE_LIMIT_REQUEST_BURST="40",
                           RENDERFARM_RATE_LIMIT_JOBS_PER_S="200", RENDERFARM_RATE_LIMIT_JOB_BURST="400")
def test_p_one_tenant_floods_at_its_limits_another_keeps_flowing(fault_farm):
    farm = fault_farm
    keystore = KeyStore(farm.redis)
    clients = {t: httpx.Client(base_url=farm.api.url, headers={"X-API-Key": keystore.create(t, name="pytest")[1]},
                               timeout=60) for t in ("flood-a", "steady-b")}
    farm.add_workers(2, batch_size=8, step_delay_s=0.05)  # 0.2 s a batch of 8 (4 steps)
    accepted: dict[str, list[str]] = {"flood-a": [], "steady-b": []}
    codes: dict[str, dict[int, int]] = {"flood-a": {}, "steady-b": {}}
    stop = threading.Event()
    lock = threading.Lock()

    def post(tenant: str, n: int, base: int) -> None:
        resp = clients[tenant].post("/v1/batches", json=_body(n, base, steps=4))
        with lock:
            codes[tenant][resp.status_code] = codes[tenant].get(resp.status_code, 0) + 1
            if resp.status_code == 202:
                accepted[tenant].extend(resp.json()["job_ids"])

    def flood(t: int) -> None:  # as fast as the API answers: at the quota and the rate limits
        k = 0
        while not stop.is_set():
            post("flood-a", 20, 1_000_000 * (t + 1) + 100 * k)
            k += 1

    def steady() -> None:
        k = 0
        while not stop.is_set():
            post("steady-b", 1, 10_000_000 + k)
            k += 1
            stop.wait(0.5)

    threads = [threading.Thread(target=flood, args=(t,)) for t in range(4)] + [threading.Thread(target=steady)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    stop.wait(FLOOD_S)
    stop.set()
    for thread in threads:
        thread.join()
    flood_s = time.monotonic() - started
    a_ids, b_ids = accepted["flood-a"], accepted["steady-b"]
    farm.wait(a_ids + b_ids, timeout=600)
    for client in clients.values():
        client.close()

    b = farm.statuses(b_ids)
    a = farm.statuses(a_ids)
    waits = sorted((s.started_at - s.created_at).total_seconds() for s in b if s.started_at)
    totals = sorted((s.finished_at - s.created_at).total_seconds() for s in b if s.finished_at)
    a_starts = sorted(s.started_at for s in a if s.started_at)
    # how many of A's jobs started while each B job waited: A's backlog (up to its quota) never
    # goes ahead of B, only what was already dispatched to the pool queue
    overtaken = max((bisect.bisect_left(a_starts, s.started_at) - bisect.bisect_right(a_starts, s.created_at)
                     for s in b if s.started_at), default=0)

    def pct(values: list[float], q: float) -> float | None:
        return round(statistics.quantiles(values, n=100)[q - 1], 2) if len(values) >= 2 else None

    row = farm.account("p. tenant A floods at its limits; tenant B keeps flowing", a_ids + b_ids, None,
                       flood_s=round(flood_s), a_accepted=len(a_ids), a_codes=codes["flood-a"],
                       b_submitted=len(b_ids), b_codes=codes["steady-b"], b_wait_p50_s=pct(waits, 50),
                       b_wait_p95_s=pct(waits, 95), b_wait_max_s=round(max(waits), 2) if waits else None,
                       b_total_p95_s=pct(totals, 95), b_max_overtaken_by_a=overtaken)
    _assert_clean(row, failed=0, canceled=0)
    assert codes["flood-a"].get(429, 0) > 0 and set(codes["steady-b"]) == {202}, row  # only A was refused
    assert row["succeeded"] == len(a_ids) + len(b_ids) and b_ids and a_ids, row
    assert overtaken < A_QUOTA // 2, row
    assert Quotas(farm.redis).usage("flood-a")[0] == 0  # every accepted job ended and gave its share back
