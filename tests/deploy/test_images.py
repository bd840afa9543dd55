"""deploy/docker's api and worker-cpu images built here, and the chart's pods started from
``helm template`` output as containers (tests/deploy/pod_runner.py), against this session's
redis-server and SeaweedFS.

No registry is reachable: the base image comes from debootstrap (tests/deploy/docker_images.py),
torch from a loopback wheel index, everything else from PyPI. Skipped, with the reason, only where
this machine has no Docker to run (not Linux, not root, or no dockerd and no Docker socket after
deploy/docker-tools.sh tried to install docker.io); a dockerd that is installed but does not
start fails them, with its log's tail.

The chart is rendered with its defaults (auth on, KEDA trigger with the chart's
TriggerAuthentication) except: Redis is this session's redis-server (``redis.url``, database
9, ``redis.bundled.enabled=false``: the bundled StatefulSet runs Docker Hub's ``redis`` image),
S3 is this session's SeaweedFS, the API listens on a free port, and one API replica.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from infra.localstack import ensure_bucket, free_port, stack_env
from producer.client import RenderClient
from tests.deploy import docker_images
from tests.deploy.conftest import CHART, run_helm
from tests.deploy.pod_runner import Pod, PodRunner

pytestmark = [pytest.mark.integration, pytest.mark.images, pytest.mark.long]

NAMESPACE = "render"
RELEASE = "farm"
POOL = "cpu-tiny"
REDIS_DB = 9
BUCKET = "renders-images"
IMAGES = {"api": ("api.Dockerfile", "renderfarm/api:0.1.0"),
          "worker-cpu": ("worker-cpu.Dockerfile", "renderfarm/worker-cpu:0.1.0")}
# 256x256, 10 steps: a batch takes seconds here, well inside the pool's 90 s grace period
# (longestBatchSeconds 60 + margin), and 32 jobs are many batches, so SIGTERM finds jobs in flight
N_SIGTERM = 32
REQUEST = {"prompt": "a lighthouse at dusk", "model": "tiny", "width": 64, "height": 64, "num_inference_steps": 2}


def say(line: str) -> None:
    """The runner's and the builds' lines, shown with ``pytest -s`` and kept in the report."""
    print(f"[images] {line}", flush=True)


@pytest.fixture(scope="module")
def dockerd() -> Iterator[docker_images.Dockerd]:
    """A private dockerd. Skips (the reason in the summary) only where this machine has no Docker
    to run (:func:`tests.deploy.docker_images.unavailable`); a dockerd that is installed but does
    not start (e.g. a container without the privileges it needs) fails the tests with its log's tail."""
    try:
        reason = docker_images.unavailable()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    if reason:
        pytest.skip(f"images not built: {reason}")
    run_dir = Path(tempfile.mkdtemp(prefix="rf-dockerd-", dir="/tmp"))  # short: unix socket paths
    daemon = docker_images.Dockerd(run_dir)
    try:
        try:
            daemon.__enter__()
        except RuntimeError as exc:
            pytest.fail(f"dockerd is installed here, so the image tests need it: {exc}", pytrace=False)
        yield daemon
    finally:
        daemon.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def images(dockerd: docker_images.Dockerd) -> dict[str, tuple[float, int]]:
    """Build the base image, then api and worker-cpu: {name: (build seconds, image bytes)}."""
    built: dict[str, tuple[float, int]] = {}
    started = time.monotonic()
    base = docker_images.base_image(dockerd)
    built["base"] = (time.monotonic() - started, dockerd.image_size(base))
    with docker_images.WheelIndex(dockerd.run_dir) as index:
        for name, (dockerfile, tag) in IMAGES.items():
            args = {"PYTHON_IMAGE": base, "PIP_INDEX_URL": index.url, "TORCH_INDEX_URL": index.url}
            seconds = docker_images.build(dockerd, dockerfile, tag, args)
            built[name] = (seconds, dockerd.image_size(tag))
    # the images these tags replaced (and their layers) would pile up in the cached data root
    dockerd.docker("image", "prune", "--force", timeout=600)
    for name, (seconds, size) in built.items():
        say(f"image {name:<11} built in {seconds:7.1f} s, {size / 1e6:8.1f} MB")
    return built


