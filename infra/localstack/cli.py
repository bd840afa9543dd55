"""``renderfarm up``: the local stack in the foreground until Ctrl-C or SIGTERM.

Place in the data flow: beside it (see :mod:`infra.localstack.stack`). ``renderfarm demo``
(:mod:`producer.demo`) reuses the arguments and the foreground handling here.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from infra.localstack.processes import ProcessExited
from infra.localstack.stack import LocalStack


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
