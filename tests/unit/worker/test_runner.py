"""BatchRunner, one pulled batch at a time: grouping, bisection, OOM splits (the farm's one
out-of-memory policy, ``pipeline.memory.render_in_parts``, where the worker uses it), timeouts,
cancellation, fencing, storage outages, infrastructure errors and suspects of a lost worker.

The runner's collaborators are real: the job-state store on the session's redis-server (its own
database) and the bucket on the session's SeaweedFS. Only the renderer is scripted (a test
double that paints one colour per seed and fails, runs out of memory or slows down on cue), since
what is under test is what the runner does with each outcome of a render.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import pytest
from PIL import Image

from infra import keys
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state.job_store import JobStore, NewJob
from infra.storage.images import read_parameters
from infra.storage.s3 import Storage
from infra.submission.submitter import new_id
from pipeline.render import compat_key
from worker.errors import credentials_problem
from worker.runner import BatchRunner

DB = 6  # the session farm uses database 0
POISON = "poison-for-the-runner"


class ScriptedRenderer:
    """Renders each request as a flat colour derived from its seed, after ``steps`` callbacks.

    ``fail_on`` (a prompt substring) raises RuntimeError for any group holding it; ``oom_above``
    raises MemoryError for a group larger than that; ``step_s`` sleeps per step; ``at_step(step,
    requests)`` runs a test's action (a cancel, a takeover) before the step is reported.
    """

    model = "scripted"

    def __init__(self, *, fail_on: str = "", oom_above: int = 0, step_s: float = 0.0,
                 at_step: Callable[[int, Sequence[RenderRequest]], None] | None = None, slow_on: str = "",
                 raise_exc: BaseException | None = None):
        self.fail_on, self.oom_above, self.step_s, self.at_step = fail_on, oom_above, step_s, at_step
        self.slow_on, self.raise_exc = slow_on, raise_exc
        self.calls: list[list[str]] = []
        self.steps_run: list[int] = []

    def render(self, requests: Sequence[RenderRequest], on_step=None) -> list[Image.Image]:
        self.calls.append([r.prompt for r in requests])
        if self.fail_on and any(self.fail_on in r.prompt for r in requests):
            raise RuntimeError(f"poison request: prompt contains {self.fail_on!r}")
        if self.oom_above and len(requests) > self.oom_above:
            raise MemoryError(f"out of memory on a group of {len(requests)}")
        if self.raise_exc is not None:
            raise self.raise_exc
        total = requests[0].num_inference_steps
        slow = not self.slow_on or any(self.slow_on in r.prompt for r in requests)
        for step in range(1, total + 1):
            time.sleep(self.step_s if slow else 0.0)
            if self.at_step is not None:
                self.at_step(step, requests)
            self.steps_run.append(step)
            if on_step is not None:
                on_step(step, total)
        return [Image.new("RGB", (r.width, r.height), ((r.seed or 0) % 256, 40, 90)) for r in requests]


@pytest.fixture
def store(redis_db) -> JobStore:
    return JobStore(redis_db(DB), lease_s=30.0, max_attempts=3)


@pytest.fixture
def storage(farm_env) -> Storage:
    """The session bucket (objects go under each test's own batch id)."""
    return Storage(Settings())


def submit(store: JobStore, prompts: Sequence[str], **params) -> list[str]:
    """Record one queued job per prompt (a batch of its own), as submission does."""
    params = {"model": "scripted", "num_inference_steps": 4, "width": 64, "height": 64, **params}
    jobs = [NewJob(new_id(), RenderRequest(prompt=p, seed=i, **params), "scripted") for i, p in enumerate(prompts)]
    store.create_batch(new_id(), jobs)
    return [j.job_id for j in jobs]


def messages(job_ids: Sequence[str]) -> list[SimpleNamespace]:
    """What celery-batches hands the task: one request per message, the job id in its kwargs."""
    return [SimpleNamespace(id=f"m{i}", kwargs={"job_id": j}, args=()) for i, j in enumerate(job_ids)]


def runner(store: JobStore, storage: Storage, renderer: ScriptedRenderer, **kw) -> BatchRunner:
    return BatchRunner(store, storage, renderer, "test-runner", progress_interval_s=0.0, redis_retry_s=2.0, **kw)


def image_of(storage: Storage, key: str) -> Image.Image:
    return Image.open(io.BytesIO(storage.get(key)))


def test_one_render_per_group_and_every_job_recorded_with_its_image(store, storage):
    small = submit(store, [f"a fox {i}" for i in range(3)])
    wide = submit(store, ["a wide lighthouse", "a wide field"], width=128, num_inference_steps=3)
    renderer = ScriptedRenderer()
    outcome = runner(store, storage, renderer).run(messages(small + wide))
    assert (outcome.started, outcome.succeeded, outcome.failed, outcome.dropped) == (5, 5, 0, 0)
    assert sorted(len(call) for call in renderer.calls) == [2, 3]  # one pipeline call per compat key
    for job_id in small + wide:
        status = store.get_job(job_id)
        assert status.state == "succeeded" and status.progress == 1.0 and status.worker == "test-runner"
        image = image_of(storage, status.result.key)
        assert image.size == (status.request.width, 64) == (status.result.width, status.result.height)
        assert status.result.bytes == storage.size(status.result.key)
        assert image.getpixel((0, 0)) == (status.request.seed % 256, 40, 90)
        assert f"Seed: {status.request.seed}" in read_parameters(storage.get(status.result.key))
        assert status.result.denoising_steps == status.request.num_inference_steps  # the step callbacks counted


def test_a_poison_request_fails_alone_and_its_batch_mates_succeed(store, storage):
    ids = submit(store, [f"a kite {i}" for i in range(7)] + [f"{POISON} here"])
    renderer = ScriptedRenderer(fail_on=POISON)
    outcome = runner(store, storage, renderer).run(messages(ids))
    assert (outcome.succeeded, outcome.failed, outcome.requeued) == (7, 1, [])
    poison = store.get_job(ids[-1])
    assert poison.state == "failed" and poison.error.type == "RuntimeError" and POISON in poison.error.message
    assert all(store.get_job(j).state == "succeeded" for j in ids[:-1])
    # bisection: the group holding the poison halves until it is alone (8 → 4 → 2 → 1)
    assert [len(c) for c in renderer.calls if any(POISON in p for p in c)] == [8, 4, 2, 1]
    assert store.dead_letters()[1][0].job_id == ids[-1]


def test_out_of_memory_splits_the_group_and_caps_that_shape_only(store, storage):
    ids = submit(store, [f"a bowl {i}" for i in range(8)])
    renderer = ScriptedRenderer(oom_above=2)
    batch = runner(store, storage, renderer)
    outcome = batch.run(messages(ids))
    assert (outcome.succeeded, outcome.failed) == (8, 0)
    assert [len(c) for c in renderer.calls] == [8, 4, 2, 2, 2, 2]  # 8 and 4 ran out; halves of 2 fit
    key = compat_key(store.get_job(ids[0]).request)
    assert batch.limits.cap(key, 8) == 2 and batch.limits.cap(("other", 64, 64, 4, 7.5, "default"), 8) == 8
    renderer.calls.clear()
    batch.run(messages(submit(store, [f"a cup {i}" for i in range(4)])))
    assert [len(c) for c in renderer.calls] == [2, 2]  # the capped shape renders in chunks that fit


def test_a_job_that_alone_runs_out_of_memory_is_requeued_and_its_shape_renders_one_at_a_time(store, storage):
    """Out of memory is not the request's fault: a job that still runs out alone spends an
    attempt and goes back to the queue (not failed), and its shape renders one job at a time from
    then on, while another shape keeps the worker's batch size."""
    ids = submit(store, ["a vase 1", "a vase 2"])
    renderer = ScriptedRenderer(raise_exc=MemoryError("out of memory on any group"))
    batch = runner(store, storage, renderer)
    outcome = batch.run(messages(ids))
    assert (outcome.succeeded, outcome.failed, sorted(outcome.requeued)) == (0, 0, sorted(ids))
    assert [len(c) for c in renderer.calls] == [2, 1, 1]  # halves, then each alone
    for job_id, status in zip(ids, store.get_jobs(ids)):
        assert status.state == "queued" and status.attempts == 1 and status.error is None
        assert '"type":"MemoryError"' in store.r.hget(keys.job(job_id), "last_error")
    renderer.raise_exc = None  # the memory came back
    renderer.calls.clear()
    batch.run(messages(submit(store, [f"a vase {i}" for i in range(3)])))
    batch.run(messages(submit(store, [f"a wide vase {i}" for i in range(3)], width=128)))
    assert [len(c) for c in renderer.calls] == [1, 1, 1, 3]


def test_a_capped_shape_renders_whole_groups_again_after_eight_renders_that_fit(store, storage):
    ids = submit(store, [f"a lamp {i}" for i in range(4)])
    renderer = ScriptedRenderer(oom_above=2)
    batch = runner(store, storage, renderer)
    batch.run(messages(ids))  # 4 ran out of memory: this shape is capped at 2 (and its halves fit)
    renderer.oom_above = 0  # the memory came back
    for n in range(4):
        outcome = batch.run(messages(submit(store, [f"a lamp {n}.{i}" for i in range(4)])))
        assert outcome.succeeded == 4
    # 2 + 6 renders at the cap of 2 (the worker's BatchLimits: 8 to recover) lift it; then 4 at once
    assert [len(c) for c in renderer.calls] == [4, 2, 2] + [2, 2] * 3 + [4]
    assert batch.limits.snapshot() == {}


def test_out_of_memory_and_a_poison_request_in_one_group_fail_the_poison_alone(store, storage):
    """The out-of-memory split and the bisection that isolates a poison request work through one
    policy: the clean half is split for memory, the poisoned half is cut to the new cap and then
    bisected until the poison is alone; no other job loses an attempt."""
    ids = submit(store, [f"a shell {i}" for i in range(7)] + [f"{POISON} in a shell"])
    renderer = ScriptedRenderer(fail_on=POISON, oom_above=2)
    outcome = runner(store, storage, renderer).run(messages(ids))
    assert (outcome.succeeded, outcome.failed, outcome.requeued) == (7, 1, [])
    # 8: poison → halves; 4 clean: out of memory → 2 + 2; 4 poisoned: cut to the cap 2 + 2, then 1 + 1
    assert [len(c) for c in renderer.calls] == [8, 4, 2, 2, 2, 2, 1, 1]
    statuses = store.get_jobs(ids)
    assert statuses[-1].state == "failed" and statuses[-1].error.type == "RuntimeError"
    assert all(s.state == "succeeded" and s.attempts == 1 for s in statuses[:-1])


def test_a_group_over_the_timeout_splits_and_only_the_slow_job_fails(store, storage):
    ids = submit(store, ["fast 1", "fast 2", "SLOW one", "fast 3"], num_inference_steps=20)
    renderer = ScriptedRenderer(step_s=0.05, slow_on="SLOW")
    outcome = runner(store, storage, renderer, job_timeout_s=0.3).run(messages(ids))
    assert (outcome.succeeded, outcome.failed, outcome.requeued) == (3, 1, [])
    assert [len(c) for c in renderer.calls if any("SLOW" in p for p in c)] == [4, 2, 1]  # halves, then alone
    slow = store.get_job(ids[2])
    assert slow.state == "failed" and slow.error.type == "TimeoutError" and "ran alone" in slow.error.message
    assert all(store.get_job(j).state == "succeeded" and store.get_job(j).attempts == 1 for j in ids if j != ids[2])


def test_a_job_canceled_mid_render_loses_its_image_and_the_others_keep_theirs(store, storage):
    ids = submit(store, ["keep 1", "cancel me", "keep 2"])

    def cancel(step: int, requests) -> None:
        if step == 2:
            store.cancel(ids[1])

    outcome = runner(store, storage, ScriptedRenderer(at_step=cancel)).run(messages(ids))
    assert (outcome.succeeded, outcome.dropped) == (2, 1)
    canceled = store.get_job(ids[1])
    assert canceled.state == "canceled" and canceled.result is None
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=f"{canceled.batch_id}/")
    assert {o["Key"] for o in listed.get("Contents", [])} == {store.get_job(j).result.key for j in (ids[0], ids[2])}


