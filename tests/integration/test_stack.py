"""Tests of the local-stack machinery (infra/localstack/): ports, run dirs, process groups, the
service classes and the session fixtures built on them; and the prompt files (producer/prompts.py).
The composed stack (``renderfarm up``, ``renderfarm demo``, LocalStack) is in test_stack_up.py.

Real processes: redis-server and SeaweedFS are started on free ports; nothing touches the
Redis on 6379. The process-group tests check that a stop leaves no process of the group alive.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from botocore.exceptions import ClientError

from infra.localstack import (
    ManagedProcess,
    ProcessExited,
    RedisServer,
    SeaweedS3,
    free_port,
    group_members,
    new_run_dir,
    patched_environ,
    redis_answers,
)
from infra.localstack.cli import register
from producer.demo import register as register_demo
from producer.demo import select_prompts
from producer.prompts import DEFAULT_PROMPTS, PromptFileError, load_prompts

PARTI_PROMPTS = Path(__file__).resolve().parents[2] / "producer" / "data" / "partiprompts" / "PartiPrompts.tsv"
REPO = Path(__file__).resolve().parents[2]


def _wait_for(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# -- ports and run dirs ------------------------------------------------------------------------


def test_free_port_hands_out_distinct_bindable_ports():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_free_port_with_offset_keeps_the_twin_free():
    port = free_port(offset_free=10000)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port + 10000))


def test_new_run_dir_prunes_old_dirs_of_dead_processes(tmp_path):
    dead_pid = 4_194_000  # above the usual pid_max of 32768 on small machines, and not ours
    for day in range(1, 8):
        (tmp_path / f"2020010{day}-000000-{dead_pid}").mkdir()
    alive = tmp_path / f"20190101-000000-{os.getpid()}"
    alive.mkdir()
    (tmp_path / "not-a-run-dir").mkdir()

    current = new_run_dir(tmp_path, keep=3)

    left = sorted(p.name for p in tmp_path.iterdir())
    assert current.name in left
    assert alive.name in left, "the run dir of a live process is never pruned"
    assert "not-a-run-dir" in left
    assert f"20200107-000000-{dead_pid}" in left and f"20200106-000000-{dead_pid}" in left
    assert f"20200101-000000-{dead_pid}" not in left


# -- ManagedProcess: process groups, readiness ----------------------------------------------------


def test_stop_escalates_to_sigkill_and_leaves_no_group_member(tmp_path):
    # Every member ignores SIGTERM (the ignore disposition is inherited across exec).
    proc = ManagedProcess("stubborn", ["bash", "-c", "trap '' TERM; sleep 300 & sleep 300 & wait"],
                          run_dir=tmp_path, stop_timeout=1.0)  # fmt: skip
    proc.start()
    pgid = proc.pgid
    assert _wait_for(lambda: len(group_members(pgid)) >= 3), group_members(pgid)
    members = group_members(pgid)

    started = time.monotonic()
    proc.stop()

    assert time.monotonic() - started >= 0.9, "SIGTERM was ignored, so stop had to wait, then SIGKILL"
    assert group_members(pgid) == []
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
    assert not proc.running
    assert proc.stop() == proc.returncode, "stop is idempotent"


def test_stop_reaches_orphaned_grandchildren(tmp_path):
    # The subshell exits at once; its sleep is orphaned (re-parented) but stays in the group.
    proc = ManagedProcess("orphans", ["bash", "-c", "(sleep 300 &); exec sleep 300"], run_dir=tmp_path)
    proc.start()
    pgid = proc.pgid
    assert _wait_for(lambda: len(group_members(pgid)) == 2)
    orphan = next(pid for pid in group_members(pgid) if pid != pgid)
    assert int(Path(f"/proc/{orphan}/stat").read_text().rsplit(")", 1)[1].split()[1]) != pgid

    proc.stop()

    assert group_members(pgid) == []


def test_wait_ready_reports_an_early_exit_with_the_log_tail(tmp_path):
    proc = ManagedProcess("crasher", [sys.executable, "-c", "print('boom: no config'); raise SystemExit(3)"],
                          ready=lambda: False, run_dir=tmp_path)  # fmt: skip
    proc.start()
    with pytest.raises(ProcessExited, match=r"(?s)crasher exited with code 3.*boom: no config"):
        proc.wait_ready(10)
    proc.stop()
    assert "boom: no config" in proc.log_path.read_text()


def test_wait_ready_times_out_and_says_so(tmp_path):
    proc = ManagedProcess("sleeper", ["sleep", "300"], ready=lambda: False, run_dir=tmp_path, ready_timeout=0.5)
    with pytest.raises(TimeoutError, match="sleeper not ready after"):
        with proc:  # the context manager stops what it started, even when readiness fails
            pass
    assert not proc.running


def test_readiness_probe_exceptions_mean_not_yet(tmp_path):
    calls = []

    def probe() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("not listening yet")
        return True

    with ManagedProcess("probe", ["sleep", "300"], ready=probe, run_dir=tmp_path) as proc:
        assert proc.running
    assert len(calls) == 3


def test_log_accumulates_across_restarts(tmp_path):
    proc = ManagedProcess("echo", ["bash", "-c", "echo hello-$$; exec sleep 300"], run_dir=tmp_path)
    proc.start()
    def greetings() -> list[str]:
        return re.findall(r"^hello-\d+$", proc.log_path.read_text(), flags=re.M)

    assert _wait_for(lambda: len(greetings()) == 1)
    proc.restart()
    assert _wait_for(lambda: len(greetings()) == 2)
    assert greetings()[0] != greetings()[1], "a new process"
    assert proc.log_path.read_text().count("\n=== ") == 2
    proc.stop()


@pytest.mark.parametrize("ending", ["os.kill(os.getpid(), signal.SIGKILL)", "sys.exit(0)"])
def test_children_do_not_outlive_their_parent(tmp_path, ending):
    """Killed outright (PR_SET_PDEATHSIG) or exiting without stop() (atexit): no orphan is left."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from infra.localstack import ManagedProcess
        p = ManagedProcess("child", ["sleep", "300"], run_dir={str(tmp_path)!r}).start()
        print(p.pid, flush=True)
        {ending}
    """)
    parent = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    child = int(parent.stdout.split()[0])
    assert _wait_for(lambda: group_members(child) == [], timeout=10), f"sleep {child} outlived its parent"


# -- RedisServer -----------------------------------------------------------------------------------


def test_redis_restart_with_aof_keeps_keys_on_the_same_port(tmp_path):
    server = RedisServer(appendonly=True, dir=tmp_path / "data", run_dir=tmp_path)
    with server:
        first_pid = server.pid
        server.client().set("job:1", "queued")
        server.restart()
        assert server.pid != first_pid
        assert server.url.endswith(f":{server.port}/0")
        assert server.client().get("job:1") == "queued"
    assert not redis_answers(server.url)
    assert group_members(first_pid) == []
    assert (tmp_path / "data").is_dir()


def test_redis_with_aof_always_survives_sigkill(tmp_path):
    server = RedisServer(appendonly=True, appendfsync="always", dir=tmp_path / "data", run_dir=tmp_path)
    with server:
        server.client().rpush("queue", "a", "b")
        server.kill()
        assert not redis_answers(server.url)
        server.start().wait_ready(30)
        assert server.client().lrange("queue", 0, -1) == ["a", "b"]


def test_redis_without_aof_starts_empty_after_restart(tmp_path):
    server = RedisServer(appendonly=False, dir=tmp_path / "data", run_dir=tmp_path)
    with server:
        server.client().set("k", "v")
        server.restart()
        assert server.client().get("k") is None, "--save '' and no AOF: nothing persists"


def test_redis_fixture_is_private(redis_server):
    assert redis_server.port != 6379
    assert redis_server.client().ping()


# -- SeaweedS3 -------------------------------------------------------------------------------------


@pytest.fixture
def bucket(s3_server):
    name = f"stack-test-{secrets.token_hex(4)}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def test_s3_put_get_and_presigned_url(s3_server, bucket):
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="a/b.png", Body=b"\x89PNG-bytes", ContentType="image/png",
                      Metadata={"seed": "7"})  # fmt: skip

    got = client.get_object(Bucket=bucket, Key="a/b.png")
    assert got["Body"].read() == b"\x89PNG-bytes"
    assert got["ContentType"] == "image/png"
    assert got["Metadata"] == {"seed": "7"}

    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "a/b.png"}, ExpiresIn=60)
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.content == b"\x89PNG-bytes"

    tampered = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(tampered, timeout=10).status_code == 403
    assert httpx.get(f"{s3_server.url}/{bucket}/a/b.png", timeout=10).status_code == 403, "anonymous read"


def test_s3_rejects_wrong_credentials(s3_server, bucket):
    no_retry = {"retries": {"max_attempts": 1}}
    with pytest.raises(ClientError) as wrong_secret:
        s3_server.client(secret_key="not-the-secret", **no_retry).put_object(Bucket=bucket, Key="x", Body=b"x")
    assert wrong_secret.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403

    with pytest.raises(ClientError) as unknown_key:
        s3_server.client(access_key="nobody", secret_key="nothing", **no_retry).list_buckets()
    assert unknown_key.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_patched_environ_makes_boto3_sign_with_the_new_keys(s3_server):
    import boto3

    def list_buckets_as(access_key: str, secret_key: str) -> int:
        env = {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
        with patched_environ(env):
            client = boto3.client("s3", endpoint_url=s3_server.url, region_name="us-east-1")
            try:
                return client.list_buckets()["ResponseMetadata"]["HTTPStatusCode"]
            except ClientError as exc:
                return exc.response["ResponseMetadata"]["HTTPStatusCode"]

    assert list_buckets_as(s3_server.access_key, s3_server.secret_key) == 200
    assert list_buckets_as("someone-else", "another-secret") == 403, "boto3 kept the first keys"


def test_s3_stop_and_restart_keeps_ports_and_objects(tmp_path, port_open):
    server = SeaweedS3(dir=tmp_path / "data", run_dir=tmp_path)
    with server:
        client = server.client()
        client.create_bucket(Bucket="restart-test")
        client.put_object(Bucket="restart-test", Key="k", Body=b"survives")
        ports = dict(server.ports)
        pgid = server.pgid

        server.stop()
        assert group_members(pgid) == []
        assert not port_open(server.port)

        server.start().wait_ready(60)
        assert server.ports == ports
        assert server.client().get_object(Bucket="restart-test", Key="k")["Body"].read() == b"survives"


# -- CLI registration ------------------------------------------------------------------------------


def test_up_and_demo_register_their_subcommands():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    register(subparsers)
    register_demo(subparsers)

    up = parser.parse_args(["up", "--workers", "2", "--model", "tiny", "--appendonly"])
    assert (up.workers, up.model, up.appendonly) == (2, "tiny", True)
    assert up.func.__name__ == "up_command"

    demo = parser.parse_args(["demo", "--count", "3", "--out", "x"])
    assert (demo.count, demo.width, demo.height, demo.steps, demo.workers) == (3, 256, 256, 8, 1)
    assert demo.out == Path("x") and demo.prompts is None
    assert demo.func.__name__ == "demo_command"


# -- prompts -----------------------------------------------------------------------------------


def test_load_prompts_reads_partiprompts_tsv():
    prompts = load_prompts(PARTI_PROMPTS)
    assert len(prompts) == 1632
    assert prompts[0] == "bond"
    assert all(p and p == p.strip() and "\t" not in p for p in prompts)
    assert any('"' in p for p in prompts), "quotes inside prompts are kept literally"


def test_load_prompts_reads_text_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("  a red fox  \n\n\t\na lighthouse, oil painting\r\nlast line without newline", encoding="utf-8")
    assert load_prompts(path) == ["a red fox", "a lighthouse, oil painting", "last line without newline"]


def test_load_prompts_finds_the_prompt_column_anywhere(tmp_path):
    path = tmp_path / "catalog.tsv"
    path.write_text("id\tPROMPT\tnote\n1\ta cat\tx\n2\t\ty\n3\ta dog\tz\n", encoding="utf-8")
    assert load_prompts(path) == ["a cat", "a dog"]


def test_load_prompts_text_with_a_bom(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffa cat\n".encode())
    assert load_prompts(path) == ["a cat"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", b"", "holds no prompts"),
        ("blank.txt", b"\n   \n\t\n", "holds no prompts"),
        ("header-only.tsv", b"Prompt\tCategory\n", "holds no prompts"),
        ("no-column.tsv", b"text\tcategory\na cat\tanimals\n", "without a 'Prompt' column"),
        ("latin1.txt", "café au lait\n".encode("latin-1"), "is not UTF-8"),
    ],
)
def test_load_prompts_rejects_bad_files_clearly(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PromptFileError, match=message) as error:
        load_prompts(path)
    assert name in str(error.value)


def test_load_prompts_rejects_missing_files_and_directories(tmp_path):
    with pytest.raises(PromptFileError, match="does not exist"):
        load_prompts(tmp_path / "nope.txt")
    with pytest.raises(PromptFileError, match="is a directory"):
        load_prompts(tmp_path)


def test_default_prompts_and_demo_selection():
    assert len(DEFAULT_PROMPTS) == 16 and len(set(DEFAULT_PROMPTS)) == 16
    assert select_prompts(DEFAULT_PROMPTS, 20, shuffle=False)[16:] == list(DEFAULT_PROMPTS[:4])

    pool = [f"p{i}" for i in range(100)]
    sample = select_prompts(pool, 10, seed=1)
    assert sample == select_prompts(pool, 10, seed=1), "deterministic"
    assert len(set(sample)) == 10 and sample != pool[:10]
    assert select_prompts(pool, 10, seed=2) != sample


# -- the session fixtures ------------------------------------------------------------------------


@pytest.mark.integration
def test_session_fixtures_bring_up_a_working_farm(farm_env, api_server, workers, redis_server, s3_server):
    from infra.settings import get_settings
    from infra.state.registry import live_workers

    assert os.environ["RENDERFARM_REDIS_URL"] == redis_server.url == get_settings().redis_url
    assert get_settings().api_url == api_server.url
    assert farm_env["AWS_ACCESS_KEY_ID"] == s3_server.access_key
    assert httpx.get(f"{api_server.url}/healthz", timeout=10).status_code == 200
    s3_server.client().head_bucket(Bucket=farm_env["RENDERFARM_S3_BUCKET"])

    registered = {w["name"]: w for w in live_workers(redis_server.client())}
    for worker in workers:
        assert worker.running
        assert registered[worker.worker_name]["model"] == "tiny"
        assert registered[worker.worker_name]["batch_size"] == 8
