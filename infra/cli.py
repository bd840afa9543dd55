"""The ``renderfarm`` command: one root that finds every subcommand through one registry.

Place in the data flow: beside it. Each package that offers commands declares them in the
``renderfarm.commands`` entry-point group of ``pyproject.toml`` (``name = "module:register"``,
where ``register(subparsers)`` adds its subcommands). The root reads that group, so it names
no package above ``infra`` (imports still point downward), and a command module imports its
heavy dependencies (torch, diffusers, celery) inside its handler, so ``renderfarm status``
never pays for loading torch.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import EntryPoint, entry_points

#: The entry-point group every command module is registered in.
GROUP = "renderfarm.commands"


def commands() -> list[EntryPoint]:
    """The registered command entry points, by name.

    Raises:
        RuntimeError: none is registered (the project is not installed: ``pip install -e .``).
    """
    found = sorted(entry_points(group=GROUP), key=lambda ep: ep.name)
    if not found:
        raise RuntimeError(f"no {GROUP!r} entry points: install the project (pip install -e .) so that "
                           "its commands are registered")
    return found


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="renderfarm", description="A render farm for text-to-image diffusion models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in commands():
        entry.load()(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``renderfarm`` console script."""
    args = build_parser().parse_args(argv)
    result = args.func(args)
    if isinstance(result, int):
        sys.exit(result)


if __name__ == "__main__":
    main()