@pytest.fixture(scope="module")
def chart(helm, redis_server, s3_server, dockerd, images) -> Iterator[tuple[PodRunner, list[dict]]]:
    """The chart rendered for this machine and its pods started (not yet waited for)."""
    redis_url = f"{redis_server.url.rsplit('/', 1)[0]}/{REDIS_DB}"
    redis_server.client(REDIS_DB).flushdb()
    env = stack_env(redis_url=redis_url, s3_endpoint_url=s3_server.url, access_key=s3_server.access_key,
                    secret_key=s3_server.secret_key, bucket=BUCKET, api_url="http://unused", cache_dir=dockerd.run_dir)
    ensure_bucket(env)
    port = free_port()
    sets = {"redis.bundled.enabled": "false", "redis.url": redis_url, "s3.endpointUrl": s3_server.url,
            "s3.bucket": BUCKET, "s3.accessKeyId": s3_server.access_key,
            "s3.secretAccessKey": s3_server.secret_key, "api.port": str(port), "api.service.port": str(port),
            "api.replicas": "1"}
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    for k, v in sets.items():
        args += ["--set-string" if k.endswith(("Key", "accessKeyId")) else "--set", f"{k}={v}"]
    docs = [d for d in yaml.safe_load_all(run_helm(helm, *args).stdout) if d]
    runner = PodRunner(docs, dockerd, NAMESPACE, dockerd.run_dir, log=say)
    try:
        runner.start_all()
        yield runner, docs
    finally:
        for pod in runner.pods.values():
            (dockerd.run_dir / f"{pod.name}.log").write_text(runner.logs(pod, tail=2000))
        runner.remove_all()
        redis_server.client(REDIS_DB).flushdb()


def _pod(runner: PodRunner, component: str) -> Pod:
    return next(p for p in runner.pods.values() if p.name.startswith(f"{RELEASE}-renderfarm-{component}"))


def _api_url(runner: PodRunner) -> str:
    """The API through its Service's DNS name's loopback address (as the chart's ConfigMap names it)."""
    address = runner.services[f"{RELEASE}-renderfarm-api"]
    port = runner.pods[_pod(runner, "api").name].container["ports"][0]["containerPort"]
    return f"http://{address}:{port}"


@pytest.fixture(scope="module")
def api_key(chart) -> str:
    """A tenant key, created as the chart's NOTES say: ``kubectl exec deploy/…-api -- renderfarm keys create``."""
    runner, _ = chart
    api = _pod(runner, "api")
    runner.wait_ready(api, timeout=120)
    out = runner.exec(api, "renderfarm", "keys", "create", "--tenant", "images")
    return out.splitlines()[0].strip()


