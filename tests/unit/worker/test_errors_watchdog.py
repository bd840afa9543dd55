"""Whose fault an error is (``worker.errors``), how suspects are grouped (``worker.batch``), and
the render watchdog (``worker.watchdog``): pure logic, no services."""

from __future__ import annotations

import time

import pytest
import redis
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

from infra.schemas import RenderRequest
from infra.state.job_store import StartedJob
from worker.batch import render_groups
from worker.breaker import CircuitBreaker
from worker.errors import CREDENTIALS, DEVICE, REQUEST, TRANSIENT, classify, is_infrastructure, is_retryable
from worker.watchdog import EXIT_STALLED, RenderWatchdog


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(("exc", "kind"), [
    (_client_error("SignatureDoesNotMatch", 403), CREDENTIALS),
    (_client_error("InvalidAccessKeyId", 403), CREDENTIALS),
    (_client_error("RequestTimeTooSkewed", 403), CREDENTIALS),
    (_client_error("403", 403), CREDENTIALS),
    (NoCredentialsError(), CREDENTIALS),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), DEVICE),
    (RuntimeError("CUDA error: unspecified launch failure"), DEVICE),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), TRANSIENT),
    (MemoryError("out of memory"), TRANSIENT),
    (_client_error("SlowDown", 503), TRANSIENT),
    (EndpointConnectionError(endpoint_url="http://s3"), TRANSIENT),
    (redis.ConnectionError("Connection refused"), TRANSIENT),
    (TimeoutError("render exceeded the job timeout"), TRANSIENT),
    (RuntimeError("poison request: prompt contains 'x'"), REQUEST),
    (ValueError("height must be a multiple of 8"), REQUEST),
    (_client_error("NoSuchBucket", 404), REQUEST),
])
def test_each_error_is_the_requests_a_passing_outage_or_this_workers(exc, kind):
    assert classify(exc) == kind
    assert is_infrastructure(exc) == (kind in (CREDENTIALS, DEVICE))
    assert is_retryable(exc) == (kind != REQUEST)


def _job(i: int, suspect_n: int = 0, width: int = 64) -> StartedJob:
    return StartedJob(f"j{i}", "b", 1, RenderRequest(prompt=f"p{i}", width=width, height=64), suspect_n=suspect_n)


def test_suspects_render_apart_from_the_unsuspected_in_halves_of_their_smallest_group():
    jobs = [_job(0), _job(1, 8), _job(2, 8), _job(3), _job(4, 8), _job(5, 4), _job(6, 8), _job(7, width=128)]
    groups = [[j.job_id for j in g] for g in render_groups(jobs)]
    assert groups == [["j0", "j3"], ["j7"], ["j1", "j2"], ["j4", "j5"], ["j6"]]  # unsuspected first; cap 4 // 2 = 2
    assert [[j.job_id for j in g] for g in render_groups([_job(0, 1), _job(1, 1)])] == [["j0"], ["j1"]]
    assert [len(g) for g in render_groups([_job(i, 8) for i in range(8)])] == [4, 4]


def test_the_breaker_opens_at_once_on_an_infrastructure_error():
    trips: list[int] = []
    breaker = CircuitBreaker(5, on_trip=lambda: trips.append(1))
    breaker.record(True)
    assert not breaker.open
    breaker.record(True, "ClientError: SignatureDoesNotMatch")
    assert breaker.open and trips == [1] and breaker.state()["reason"].startswith("ClientError")
    breaker.record(True, "again")
    assert trips == [1]  # already open: on_trip once
    breaker.record(False)
    assert not breaker.open and breaker.state()["reason"] == ""


def test_the_watchdog_fires_only_on_a_render_without_progress():
    exits: list[int] = []
    stalls: list[str] = []
    dog = RenderWatchdog(0.2, on_stall=stalls.append, exit=exits.append, check_s=0.05)
    assert not dog.check()  # no render running: nothing to watch, however long
    with dog.rendering("a group of 2"):
        for _ in range(6):
            time.sleep(0.05)
            dog.progress()
            assert not dog.check()  # steps keep coming
        dog.start()  # and no step from here on: the render hangs
        dog.join(timeout=60)  # the thread ends once it fired
    assert exits == [EXIT_STALLED] and len(stalls) == 1 and "a group of 2" in stalls[0]
    assert not dog.check()  # fires once


def test_a_watchdog_with_no_limit_never_fires():
    dog = RenderWatchdog(0.0, exit=pytest.fail)
    with dog.rendering("x"):
        time.sleep(0.05)
        assert not dog.check()


def test_a_render_given_a_longer_stall_limit_is_watched_by_it():
    exits: list[int] = []
    dog = RenderWatchdog(0.1, exit=exits.append, check_s=0.05)
    with dog.rendering("a video", stall_s=0.6):
        time.sleep(0.3)
        assert not dog.check()  # past the watchdog's 0.1 s, within the render's own 0.6 s
        time.sleep(0.4)
        assert dog.check()
    assert exits == [EXIT_STALLED]
    shorter = RenderWatchdog(0.3, exit=pytest.fail)
    with shorter.rendering("an image", stall_s=0.01):  # a smaller limit never lowers the watchdog's
        time.sleep(0.1)
        assert not shorter.check()


def test_budgets_keep_the_configured_limits_for_images_and_scale_them_for_videos():
    from infra.schemas import RenderRequest
    from worker.budgets import TIMEOUT_FACTOR, render_budget

    image = RenderRequest(prompt="p", width=1024, height=1024, num_inference_steps=30)
    budget = render_budget([image] * 4, s_per_mpx_step=0.05, job_timeout_s=600.0, stall_s=300.0)
    assert (budget.timeout_s, budget.stall_s) == (600.0, 300.0)
    video = RenderRequest(prompt="p", kind="video", num_frames=81, fps=16, width=832, height=480,
                          num_inference_steps=50)
    budget = render_budget([video], s_per_mpx_step=0.2, job_timeout_s=600.0, stall_s=300.0)
    expected = 0.2 * 832 * 480 / 1e6 * 50 * 81  # seconds: rate x Mpx x steps x frames
    assert budget.estimate_s == pytest.approx(expected)
    assert budget.timeout_s == pytest.approx(TIMEOUT_FACTOR * expected) and budget.stall_s == pytest.approx(expected)
    off = render_budget([video], s_per_mpx_step=0.2, job_timeout_s=600.0, stall_s=0.0)
    assert off.stall_s == 0.0  # a watchdog turned off stays off
