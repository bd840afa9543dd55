"""The local stack: every process of the farm on one machine, composed and configured.

Place in the data flow: beside it. It starts the pieces the data flows through (redis-server for
the queues and the job-state store, SeaweedFS for S3 storage, the status API, the Celery workers)
through :mod:`infra.localstack.services`, waits until each one answers, hands clients the
environment that finds them, and stops them. ``renderfarm up`` (:mod:`infra.localstack.cli`),
``renderfarm demo`` and the test fixtures (``tests/conftest.py``) all build on it, so there is one
way to run the farm locally.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table

from infra.localstack import claim
from infra.localstack.ports import check_free, free_port, reserve
from infra.localstack.processes import ManagedProcess
from infra.localstack.run_dirs import new_run_dir
from infra.localstack.services import ApiServer, RedisServer, SeaweedS3, WorkerProcess, redis_answers, start_workers
from infra.state.connect import is_cluster_url, is_sentinel_url


def _local_port(redis_url: str) -> int | None:
    """The port of a Redis this stack may start: ``redis_url``'s when it names one Redis on this
    machine (None for another host, a Sentinel group or a Cluster)."""
    if is_cluster_url(redis_url) or is_sentinel_url(redis_url):
        return None
    parts = urlsplit(redis_url)
    return parts.port or 6379 if parts.hostname in ("127.0.0.1", "localhost") else None


def stack_env(
    *,
    redis_url: str,
    s3_endpoint_url: str,
    access_key: str,
    secret_key: str,
    bucket: str,
    api_url: str,
    cache_dir: Path | str,
) -> dict[str, str]:
    """The environment variables every farm process and client needs to find the stack."""
    return {
        "RENDERFARM_REDIS_URL": redis_url,
        "RENDERFARM_S3_ENDPOINT_URL": s3_endpoint_url,
        "RENDERFARM_S3_BUCKET": bucket,
        "RENDERFARM_API_URL": api_url,
        "RENDERFARM_CACHE_DIR": str(cache_dir),
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
    }


def _forget_env_caches() -> None:
    """Forget what was read from the environment: the settings, and boto3's default session
    (botocore caches the credentials it resolved, so a later ``boto3.client`` would keep
    signing with the old ``AWS_*`` keys)."""
    import boto3

    from infra.settings import get_settings

    get_settings.cache_clear()
    boto3.DEFAULT_SESSION = None


def apply_env(env: Mapping[str, str]) -> dict[str, str | None]:
    """Set ``env`` in ``os.environ`` and forget the cached settings and boto3 session; returns the
    previous values.

    Pass the returned mapping to :func:`restore_env` to undo.
    """
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _forget_env_caches()
    return previous


def restore_env(previous: Mapping[str, str | None]) -> None:
    """Undo :func:`apply_env`: put back (or remove) each variable, and forget cached settings."""
    for key, value in previous.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _forget_env_caches()


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Within the block, ``os.environ`` (and so ``get_settings()`` and boto3) sees ``env``."""
    previous = apply_env(env)
    try:
        yield
    finally:
        restore_env(previous)


def ensure_bucket(env: Mapping[str, str]) -> None:
    """Create the bucket named in ``env`` on the S3 endpoint named in ``env`` (idempotent)."""
    from infra.settings import Settings
    from infra.storage.s3 import Storage

    with patched_environ(env):
        Storage(Settings()).ensure_bucket()


