"""The ``renderfarm`` command: one root that delegates to each package's subcommands.

Subcommand modules are imported by name only when the CLI starts, so this root carries no
static import of ``producer`` or ``worker`` (imports still point downward), and a command
such as ``status`` never pays for loading torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: Modules that each expose ``register(subparsers)``.
COMMAND_MODULES = (
    "infra.stack",        # up
    "producer.demo",      # demo
    "worker.cli",         # worker
    "infra.api",          # api
    "infra.reaper",       # reaper
    "producer.cli",       # submit, status, wait
    "producer.catalog",   # catalog
    "infra.keys_cli",     # keys create|revoke|list
    "infra.plan",         # plan
    "worker.bench_cli",   # bench pipeline|farm
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="renderfarm", description="A render farm for text-to-image diffusion models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``renderfarm`` console script."""
    args = build_parser().parse_args(argv)
    result = args.func(args)
    if isinstance(result, int):
        sys.exit(result)


if __name__ == "__main__":
    main()