def test_a_job_canceled_during_its_upload_keeps_no_image_and_no_control_map(store, storage):
    """The cancel lands after the pre-upload check, while the objects are written: the image and
    the control map stored beside it are both removed again."""
    from infra.controls import CONTROL_MAPS_INFO

    (job_id,) = submit(store, ["canceled while uploading"],
                       controls=[{"type": "canny", "image": "edges.png", "preprocess": "canny"}])

    class CancelingStorage(Storage):
        def put_once(self, key, *args, **kwargs):
            written = super().put_once(key, *args, **kwargs)
            if ".control-" in key:  # the last object the job writes
                store.cancel(job_id)
            return written

    class WithMaps(ScriptedRenderer):
        def render(self, requests, on_step=None):
            images = super().render(requests, on_step)
            for image in images:
                image.info[CONTROL_MAPS_INFO] = [Image.new("RGB", image.size, (255, 255, 255))]
            return images

    outcome = runner(store, CancelingStorage(Settings()), WithMaps()).run(messages([job_id]))
    assert (outcome.succeeded, outcome.dropped) == (0, 1)
    status = store.get_job(job_id)
    assert status.state == "canceled" and status.result is None
    listed = storage.client.list_objects_v2(Bucket=storage.bucket, Prefix=f"{status.batch_id}/")
    assert [o["Key"] for o in listed.get("Contents", [])] == []