class LocalStack:
    """Redis (reused when one answers), SeaweedFS S3, the bucket, the status API and N workers.

    Settings not given are read from the ``RENDERFARM_*`` environment (:class:`infra.settings.Settings`),
    never from a client settings file (``.renderfarm/env``), and its processes read none either.
    If no Redis answers at the Redis URL and its host is local, a private redis-server is
    started on that URL's port. S3 credentials are random unless given. Everything runs from
    one run dir (logs and data; default :func:`new_run_dir`).

    With a ``data_dir`` (``renderfarm up``: ``RENDERFARM_DATA_DIR``, default
    ``~/.cache/renderfarm/data``), the data lives there instead, together and across runs: the
    AOF of its own redis-server (``redis/``, appendonly on, ``appendfsync always``; on a free
    port unless ``redis_url`` names one) and SeaweedFS's volumes and filer (``seaweedfs/``), so
    job records and the images they point at are kept, or wiped, together. :attr:`env` holds
    the variables a client needs to reach the stack. One stack at a time uses a data dir, and
    a killed one's children are stopped, workers first, before the next starts
    (:mod:`infra.localstack.claim`, :mod:`infra.localstack.guard`).

    ``pools``: the declared pools (``RENDERFARM_POOLS`` in the environment) its workers take in
    turn, worker i ``--pool pools[i % len(pools)]``; empty: every worker serves ``model``'s pool.

    ``start()`` stops whatever it started if any part fails, so it never leaves processes behind.
    """

    def __init__(
        self,
        *,
        workers: int = 1,
        model: str = "tiny",
        batch_size: int | None = None,
        device: str = "auto",
        redis_url: str | None = None,
        appendonly: bool = False,
        bucket: str | None = None,
        api_port: int | None = None,
        s3_port: int | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        cache_dir: Path | str | None = None,
        run_dir: Path | str | None = None,
        data_dir: Path | str | None = None,
        console: Console | None = None,
        pools: Sequence[str] = (),
    ) -> None:
        from infra.settings import ENV_FILE_VAR, Settings

        with patched_environ({ENV_FILE_VAR: ""}):  # a stack is set by its arguments and environment, never
            settings = Settings()                 # by the client settings file (of another stack, maybe)
        self.console = console or Console(stderr=True)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else settings.cache_dir
        self.run_dir = Path(run_dir) if run_dir is not None else new_run_dir(self.cache_dir / "run")
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        if self.data_dir is not None and redis_url is None:  # its own Redis, never the machine's 6379
            redis_url = f"redis://127.0.0.1:{free_port()}/0"
        self.redis_url = redis_url or settings.redis_url
        # ports chosen outside this stack, which its servers bind later: SeaweedFS's internal ports
        # must not land on them (a Go "404 page not found" answered where the API should have)
        reserve(api_port, s3_port, _local_port(self.redis_url))
        self.bucket = bucket or settings.s3_bucket
        self.appendonly = appendonly or self.data_dir is not None
        self.redis: RedisServer | None = None  # stays None when a Redis already answers
        self.guard: ManagedProcess | None = None  # with a data dir: infra.localstack.guard
        data = self.data_dir if self.data_dir is not None else self.run_dir
        self.s3 = SeaweedS3(s3_port, dir=data / "seaweedfs", access_key=access_key,
                            secret_key=secret_key, run_dir=self.run_dir)  # fmt: skip
        self.api = ApiServer(api_port, run_dir=self.run_dir)
        self.env: dict[str, str] = stack_env(
            redis_url=self.redis_url,
            s3_endpoint_url=self.s3.url,
            access_key=self.s3.access_key,
            secret_key=self.s3.secret_key,
            bucket=self.bucket,
            api_url=self.api.url,
            cache_dir=self.cache_dir,
        )
        children = {**self.env, ENV_FILE_VAR: ""}  # its processes read no client settings file either
        self.api.env.update(children)
        self.workers = [  # worker i of pools[i % len(pools)] when pools are given (the declared RENDERFARM_POOLS')
            WorkerProcess(model, children, f"{model}-{i + 1}", batch_size, device=device, run_dir=self.run_dir,
                          extra_args=["--pool", pools[i % len(pools)]] if pools else [])
            for i in range(workers)
        ]

    @property
    def processes(self) -> list[ManagedProcess]:
        """The processes this stack manages, in start order (Redis only if it started one)."""
        return [p for p in (self.redis, self.s3, self.api, *self.workers) if p is not None]

    def ports(self) -> list[tuple[int, str]]:
        """``(port, option that changes it)`` of every port this stack will listen on whose
        number is chosen outside it: the API's, S3's, and Redis's when it will start one."""
        ports = [(self.api.port, "--api-port"), (self.s3.port, "--s3-port")]
        port = _local_port(self.redis_url)
        if port is not None and not redis_answers(self.redis_url):
            ports.append((port, "--redis-url"))
        return ports

    def start(self) -> "LocalStack":
        """Start everything and wait until each part answers; on any failure, stop all and raise.

        Raises:
            PortBusy: before anything starts, when a port of :meth:`ports` is taken (the message
                names the process holding it).
            DataDirBusy: another ``renderfarm up`` that still runs uses the data dir.
        """
        if self.data_dir is not None:
            claim.claim(self.data_dir, say=lambda line: self.console.print(line, highlight=False))
        check_free(self.ports())
        try:
            self._start_guard()
            self._start_storage()
            self.record_children()
            ensure_bucket(self.env)
            self._announce("bucket", f"s3://{self.bucket}", "created or found")
            self.api.start()
            self.record_children()
            self.api.wait_ready()
            self._announce(self.api.name, self.api.url, f"pid {self.api.pid}")
            self._start_workers()
        except BaseException:
            self.stop()
            raise
        self.record_children()
        return self

    def _start_guard(self) -> None:
        """With a data dir: the storage outlives a killed ``up`` until :mod:`infra.localstack.guard`
        has let the workers finish their batches, then stops it."""
        started = claim.start_time(os.getpid())
        if self.data_dir is None or started is None:
            return
        self.s3.die_with_parent = False
        self.guard = ManagedProcess("guard", [sys.executable, "-m", "infra.localstack.guard", str(self.data_dir),
                                              str(os.getpid()), str(started)], run_dir=self.run_dir, stop_timeout=5)
        self.guard.die_with_parent = False
        self.guard.start()

    def record_children(self) -> None:
        """With a data dir, note its children's pids there (:func:`infra.localstack.claim.record`),
        so that the next stack on that data waits for them if this one is killed. Call it after
        a child restarted."""
        if self.data_dir is not None:
            claim.record(self.data_dir, self.processes)

    def _start_storage(self) -> None:
        if not redis_answers(self.redis_url):
            port = _local_port(self.redis_url)
            if port is None:
                raise ConnectionError(f"no Redis answers at {self.redis_url}, and it is not one local Redis to start")
            data = self.data_dir if self.data_dir is not None else self.run_dir
            # its own Redis fsyncs the AOF before it answers (appendfsync always): a kill -9
            # right after a 202 loses nothing, which Redis 7.0's missing WAITAOF cannot promise
            self.redis = RedisServer(port, appendonly=self.appendonly,
                                     appendfsync="always" if self.appendonly else "everysec",
                                     dir=data / "redis", run_dir=self.run_dir)  # fmt: skip
            self.redis.die_with_parent = self.guard is None
            self.redis.start()
        self.s3.start()
        if self.redis is not None:
            self.redis.wait_ready()
            self._announce("redis", self.redis_url, f"pid {self.redis.pid}")
        else:
            self._announce("redis", self.redis_url, "reused: already running")
        self.s3.wait_ready()
        self._announce(self.s3.name, self.s3.url, f"pid {self.s3.pid}")

    def _start_workers(self) -> None:
        def announce(worker: WorkerProcess) -> None:
            self._announce(worker.name, f"model {worker.model}", f"pid {worker.pid}")

        start_workers(self.workers, on_ready=announce)

    def _announce(self, name: str, where: str, note: str) -> None:
        self.console.print(f"[green]✓[/] {name:<10} {where:<32} [dim]{note}[/]", highlight=False)

    def stop(self) -> None:
        """Stop what this stack started, workers first, a reused Redis excepted. Idempotent."""
        running = [p for p in self.processes if p.running]
        if running:
            self.console.print(f"stopping {', '.join(p.name for p in reversed(running))} …")
        for process in reversed(self.processes):
            try:
                process.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.console.print(f"[red]could not stop {process.name}: {exc}[/]")
        if self.guard is not None:
            self.guard.stop()
        if self.data_dir is not None:
            claim.release(self.data_dir)

    def exited(self) -> list[ManagedProcess]:
        """Processes that were started and have since died on their own."""
        return [p for p in self.processes if p.proc is not None and p.proc.poll() is not None]

    def table(self) -> Table:
        """A rich table of the services: name, where it listens, pid, log file (in the run dir)."""
        caption = (f"logs in {self.run_dir}; data in {self.data_dir}" if self.data_dir is not None
                   else f"logs and data in {self.run_dir}")
        table = Table(title="renderfarm local stack", caption=caption)
        for column in ("service", "listens at", "pid", "log"):
            table.add_column(column)
        if self.redis is None:
            table.add_row("redis", self.redis_url, "(reused)", "")
        for p in self.processes:
            where = p.url or f"model {getattr(p, 'model', '')}"
            table.add_row(p.name, where, str(p.pid or ""), p.log_path.name)
        table.add_row("bucket", f"s3://{self.bucket}", "", "")
        return table

    def exports(self) -> str:
        """Shell ``export`` lines with :attr:`env`, for clients in another terminal."""
        return "\n".join(f"export {key}={value}" for key, value in self.env.items())

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