def _scrape_token(docs: list[dict]) -> str:
    """The bearer token KEDA would send: the chart's TriggerAuthentication → its Secret's key."""
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (trigger,) = [t for d in docs if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    assert trigger["metadata"]["authMode"] == "bearer"
    auth = objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    (ref,) = [r for r in auth["spec"]["secretTargetRef"] if r["parameter"] == "token"]
    return base64.b64decode(objects[("Secret", ref["name"])]["data"][ref["key"]]).decode()


def _get(url: str, token: str | None = None, api_key: str | None = None) -> tuple[int, dict | list | None]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if api_key:
        headers["X-API-Key"] = api_key
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_images_built(images, dockerd) -> None:
    """Both images exist; the API image has no torch (its [api] extra leaves the ML stack out)."""
    assert set(images) == {"base", *IMAGES}
    no_torch = dockerd.docker("run", "--rm", "--pull", "never", "--network", "host", "--entrypoint", "python",
                              IMAGES["api"][1], "-c", "import torch", check=False)
    assert no_torch.returncode != 0 and "torch" in no_torch.stderr
    torch = dockerd.docker("run", "--rm", "--pull", "never", "--network", "host", "--entrypoint", "python",
                           IMAGES["worker-cpu"][1], "-c", "import torch; print(torch.__version__)")
    assert torch.stdout.strip() == f"{docker_images.TORCH_VERSION}+cpu"


def test_api_pod_is_ready_and_live(chart, api_key) -> None:
    runner, _ = chart
    api = _pod(runner, "api")
    assert runner.probe(api, "readinessProbe")[0]
    ok, seen = runner.probe(api, "livenessProbe")
    assert ok, seen
    assert _get(f"{_api_url(runner)}/v1/queues/{POOL}")[0] == 401  # auth on: no credential, no answer


def test_worker_pod_joins(chart, api_key) -> None:
    runner, _ = chart
    worker = _pod(runner, "worker")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert runner.state(worker)["Running"], runner.logs(worker)
        status, rows = _get(f"{_api_url(runner)}/v1/workers", api_key=api_key)
        assert status == 200
        mine = [w for w in rows or [] if worker.name in json.dumps(w)]
        if mine:
            say(f"{worker.name}: joined: {json.dumps(mine[0])[:300]}")
            return
        time.sleep(2)
    pytest.fail(f"{worker.name} never showed in /v1/workers:\n{runner.logs(worker)}")


def test_a_job_renders_in_the_worker_pod_and_fetches_from_s3(chart, api_key) -> None:
    runner, _ = chart
    worker = _pod(runner, "worker")
    with RenderClient(api_url=_api_url(runner), api_key=api_key) as client:
        accepted = client.submit_batch([REQUEST])
        client.wait(accepted.batch_id, timeout=180)
        (job,) = client.batch_jobs(accepted.batch_id)
        assert job.state == "succeeded", job
        assert worker.name in (job.worker or ""), job.worker
        png = client.fetch_bytes(job)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    say(f"job {job.job_id}: rendered by {job.worker}, {len(png)} bytes fetched from S3")


def test_sigterm_stops_the_worker_cleanly_and_loses_no_job(chart, api_key) -> None:
    """SIGTERM while a batch is in flight: the worker exits 0 within its grace period; every job
    is then succeeded or queued again, and a new worker pod finishes the queued ones."""
    runner, docs = chart
    worker = _pod(runner, "worker")
    with RenderClient(api_url=_api_url(runner), api_key=api_key) as client:
        accepted = client.submit_batch([{**REQUEST, "width": 256, "height": 256, "num_inference_steps": 10, "seed": i}
                                         for i in range(N_SIGTERM)])
        deadline = time.monotonic() + 120
        while not any(j.state in ("running", "succeeded") for j in client.batch_jobs(accepted.batch_id)):
            assert time.monotonic() < deadline, runner.logs(worker)
            time.sleep(0.5)
        state = runner.stop(worker)
        assert state["ExitCode"] == 0 and not state["OOMKilled"], runner.logs(worker)
        states = [j.state for j in client.batch_jobs(accepted.batch_id)]
        say(f"after SIGTERM: {sorted((s, states.count(s)) for s in set(states))}")
        assert set(states) <= {"succeeded", "queued"}, states
        assert "queued" in states, "the batch ended before SIGTERM: nothing was in flight"
        workload = next(d for d in docs if f"{d['kind']}/{d['metadata']['name']}" == worker.workload)
        runner.dockerd.docker("rm", "-v", worker.container_id)
        del runner.pods[worker.name]
        again = runner.start(workload)
        client.wait(accepted.batch_id, timeout=300)
        final = [j.state for j in client.batch_jobs(accepted.batch_id)]
        assert final == ["succeeded"] * N_SIGTERM, final
        say(f"{again.name}: finished the rest of the batch: {len(final)} succeeded, none lost")


def test_keda_metric_reads_outstanding_with_the_charts_credentials(chart, api_key) -> None:
    """With the workers stopped, N submitted jobs are the pool's outstanding count, read at the
    ScaledObject's URL with the TriggerAuthentication's bearer token (the rendered Secret's)."""
    runner, docs = chart
    runner.stop(_pod(runner, "worker"))
    (trigger,) = [t for d in docs if d["kind"] == "ScaledObject" for t in d["spec"]["triggers"]]
    url = trigger["metadata"]["url"].replace(f"http://{RELEASE}-renderfarm-api.{NAMESPACE}.svc:",
                                             f"http://{runner.services[f'{RELEASE}-renderfarm-api']}:")
    with RenderClient(api_url=_api_url(runner), api_key=api_key) as client:
        client.submit_batch([{**REQUEST, "seed": i} for i in range(3)])
    status, body = _get(url, token=_scrape_token(docs))
    say(f"GET {trigger['metadata']['url']} with the TriggerAuthentication's token → {status} {body}")
    assert status == 200
    assert isinstance(body, dict) and body[trigger["metadata"]["valueLocation"]] == 3
    assert _get(url, token="not-the-token")[0] == 401
