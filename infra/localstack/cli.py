"""``renderfarm up``: the local stack in the foreground until Ctrl-C or SIGTERM.

Place in the data flow: beside it (see :mod:`infra.localstack.stack`). ``renderfarm demo``
(:mod:`producer.demo`) reuses the arguments and the foreground handling here.

``up`` listens on documented ports (the API on 8000, S3 on SeaweedFS's usual 8333;
``--api-port``, ``--s3-port``) and refuses to start, naming the process, when one is taken. While
it runs, it keeps the client settings (API URL, Redis URL, bucket, S3 endpoint and keys) in
``.renderfarm/env`` (:func:`infra.settings.env_file_path`; mode 0600), which ``renderfarm``
commands started in that directory or below read by themselves; it removes the file when it stops.
Every process it starts is supervised (:func:`supervise`): a crashed redis-server, SeaweedFS, API
or worker restarts with backoff on its port and data, and one that crash-loops stops the stack.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console

from infra.localstack.claim import DataDirBusy
from infra.localstack.ports import PortBusy
from infra.localstack.processes import ProcessExited
from infra.localstack.stack import LocalStack, patched_environ
from infra.localstack.supervisor import CrashLoop, ServiceEvent, Supervisor

#: ``renderfarm up``'s ports: the API's (the documented clients use it) and SeaweedFS's usual S3 port.
API_PORT, S3_PORT = 8000, 8333


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
    """A :class:`LocalStack` configured from the options of :func:`add_stack_arguments` (and
    ``up``'s ports and Redis URL, when given; else free ports)."""
    if args.workers < 0:
        raise SystemExit("--workers must be >= 0")
    return LocalStack(workers=args.workers, model=args.model, device=args.device,
                      batch_size=args.batch_size, appendonly=args.appendonly, console=console,
                      api_port=getattr(args, "api_port", None), s3_port=getattr(args, "s3_port", None),
                      redis_url=getattr(args, "redis_url", None),
                      data_dir=getattr(args, "data_dir", None))  # fmt: skip


def write_client_env(path: Path, env: Mapping[str, str]) -> str:
    """Write ``env`` as a dotenv file at ``path`` (mode 0600: it holds the S3 secret), atomically;
    returns the text written (:func:`remove_client_env` removes only that)."""
    header = f"# written by `renderfarm up` (pid {os.getpid()}) at {datetime.now():%Y-%m-%d %H:%M:%S}; " \
             "removed when it stops\n"
    text = header + "".join(f"{key}={value}\n" for key, value in env.items())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return text


def remove_client_env(path: Path, text: str) -> None:
    """Remove the client settings file if it still holds ``text`` (another ``up`` may own it now)."""
    with contextlib.suppress(OSError):
        if path.read_text(encoding="utf-8") == text:
            path.unlink()
            path.parent.rmdir()  # only when nothing else is in it


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


def supervise(stack: LocalStack, console: Console, *, interval_s: float = 1.0) -> NoReturn:
    """Keep every process of ``stack`` running until interrupted: a crashed redis-server,
    SeaweedFS, API or worker restarts with backoff (:class:`~infra.localstack.supervisor.Supervisor`)
    on its port and data; each event goes to the console (with its time) and to the stack's Redis
    (:class:`infra.state.stack_events.StackEvents`), where ``/healthz`` and the dashboard read it.

    Raises:
        CrashLoop: a process crashed 5 times within 60 s (the caller stops the stack).
    """
    from infra.state.stack_events import StackEvents

    events = StackEvents(stack.redis_url)
    with contextlib.suppress(Exception):
        events.reset()

    def on_event(event: ServiceEvent) -> None:
        style = "red" if event.kind in ("exited", "gave_up") else "yellow"
        console.print(f"[{style}]{event.line()}[/]", highlight=False)
        if event.kind == "exited":
            console.print(f"[dim]{stack_log_tail(stack, event.service)}[/]", highlight=False)
        if event.kind == "restarted":
            stack.record_children()
        events.record(event)

    supervisor = Supervisor(stack.processes, on_event=on_event)
    try:
        while True:
            supervisor.poll()
            events.flush()  # events that waited for Redis to come back
            time.sleep(interval_s)
    finally:
        events.close()


def stack_log_tail(stack: LocalStack, name: str, lines: int = 5) -> str:
    """The last ``lines`` lines of the log of ``stack``'s process ``name``, with the log's path."""
    process = next((p for p in stack.processes if p.name == name), None)
    if process is None:
        return ""
    return f"{process.log_path}:\n{process.log_tail(lines)}"


def up_command(args: argparse.Namespace) -> int:
    """``renderfarm up``: run the local stack in the foreground until Ctrl-C or SIGTERM.

    Returns the exit code: 0 after a requested stop, 1 when a service failed to start (or a port
    or the data directory was taken) or one crashed 5 times within a minute. Every crashed
    process (redis-server, SeaweedFS, the API, a worker) restarts with exponential backoff on its
    port and data (:func:`supervise`) while the rest keeps serving.
    """
    from infra.settings import ENV_FILE_VAR, Settings, env_file_path

    console = Console()
    env_path = env_file_path(for_writing=True)
    if args.data_dir is None:
        with patched_environ({ENV_FILE_VAR: ""}):
            settings = Settings()
        args.data_dir = settings.data_dir or settings.cache_dir / "data"
    stack = stack_from_args(args, console)
    console.print(f"starting the local stack in {stack.run_dir} …")
    written = None
    try:
        with foreground(stack):
            console.print(stack.table())
            console.print(f"Dashboard: [bold]{stack.api.url}/[/]")
            if env_path is not None:
                written = write_client_env(env_path, stack.env)
                console.print(f"Client settings: {env_path} (renderfarm commands run in {env_path.parent.parent} "
                              "or below read it; no exports needed there). Elsewhere:")
            else:
                console.print("Clients reach it with:")
            console.print(stack.exports(), highlight=False)
            console.print("[bold]Ctrl-C stops everything.[/]")
            supervise(stack, console)
    except KeyboardInterrupt:
        console.print("stopped.")
        return 0
    except CrashLoop as exc:
        console.print(f"[red]{exc}[/]", highlight=False)
        return 1
    except (ProcessExited, TimeoutError, ConnectionError, PortBusy, DataDirBusy) as exc:
        console.print(f"[red]the stack did not start:[/] {exc}", highlight=False)
        return 1
    finally:
        if written is not None and env_path is not None:
            remove_client_env(env_path, written)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``up`` to the CLI's argparse subparsers; the handler is ``args.func(args) -> int``."""
    parser = subparsers.add_parser(
        "up",
        help="run the local stack in the foreground (Redis, SeaweedFS, API, workers)",
        description="Start redis-server (its own, AOF on, unless --redis-url names one that answers), SeaweedFS S3, "
        "the bucket, the status API and N workers (each restarts with backoff when it crashes); Redis and S3 data "
        "persist together in --data-dir; Ctrl-C or SIGTERM stops them all. While it runs, the client settings are "
        "in .renderfarm/env (RENDERFARM_ENV_FILE names another file; empty: none), which renderfarm commands in "
        "that directory or below read by themselves.",
    )
    add_stack_arguments(parser)
    parser.add_argument("--api-port", type=int, default=API_PORT, help=f"the status API's port (default {API_PORT})")
    parser.add_argument("--s3-port", type=int, default=S3_PORT, help=f"SeaweedFS's S3 port (default {S3_PORT})")
    parser.add_argument("--redis-url", default=None,
                        help="a Redis to use instead of the stack's own (started when none answers there "
                             "and it is local); default: its own redis-server on a free port, AOF in --data-dir")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="where Redis's AOF and SeaweedFS's data persist across runs, together (default "
                             "RENDERFARM_DATA_DIR, else RENDERFARM_CACHE_DIR/data: ~/.cache/renderfarm/data); "
                             "delete it to start afresh")
    parser.set_defaults(func=up_command)
    return parser
