"""Tests of the composed local stack: ``renderfarm up`` (its lifetime, signals, client settings
file, port checks), ``renderfarm demo`` end to end, and :class:`LocalStack` reusing an answering
Redis.

Place in the data flow: the whole path (producer → queue → worker → pipeline → storage → status)
as one developer command brings it up. Each test starts its own stack on free ports (its own
redis-server, SeaweedFS and API, no worker unless the test renders), because each stops it.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from infra.localstack import LocalStack, ManagedProcess, free_port, group_members, patched_environ
from infra.localstack.services import cli_command

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_up_serves_until_signalled_then_leaves_nothing_behind(private_env, tmp_path, sig):
    # A ManagedProcess itself, so that even a killed pytest leaves no `up` behind.
    ports = ("--api-port", str(free_port()), "--s3-port", str(free_port()))
    up = ManagedProcess("up", cli_command("up", "--workers", "0", *ports), env=private_env(),
                        run_dir=tmp_path, cwd=REPO,
                        ready=lambda: "Ctrl-C stops everything" in (tmp_path / "up.log").read_text(),
                        ready_timeout=180)  # fmt: skip
    with up:
        output = up.log_path.read_text()
        pids = [int(pid) for pid in re.findall(r"^✓ .* pid (\d+)\s*$", output, flags=re.M)]
        assert len(pids) == 3, output  # redis (its own: none answered), seaweedfs, api
        api_url = re.search(r"^export RENDERFARM_API_URL=(\S+)$", output, flags=re.M).group(1)
        assert httpx.get(f"{api_url}/healthz", timeout=10).status_code == 200

        up.send_signal(sig)
        assert up.proc.wait(timeout=120) == 0, up.log_tail()
    assert "stopped." in up.log_path.read_text()
    for pid in pids:
        assert group_members(pid) == [], f"pid {pid} outlived `renderfarm up`"


def _up(env: dict[str, str | None], run_dir: Path, cwd: Path, *args: str, env_file: bool = True) -> ManagedProcess:
    """``renderfarm up --workers 0 ARGS…`` in ``cwd`` with the overrides ``env`` (``private_env()``),
    ready once it says how to stop it; without RENDERFARM_ENV_FILE when ``env_file`` (so it writes
    ``cwd/.renderfarm/env``)."""
    if env_file:
        env["RENDERFARM_ENV_FILE"] = None
    return ManagedProcess("up", cli_command("up", "--workers", "0", *args), env=env, run_dir=run_dir, cwd=cwd,
                          ready=lambda: "Ctrl-C stops everything" in (run_dir / "up.log").read_text(),
                          ready_timeout=180)


def _client(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``argv`` run in ``cwd`` as a new shell would run it: no RENDERFARM_* or AWS_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RENDERFARM_", "AWS_"))}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.integration
def test_up_writes_client_settings_that_other_shells_read(private_env, tmp_path):
    project, run = tmp_path / "project", tmp_path / "run"
    (project / "sub" / "dir").mkdir(parents=True)
    api_port, s3_port = free_port(), free_port()
    env_file = project / ".renderfarm" / "env"
    with _up(private_env(), run, project, "--api-port", str(api_port), "--s3-port", str(s3_port)) as up:
        output = up.log_path.read_text()
        assert f"Dashboard: http://127.0.0.1:{api_port}/" in output
        assert env_file.stat().st_mode & 0o777 == 0o600, "it holds the S3 secret"
        text = env_file.read_text()
        assert f"RENDERFARM_API_URL=http://127.0.0.1:{api_port}\n" in text
        assert f"RENDERFARM_S3_ENDPOINT_URL=http://127.0.0.1:{s3_port}\n" in text

        # a shell in a directory below, with no exports: the CLI reaches this API (an unknown
        # id is its 404), and boto3 gets the file's S3 keys
        status = _client(*cli_command("status", "0" * 32), cwd=project / "sub" / "dir")
        assert status.returncode == 2 and "unknown batch id" in status.stderr, status.stderr
        probe = ("from infra.settings import get_settings; from infra.storage.s3 import Storage; "
                 "s = get_settings(); Storage(s).client.head_bucket(Bucket=s.s3_bucket); print(s.api_url)")
        seen = _client(sys.executable, "-c", probe, cwd=project / "sub")
        assert seen.returncode == 0 and seen.stdout.strip() == f"http://127.0.0.1:{api_port}", seen.stderr
        # the environment still wins over the file
        env_url = "http://127.0.0.1:9"
        overridden = subprocess.run([sys.executable, "-c", "from infra.settings import get_settings; "
                                     "print(get_settings().api_url)"], cwd=project, capture_output=True, text=True,
                                    env={**{k: v for k, v in os.environ.items() if k != "RENDERFARM_ENV_FILE"},
                                         "RENDERFARM_API_URL": env_url}, timeout=60)
        assert overridden.stdout.strip() == env_url, overridden.stderr
        up.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=120) == 0, up.log_tail()
    assert not env_file.exists(), "`up` removes its client settings when it stops"


@pytest.mark.integration
def test_up_refuses_a_busy_port_and_names_its_holder(private_env, port_open, tmp_path):
    busy = free_port()
    holder = ManagedProcess("holder", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(busy)],
                            run_dir=tmp_path, ready=lambda: port_open(busy))  # fmt: skip
    with holder:
        up = _up(private_env(), tmp_path / "run", tmp_path, "--api-port", str(busy), "--s3-port", str(free_port()),
                 env_file=False)
        up.start()
        try:
            assert up.proc.wait(timeout=120) == 1
        finally:
            up.stop()
        output = " ".join(up.log_path.read_text().split())
        assert f"port {busy} is in use by pid {holder.pid} (" in output and "http.server" in output, output
        assert "--api-port" in output
        assert "✓" not in output, "nothing was started"


@pytest.mark.integration
def test_demo_renders_a_small_batch_end_to_end(private_env, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\na lighthouse\na bowl of ramen\n", encoding="utf-8")
    out = tmp_path / "out"
    demo = ManagedProcess(
        "demo",
        cli_command("demo", "--prompts", str(prompts), "--count", "4", "--workers", "1", "--steps", "2",
             "--width", "64", "--height", "64", "--timeout", "300", "--out", str(out)),  # fmt: skip
        env=private_env(), run_dir=tmp_path, cwd=REPO, stop_timeout=90,
    )
    demo.start()
    try:
        returncode = demo.proc.wait(timeout=900)
    finally:
        demo.stop()
    output = demo.log_path.read_text()
    assert returncode == 0, output
    assert re.search(r"succeeded\s*│\s*4\b", output), output
    assert re.search(r"failed\s*│\s*0\b", output), output
    images = sorted(out.glob("*.png"))
    assert len(images) == 4
    assert all(path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for path in images)
    # a newcomer learns where the images are that tiny renders noise, and how to render a real model
    flat = " ".join(output.split())
    assert "tiny is an offline build with random weights" in flat and "coloured noise" in flat, output
    assert "--model stable-diffusion-v1-5/stable-diffusion-v1-5" in flat and "--device cuda" in flat, output


@pytest.mark.integration
def test_local_stack_reuses_an_answering_redis_and_renders(redis_server, cache_dir, tmp_path):
    from infra.schemas import RenderRequest
    from producer import RenderClient

    # Database 1: the session's workers serve the same queue names on database 0.
    redis_url = redis_server.db_url(1)
    stack = LocalStack(workers=1, redis_url=redis_url, bucket="stack-reuse", cache_dir=cache_dir,
                       run_dir=tmp_path, console=Console(file=io.StringIO()))  # fmt: skip
    with stack:
        assert stack.redis is None, "a Redis answered, so none was started"
        assert stack.env["RENDERFARM_REDIS_URL"] == redis_url
        assert stack.env["RENDERFARM_S3_BUCKET"] == "stack-reuse"
        with patched_environ(stack.env), RenderClient(api_url=stack.api.url) as client:
            batch = client.submit_batch([RenderRequest(prompt="a red fox", model="tiny", width=64, height=64,
                                                       num_inference_steps=2, seed=7)])  # fmt: skip
            [status] = client.wait(batch.batch_id, timeout=300, progress=False)
            assert status.state == "succeeded", status
            assert client.fetch_image(status.job_id).size == (64, 64)
        pgids = [p.pgid for p in stack.processes]
    assert all(group_members(pgid) == [] for pgid in pgids)
    assert redis_server.client().ping(), "a reused Redis is left running"
