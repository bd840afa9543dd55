"""``renderfarm up``'s ports: the ones a caller chose (``--api-port``, ``--s3-port``, the Redis
URL's) bind after SeaweedFS has picked its internal ports, so SeaweedFS must never pick them, even
when the kernel offers exactly those ports first (a Go "404 page not found" then answered on the
API's port in a fault scenario)."""

from __future__ import annotations

from infra.localstack import ports


def test_seaweedfs_never_takes_a_port_the_caller_chose(monkeypatch, tmp_path):
    from infra.localstack import LocalStack

    api, s3, redis = (ports._unused_port() for _ in range(3))
    offered = iter([api, redis, s3, api, redis] * 3 + list(range(40000, 40100)))
    monkeypatch.setattr(ports, "_unused_port", lambda: next(offered))  # the kernel's worst luck
    monkeypatch.setattr(ports, "port_is_free", lambda port: True)
    stack = LocalStack(workers=0, run_dir=tmp_path, api_port=api, s3_port=s3,
                       redis_url=f"redis://127.0.0.1:{redis}/0")  # builds nothing, starts nothing
    internal = {name: port for name, port in stack.s3.ports.items() if name != "s3.port"}
    assert not {api, s3, redis} & set(internal.values()), internal
    assert stack.api.port == api and stack.s3.port == s3 and len(set(internal.values())) == len(internal)


def test_a_sentinel_or_cluster_url_is_never_a_redis_the_stack_would_start(tmp_path):
    from infra.localstack import LocalStack

    for url in ("sentinel://127.0.0.1:26379,127.0.0.1:26380/farm/0", "redis+cluster://127.0.0.1:7000"):
        stack = LocalStack(workers=0, run_dir=tmp_path, redis_url=url)  # builds nothing, starts nothing
        assert [option for _, option in stack.ports()] == ["--api-port", "--s3-port"], url
    local = LocalStack(workers=0, run_dir=tmp_path, redis_url="redis://127.0.0.1:1/0")  # nothing answers there
    assert (1, "--redis-url") in local.ports()


def test_a_worker_is_awaited_in_the_state_store_its_environment_names(monkeypatch, tmp_path):
    """The worker child gets ``os.environ`` under its own variables, so a state store named only in
    ``os.environ`` is where it registers, and where the stack waits for it (not the broker)."""
    from infra.localstack import WorkerProcess

    worker = WorkerProcess("null", {"RENDERFARM_REDIS_URL": "redis://127.0.0.1:1/0"}, "w", 1, run_dir=tmp_path)
    monkeypatch.delenv("RENDERFARM_STATE_REDIS_URL", raising=False)
    assert worker._redis_url() == "redis://127.0.0.1:1/0"
    monkeypatch.setenv("RENDERFARM_STATE_REDIS_URL", "redis://127.0.0.1:2/0")
    assert worker._redis_url() == "redis://127.0.0.1:2/0"
    worker.env["RENDERFARM_STATE_REDIS_URL"] = "redis://127.0.0.1:3/0"  # its own variable wins
    assert worker._redis_url() == "redis://127.0.0.1:3/0"
