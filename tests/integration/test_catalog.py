"""``renderfarm catalog`` against the session farm (tests/conftest.py): real API, workers on the
tiny model, SeaweedFS. Images are 64×64 with 2 steps. Every test writes its own catalog with a
fresh word in the template, so its content keys are its own.

The interruption test uses a model no worker serves and finishes jobs through the store, as a
worker would, so that jobs are surely still in flight when the run is interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from infra.schemas import JobResult
from infra.state.job_store import JobStore
from producer import RenderClient
from producer.catalog import StateDir, run_catalog

pytestmark = pytest.mark.integration
SMALL = {"width": 64, "height": 64, "num_inference_steps": 2}
SMALL_ARGS = ["--width", "64", "--height", "64", "--steps", "2", "--poll-interval", "0.3"]
UNSERVED = "catalog-unserved"


@pytest.fixture(scope="module")
def store(redis_server) -> JobStore:
    return JobStore(redis_server.client())


def _nonce() -> str:
    return uuid.uuid4().hex[:8]


def _csv(path, rows):
    path.write_text("id,name,color\n" + "".join(f"{i},{n},{c}\n" for i, n, c in rows), encoding="utf-8")
    return path


def _cli(*args: str, env_extra: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", "catalog", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env_extra or {})}, **kw)


def test_csv_run_rerun_and_one_changed_item(client, tmp_path):
    template = f"a photo of a {{color}} {{name}} {_nonce()}"
    rows = [("a", "mug", "red"), ("b", "lamp", "blue"), ("c", "chair", "green"), ("d", "kettle", "white")]
    path = _csv(tmp_path / "c.csv", rows)

    first = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert (first["rendered"], first["skipped"], first["failed"]) == (4, 0, 0), first["failures"]
    assert first["format"] == "csv" and first["items"] == 4 and first["failures"] == []
    assert first["wall_seconds"] > 0 and first["images_per_second"] > 0 and len(first["batches"]) == 1

    again = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert (again["rendered"], again["skipped"], again["failed"]) == (0, 4, 0)
    assert again["batches"] == [] and again["images_per_second"] == 0

    _csv(path, rows[:2] + [("c", "chair", "yellow")] + rows[3:])
    changed = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert (changed["rendered"], changed["skipped"], changed["failed"]) == (1, 3, 0)
    job = client.job(client.batch_jobs(changed["batches"][0])[0].job_id)
    assert "yellow chair" in job.request.prompt and job.result.width == 64


def test_report_manifest_says_where_each_items_image_is(client, tmp_path, farm_env):
    import httpx

    from infra.storage.images import parse_parameters, read_parameters

    template = f"a {{color}} {{name}}, {_nonce()}"
    path = _csv(tmp_path / "m.csv", [("a", "cup", "red"), ("b", "cup", "red"), ("c", "bowl", "teal")])
    first = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    manifest = first["manifest"]
    assert [m["id"] for m in manifest] == ["a", "b", "c"]  # every item, the duplicate sharing its image
    assert manifest[0]["s3_key"] == manifest[1]["s3_key"] != manifest[2]["s3_key"]
    for entry in manifest:
        job = client.job(entry["job_id"])
        assert entry["s3_key"] == job.result.key == f"{job.batch_id}/{job.job_id}.png"
        image = httpx.get(entry["url"], timeout=30)  # a presigned GET: no credentials
        assert image.status_code == 200 and parse_parameters(read_parameters(image.content))["prompt"] == \
            job.request.prompt
    # a re-run that renders nothing still says where every image is
    again = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert again["skipped"] == 3 and [m["s3_key"] for m in again["manifest"]] == [m["s3_key"] for m in manifest]


def test_jsonl_with_item_parameters_duplicates_and_a_failing_item_via_cli(client, tmp_path):
    word = _nonce()
    lines = [
        {"id": "fox", "name": "fox", "seed": 5},
        {"id": "tall", "name": "tower", "height": 128},
        {"id": "bad", "name": "owl", "width": "100"},       # not a multiple of 8: fails validation
        {"id": "fox-again", "name": "fox", "seed": 5},     # same content as "fox": one image
        {"id": "nameless", "colour": "red"},               # lacks the template's field
    ]
    path = tmp_path / "items.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    report_path = tmp_path / "out" / "report.json"
    proc = _cli(str(path), "--template", f"a {{name}} {word}", "--model", "tiny", "--report", str(report_path),
                *SMALL_ARGS)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(report_path.read_text())
    assert (report["items"], report["distinct_images"]) == (5, 2)
    assert (report["rendered"], report["skipped"], report["failed"]) == (3, 0, 2)
    failures = {f["id"]: f for f in report["failures"]}
    assert set(failures) == {"bad", "nameless"}
    assert failures["bad"]["index"] == 2 and failures["bad"]["line"] == 3
    assert failures["bad"]["error"] == {"type": "ValidationError",
                                        "message": "width: Value error, width must be a multiple of 8, got 100"}
    assert failures["nameless"]["error"]["type"] == "TemplateError"
    assert [m["id"] for m in report["manifest"]] == ["fox", "tall", "fox-again"]  # the failed items have no image
    assert "'name'" in failures["nameless"]["error"]["message"] and "line 5" in failures["nameless"]["error"]["message"]
    assert "failed: item 'bad' (line 3): ValidationError" in proc.stderr
    jobs = client.batch_jobs(report["batches"][0])
    assert sorted((j.result.width, j.result.height) for j in jobs) == [(64, 64), (64, 128)]
    assert [j.result.seed for j in jobs if "fox" in j.request.prompt] == [5]

    again = _cli(str(path), "--template", f"a {{name}} {word}", "--model", "tiny", "--report", str(report_path),
                 *SMALL_ARGS)
    report = json.loads(report_path.read_text())
    assert again.returncode == 1 and (report["rendered"], report["skipped"], report["failed"]) == (0, 3, 2)


def test_template_errors_exit_2_before_anything_is_sent(api_server, tmp_path):
    path = _csv(tmp_path / "c.csv", [("a", "mug", "red")])
    report_path = tmp_path / "report.json"
    proc = _cli(str(path), "--template", "a {name} in {colour}", "--report", str(report_path))
    assert proc.returncode == 2 and "no item has a field 'colour'" in proc.stderr
    assert "colour" in json.loads(report_path.read_text())["error"]
    proc = _cli(str(path), "--template", "a {name.__class__}")
    assert proc.returncode == 2 and "attribute or index access" in proc.stderr


def _finish(store: JobStore, job_ids, s3, bucket: str) -> None:
    """Succeed queued jobs as a worker would (their model has no worker), image object included:
    a catalog skips an item only after a HEAD of its image."""
    for job_id, started in store.start_many(list(job_ids), "pytest-catalog").items():
        assert not isinstance(started, str), (job_id, started)
        key = f"{started.batch_id}/{job_id}.png"
        s3.put_object(Bucket=bucket, Key=key, Body=b"\x89PNG\r\n\x1a\n", ContentType="image/png")
        assert store.succeed(started, JobResult(key=key, width=64, height=64, seed=started.request.seed,
                                                content_type="image/png", bytes=8))


def test_interrupted_run_resumes_without_rendering_anything_twice(api_server, store, tmp_path, s3_server,
                                                                  farm_env):
    rows = [(str(i), f"thing{i}", "grey") for i in range(8)]
    path = _csv(tmp_path / "c.csv", rows)
    template = f"a {{name}} {_nonce()}"
    report_path = tmp_path / "report.json"
    s3, bucket = s3_server.client(), farm_env["RENDERFARM_S3_BUCKET"]
    args = [str(path), "--template", template, "--model", UNSERVED, "--report", str(report_path), *SMALL_ARGS]

    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "catalog", *args], stderr=subprocess.PIPE,
                            text=True)
    with RenderClient() as client:
        from producer.catalog import prepare_catalog

        plans, _ = prepare_catalog(path, template, model=UNSERVED, params=SMALL)
        keys = [p.key for p in plans]
        deadline = time.monotonic() + 60
        while not all((entries := client.catalog_lookup(keys)).values()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.2)
        first_jobs = {k: e["job_id"] for k, e in entries.items()}
        proc.send_signal(signal.SIGINT)  # Ctrl-C while every job is queued
        assert proc.wait(timeout=60) == 130
        assert "a re-run resumes" in proc.stderr.read()
        interrupted = json.loads(report_path.read_text())
        assert interrupted["interrupted"] and interrupted["pending"] == 8 and interrupted["rendered"] == 0

        _finish(store, [first_jobs[k] for k in keys[:3]], s3, bucket)  # the farm works on, unwatched
        rerun = subprocess.Popen([sys.executable, "-m", "infra.cli", "catalog", *args], stderr=subprocess.PIPE,
                                 text=True)
        line = ""
        while not line.startswith("catalog:"):  # it has looked the keys up, and waits for the 5 still queued
            line = rerun.stderr.readline()
            assert line or rerun.poll() is None, rerun.stderr.read()
        assert "3 already rendered, 5 in flight from an earlier run, 0 to submit" in line, line
        _finish(store, [first_jobs[k] for k in keys[3:]], s3, bucket)
        assert rerun.wait(timeout=120) == 0, rerun.stderr.read()
        report = json.loads(report_path.read_text())
        assert (report["rendered"], report["skipped"], report["failed"], report["resumed"]) == (5, 3, 0, 5)
        assert not report["interrupted"]
        # the same jobs throughout: nothing was submitted twice
        assert {k: e["job_id"] for k, e in client.catalog_lookup(keys).items()} == first_jobs
        assert all(store.get_job(j).attempts == 1 for j in first_jobs.values())


def test_an_item_whose_image_is_gone_is_rendered_again(client, tmp_path, s3_server, farm_env):
    """The catalog skips an item only after a HEAD of its image; an image
    deleted from the bucket (a wiped local stack) makes its item render again."""
    template = f"a {{color}} {{name}}, {_nonce()}"
    path = _csv(tmp_path / "g.csv", [("a", "vase", "red"), ("b", "vase", "blue"), ("c", "vase", "grey")])
    first = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert first["rendered"] == 3
    gone = first["manifest"][1]
    s3_server.client().delete_object(Bucket=farm_env["RENDERFARM_S3_BUCKET"], Key=gone["s3_key"])
    again = run_catalog(path, template, client=client, model="tiny", params=SMALL, poll_s=0.3)
    assert (again["rendered"], again["skipped"], again["failed"]) == (1, 2, 0)
    redone = next(m for m in again["manifest"] if m["id"] == "b")
    assert redone["s3_key"] != gone["s3_key"] and client.job(redone["job_id"]).state == "succeeded"


def test_state_dir_skips_only_items_whose_image_the_farm_confirms(client, tmp_path, s3_server, farm_env):
    """With ``--state-dir``, an item the state dir records as done is skipped
    only when the farm confirms its image (the lookup's HEAD); one whose object was deleted from
    SeaweedFS is submitted again, and the others are skipped."""
    word = _nonce()
    path = _csv(tmp_path / "s.csv", [("a", "jug", "red"), ("b", "jug", "blue"), ("c", "jug", "grey")])
    report_path, state_dir = tmp_path / "report.json", tmp_path / "state"
    args = [str(path), "--template", f"a {{color}} {{name}}, {word}", "--model", "tiny", "--report",
            str(report_path), "--state-dir", str(state_dir), *SMALL_ARGS]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr
    report = json.loads(report_path.read_text())
    assert (report["rendered"], report["skipped"]) == (3, 0)
    assert report["state_dir"] == {"recorded": 0, "confirmed": 0, "unconfirmed": 0}
    recorded = StateDir(state_dir).load()
    by_id = {m["id"]: m for m in report["manifest"]}
    assert set(recorded) == {m["key"] for m in by_id.values()}
    s3_server.client().delete_object(Bucket=farm_env["RENDERFARM_S3_BUCKET"], Key=by_id["b"]["s3_key"])

    again = _cli(*args)
    assert again.returncode == 0, again.stderr
    assert "3 recorded in --state-dir, 1 of them without an image now" in again.stderr, again.stderr
    report = json.loads(report_path.read_text())
    assert (report["rendered"], report["skipped"], report["failed"]) == (1, 2, 0)
    assert report["state_dir"] == {"recorded": 3, "confirmed": 2, "unconfirmed": 1}
    (batch_id,) = report["batches"]
    (job,) = client.batch_jobs(batch_id)  # only the item whose image was gone was submitted
    assert job.state == "succeeded" and "blue jug" in job.request.prompt
    assert job.request.metadata["catalog_key"] == by_id["b"]["key"]
    redone = {m["id"]: m for m in report["manifest"]}
    assert redone["b"]["job_id"] == job.job_id != by_id["b"]["job_id"]
    assert {i: redone[i]["job_id"] for i in "ac"} == {i: by_id[i]["job_id"] for i in "ac"}
    assert StateDir(state_dir).load()[by_id["b"]["key"]] == job.job_id  # recorded anew