def test_a_group_whose_jobs_are_all_canceled_stops_between_steps(store, storage):
    ids = submit(store, ["gone 1", "gone 2"], num_inference_steps=10)

    def cancel_all(step: int, requests) -> None:
        if step == 2:
            for job_id in ids:
                store.cancel(job_id)

    renderer = ScriptedRenderer(at_step=cancel_all)
    outcome = runner(store, storage, renderer).run(messages(ids))
    assert (outcome.succeeded, outcome.failed, outcome.dropped) == (0, 0, 2)
    assert max(renderer.steps_run) == 2  # the step callback stopped the loop at once


def test_a_stale_attempt_records_and_writes_nothing(store, storage):
    """Another worker took the job over (its lease had expired) while this one rendered: the
    attempt number fences it, so this attempt's image is discarded before the upload."""
    (job_id,) = submit(store, ["taken over"])

    def take_over(step: int, requests) -> None:
        if step == 1:
            store.start_many([job_id], "other-worker", force=True)

    outcome = runner(store, storage, ScriptedRenderer(at_step=take_over)).run(messages([job_id]))
    assert (outcome.succeeded, outcome.dropped) == (0, 1)
    status = store.get_job(job_id)
    assert status.state == "running" and status.worker == "other-worker" and status.attempts == 2
    assert not storage.exists(f"{status.batch_id}/{job_id}.png")


