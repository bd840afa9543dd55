"""``renderfarm up``'s supervision and persistent data, on real
processes: a crashed child restarts with exponential backoff, and the stack's own redis-server
and SeaweedFS keep their data together in one directory across a stop and a start."""

from __future__ import annotations

import sys
import time

import pytest
from rich.console import Console

from infra.localstack import LocalStack, ManagedProcess, patched_environ
from infra.localstack.supervisor import CrashLoop, ServiceEvent, Supervisor
from infra.storage.s3 import Storage

pytestmark = pytest.mark.integration


def test_supervisor_restarts_a_crashing_child_with_backoff(tmp_path):
    """Four crashes in a row: the delays the supervisor announces double from ``base_s`` and stop
    at ``max_s`` (the policy has no jitter), and no restart comes before the child's 0.2 s of life
    and then its delay have passed since the previous start (``Popen`` returns once the child has
    exec'd, so its sleep starts after the start is recorded; a lower bound that a slow machine
    only adds to)."""
    crasher = ManagedProcess("crasher", [sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(3)"],
                             run_dir=tmp_path)
    events: list[tuple[float, ServiceEvent]] = []
    supervisor = Supervisor([crasher], base_s=0.3, max_s=1.2, healthy_after_s=30, give_up_after=10,
                            on_event=lambda event: events.append((time.monotonic(), event)))
    starts = [time.monotonic()]
    crasher.start()
    while sum(e.kind == "exited" for _, e in events) < 4 and time.monotonic() - starts[0] < 30:
        supervisor.poll()
        time.sleep(0.05)
    crasher.stop()
    exits = [e for _, e in events if e.kind == "exited"]
    assert [e.message.split("; ")[0] for e in exits] == ["crasher exited with code 3"] * 4, exits
    delays = [float(e.message.split("restarting in ")[1].split(" s")[0]) for e in exits]
    assert delays == [supervisor.backoff_s(n) for n in (1, 2, 3, 4)] == [0.3, 0.6, 1.2, 1.2], exits
    assert [e.message.split("(")[-1] for e in exits] == [f"crash {n} in a row)" for n in (1, 2, 3, 4)]
    starts += [at for at, e in events if e.kind == "restarted"]
    assert supervisor.restarts["crasher"] == len(starts) - 1 == 3, events
    assert all(later - earlier >= 0.2 + delay for earlier, later, delay in zip(starts, starts[1:], delays)), \
        (starts, delays)


def test_supervisor_gives_up_on_a_crash_loop_naming_the_child_and_its_log(tmp_path):
    crasher = ManagedProcess("crasher", [sys.executable, "-c", "raise SystemExit(4)"], run_dir=tmp_path)
    healthy = ManagedProcess("healthy", [sys.executable, "-c", "import time; time.sleep(60)"], run_dir=tmp_path)
    events: list[str] = []
    supervisor = Supervisor([crasher, healthy], base_s=0.05, max_s=0.1, give_up_after=5, give_up_window_s=60,
                            on_event=lambda event: events.append(f"{event.kind}: {event}"))
    crasher.start()
    healthy.start()
    started = time.monotonic()
    try:
        with pytest.raises(CrashLoop) as raised:
            while time.monotonic() - started < 30:
                supervisor.poll()
                time.sleep(0.02)
    finally:
        healthy.stop()
        crasher.stop()
    assert raised.value.service == "crasher" and raised.value.log_path == str(crasher.log_path)
    assert "crasher crashed 5 times" in str(raised.value) and str(crasher.log_path) in str(raised.value)
    assert supervisor.restarts == {"crasher": 4, "healthy": 0}, events
    assert events[-1].startswith("gave_up: "), events


def test_local_stack_keeps_redis_and_s3_data_together_across_runs(cache_dir, tmp_path):
    data = tmp_path / "data"

    def stack(run: str) -> LocalStack:
        return LocalStack(workers=0, cache_dir=cache_dir, run_dir=tmp_path / run, data_dir=data,
                          bucket="persist", console=Console(file=open(tmp_path / f"{run}.txt", "w")))

    first = stack("run1")
    assert first.redis_url != "redis://127.0.0.1:6379/0" and first.appendonly
    with first:
        assert first.redis is not None, "its own redis-server, never the machine's"
        first.redis.client().set("rf:persist-probe", "kept")
        _storage(first).client.put_object(Bucket="persist", Key="img/a.png", Body=b"\x89PNG-bytes")
        time.sleep(1.5)  # appendfsync everysec
    assert (data / "redis").is_dir() and (data / "seaweedfs").is_dir()
    with stack("run2") as second:
        assert second.redis.client().get("rf:persist-probe") == "kept"
        body = _storage(second).client.get_object(Bucket="persist", Key="img/a.png")["Body"].read()
        assert body == b"\x89PNG-bytes"


def _storage(stack: LocalStack) -> Storage:
    """A client of ``stack``'s S3, built inside its environment: boto3 reads the credentials when
    the client is created, and a test session's own farm has other ones in ``os.environ``."""
    from infra.settings import Settings

    with patched_environ(stack.env):
        return Storage(Settings())


def test_a_port_in_time_wait_is_free_and_a_listener_is_not():
    """A stopped server's connections leave its port in TIME_WAIT for up to a minute; servers bind
    with SO_REUSEADDR and start, so the stack's port check must not call that port in use."""
    import socket

    from infra.localstack.ports import LOCALHOST, port_is_free

    listener = socket.create_server((LOCALHOST, 0))
    port = listener.getsockname()[1]
    assert not port_is_free(port)  # a real listener
    client = socket.create_connection((LOCALHOST, port))
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its end goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    plain = socket.socket()
    try:
        with pytest.raises(OSError):
            plain.bind((LOCALHOST, port))  # what the old check did: TIME_WAIT counted as in use
    finally:
        plain.close()
    assert port_is_free(port)