def test_storage_away_sends_the_jobs_back_to_the_queue(store, farm_env):
    ids = submit(store, ["no bucket 1", "no bucket 2"])
    away = Storage(Settings(s3_endpoint_url="http://127.0.0.1:9"), max_attempts=1, connect_timeout_s=0.5)
    requeued: list[list[str]] = []
    outcome = runner(store, away, ScriptedRenderer(), upload_retry_s=0.0,
                     on_requeued=requeued.append).run(messages(ids))
    assert (outcome.succeeded, outcome.failed) == (0, 0) and sorted(outcome.requeued) == sorted(ids)
    assert requeued == [outcome.requeued]  # handed back for republishing
    for job_id in ids:
        status = store.get_job(job_id)
        assert status.state == "queued" and status.attempts == 1  # an attempt spent, the job kept


def test_malformed_duplicate_and_unknown_messages_start_nothing_twice(store, storage):
    (job_id,) = submit(store, ["only once"])
    bad = [SimpleNamespace(id="x1", kwargs={"job_id": 42}, args=()),
           SimpleNamespace(id="x2", kwargs="not a dict", args=()),
           SimpleNamespace(id="x3", kwargs={"job_id": "../../etc"}, args=())]
    renderer = ScriptedRenderer()
    outcome = runner(store, storage, renderer).run([*messages([job_id, job_id, "f" * 32]), *bad])
    assert (outcome.started, outcome.succeeded) == (1, 1)  # the duplicate and the unknown id are skipped
    assert renderer.calls == [["only once"]]


def test_overlapped_batches_render_while_others_are_stored_and_all_are_recorded(store, storage):
    """run_overlapped returns once the jobs are started; drain waits for every batch; a job canceled
    while its batch waits to render keeps no object; the outcomes come back once each."""
    first = submit(store, [f"a kettle {i}" for i in range(4)])
    second = submit(store, [f"a wide kettle {i}" for i in range(3)], width=128)
    renderer = ScriptedRenderer(step_s=0.05)
    run = runner(store, storage, renderer, pending_groups=1)
    assert run.run_overlapped(messages(first)) == []  # returns before rendering ends
    returned = run.run_overlapped(messages(second))
    assert {j.job_id for j in run.current_jobs()} <= set(first + second)
    assert store.cancel(second[0])
    outcomes = returned + run.drain()
    assert run.current_jobs() == [] and run.drain() == []
    assert sum(o.succeeded for o in outcomes) == 6 and sum(o.started for o in outcomes) == 7
    assert [store.get_job(j).state for j in first + second] == ["succeeded"] * 4 + ["canceled"] + ["succeeded"] * 2
    assert store.get_job(second[0]).result is None


def test_wrong_s3_credentials_release_the_jobs_unspent_and_name_the_infrastructure(store, storage, monkeypatch):
    ids = submit(store, [f"a gate {i}" for i in range(3)])
    with monkeypatch.context() as env:  # both of the storage's clients sign with the wrong secret
        env.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        refused = Storage(Settings(), max_attempts=1)
    requeued: list[list[str]] = []
    outcome = runner(store, refused, ScriptedRenderer(), on_requeued=requeued.append).run(messages(ids))
    assert (outcome.succeeded, outcome.failed) == (0, 0) and sorted(outcome.requeued) == sorted(ids)
    assert "403 Forbidden" in outcome.infrastructure and "<Code>SignatureDoesNotMatch</Code>" in outcome.infrastructure
    assert outcome.infrastructure.startswith("PermissionDeniedError"), outcome  # obstore's PUT said 403
    assert requeued == [outcome.requeued]
    for job_id in ids:
        status = store.get_job(job_id)
        assert status.state == "queued" and status.error is None
    assert all(int(store.r.hget(keys.job(j), "attempt_base")) == 1 for j in ids)  # the attempt was refunded
    assert credentials_problem(refused) and not credentials_problem(storage)


def test_a_device_error_spends_an_attempt_and_leaves_the_other_groups_unrendered(store, storage):
    ids = submit(store, ["a broken device"]) + submit(store, ["a wide one"], width=128)
    renderer = ScriptedRenderer(raise_exc=RuntimeError("CUDA error: an illegal memory access was encountered"))
    outcome = runner(store, storage, renderer).run(messages(ids))
    assert outcome.infrastructure.startswith("RuntimeError: CUDA error") and outcome.failed == 0
    assert sorted(outcome.requeued) == sorted(ids) and len(renderer.calls) == 1  # no bisection, second group skipped
    first, second = store.get_jobs(ids)
    assert first.state == second.state == "queued"
    assert store.r.hget(keys.job(ids[0]), "attempt_base") is None  # spent (a request can break a device)
    assert store.r.hget(keys.job(ids[1]), "attempt_base") == "1"  # released unrendered


def test_suspects_of_a_lost_worker_render_apart_in_halves_and_a_lone_loss_is_charged(store, storage):
    suspects = submit(store, [f"a suspect {i}" for i in range(4)])
    clean = submit(store, [f"a bystander {i}" for i in range(2)])
    held = list(store.start_many(suspects, "lost-worker").values())
    store.mark_rendering(held)  # rendering as a group of 4 when its worker died
    expire = JobStore(store.r, lease_s=0.0, max_attempts=3)
    expire.renew_leases(held)
    assert sorted(store.requeue_expired(suspects)) == sorted(suspects)
    assert all(int(store.r.hget(keys.job(j), "suspect_n")) == 4 for j in suspects)
    renderer = ScriptedRenderer()
    outcome = runner(store, storage, renderer).run(messages(suspects + clean))
    assert outcome.succeeded == 6
    assert sorted(len(c) for c in renderer.calls) == [2, 2, 2]  # bystanders together; suspects in halves of 4
    assert all(s.attempts == 2 and s.state == "succeeded" for s in store.get_jobs(suspects))
    (alone,) = submit(store, ["alone"])
    job = store.start_many([alone], "lost-worker")[alone]
    store.mark_rendering([job])
    expire.renew_leases([job])
    store.requeue_expired([alone])
    assert store.r.hget(keys.job(alone), "kills") == "1"  # lost while rendering alone: charged
    assert store.r.hget(keys.job(alone), "attempt_base") is None


def test_a_video_estimated_longer_than_the_job_timeout_gets_its_estimate_and_an_image_does_not(store, storage):
    # 20 steps of 0.05 s: each render takes about 1 s, over the 0.3 s job timeout. At 1 s per
    # megapixel-step a 64x64 video of 9 frames is estimated at 0.74 s (budget 3x: 2.2 s); the image 0.08 s.
    video = submit(store, ["a video"], num_inference_steps=20, kind="video", num_frames=9, fps=8)
    image = submit(store, ["an image"], num_inference_steps=20)
    renderer = ScriptedRenderer(step_s=0.05)
    outcome = runner(store, storage, renderer, job_timeout_s=0.3, s_per_mpx_step=1.0).run(messages(video + image))
    assert (outcome.succeeded, outcome.failed) == (1, 1)
    assert store.get_job(video[0]).state == "succeeded"
    failed = store.get_job(image[0])
    assert failed.state == "failed" and "job timeout of 0.3s" in failed.error.message


def test_a_video_estimated_within_the_job_timeout_still_times_out(store, storage):
    video = submit(store, ["a video"], num_inference_steps=20, kind="video", num_frames=9, fps=8)
    renderer = ScriptedRenderer(step_s=0.05)
    outcome = runner(store, storage, renderer, job_timeout_s=0.3, s_per_mpx_step=0.01).run(messages(video))
    assert outcome.failed == 1 and store.get_job(video[0]).error.type == "TimeoutError"
