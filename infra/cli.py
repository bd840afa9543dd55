"""The ``renderfarm`` command: one root that finds every subcommand through one registry.

Place in the data flow: beside it. Each package that offers commands declares them in the
``renderfarm.commands`` entry-point group of ``pyproject.toml`` (``name = "module:register"``,
where ``register(subparsers)`` adds its subcommands). The root reads that group, so it names
no package above ``infra`` (imports still point downward), and a command module imports its
heavy dependencies (torch, diffusers, celery) inside its handler, so ``renderfarm status``
never pays for loading torch. A command named like its entry point (``renderfarm worker``,
``renderfarm api``, ``renderfarm up``) loads that entry's module alone, so a worker does not
import FastAPI nor a client the whole farm's modules at start-up.

The base install (``pip install renderfarm``) is the client: a command whose module needs an
extra that is not installed (``[api]``: Redis, Celery, FastAPI, boto3; ``[worker]``: torch,
diffusers) is listed under "not installed here" in ``--help`` and, when run, says which extra
to install, instead of failing the whole CLI with an ImportError.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import EntryPoint, entry_points

#: The entry-point group every command module is registered in.
GROUP = "renderfarm.commands"

#: Top-level modules of the optional extras → the extra that installs them.
EXTRA_OF_MODULE: dict[str, str] = {
    **dict.fromkeys(("torch", "diffusers", "transformers", "accelerate", "safetensors", "scipy", "numpy",
                     "open_clip", "torchao", "sdnq"), "worker"),
    **dict.fromkeys(("redis", "celery", "kombu", "celery_batches", "fastapi", "starlette", "uvicorn", "boto3",
                     "botocore", "prometheus_client", "psutil"), "api"),
}


#: Commands that run a worker need the [worker] extra (which holds [api]), whichever module is missing first.
EXTRA_OF_COMMAND: dict[str, str] = dict.fromkeys(("worker", "bench", "demo", "up"), "worker")


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


def missing_extra(exc: ImportError) -> str | None:
    """The extra whose absence ``exc`` reports (``api``, ``worker``), or None when it is not one of
    the optional extras' modules (a real error)."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    return EXTRA_OF_MODULE.get(name)


def _needs(command: str, extra: str, exc: ImportError) -> str:
    extra = EXTRA_OF_COMMAND.get(command, extra)
    return (f"renderfarm {command} needs the [{extra}] extra, which is not installed here: "
            f"pip install 'renderfarm[{extra}]' ({exc})")


def _unavailable(name: str, extra: str, exc: ImportError):
    def run(args: argparse.Namespace) -> int:
        print(f"error: {_needs(name, extra, exc)}", file=sys.stderr)
        return 2

    return run


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand; a command whose module needs a
    missing extra gets a stub that says which one.

    ``command``: the subcommand about to run. When an entry point has that name and registers it,
    the parser holds that entry's commands only, so ``renderfarm worker`` does not import the API's
    modules (FastAPI) nor any other command's; otherwise it holds every command.
    """
    if command is not None:
        [parser, registered] = _parser_of([entry for entry in commands() if entry.name == command])
        if command in registered:
            return parser
    return _parser_of(commands())[0]


def _parser_of(entries: list[EntryPoint]) -> tuple[argparse.ArgumentParser, set[str]]:
    """The root parser with the commands of ``entries``, and the names of the commands it holds."""
    parser = argparse.ArgumentParser(prog="renderfarm", description="A render farm for text-to-image diffusion models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    missing: dict[str, list[str]] = {}
    for entry in entries:
        try:
            register = entry.load()
        except ModuleNotFoundError as exc:
            extra = missing_extra(exc)
            if extra is None:
                raise
            missing.setdefault(extra, []).append(entry.name)
            stub = subparsers.add_parser(entry.name, help=f"(not installed here: needs renderfarm[{extra}])",
                                         add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER)
            stub.set_defaults(func=_unavailable(entry.name, extra, exc))
            continue
        register(subparsers)
    if missing:
        parser.epilog = "not installed here: " + "; ".join(
            f"{', '.join(names)} (pip install 'renderfarm[{extra}]')" for extra, names in sorted(missing.items()))
    return parser, set(subparsers.choices)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``renderfarm`` console script."""
    words = sys.argv[1:] if argv is None else argv
    command = words[0] if words and not words[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    try:
        result = args.func(args)
    except ModuleNotFoundError as exc:  # a handler's heavy import: say which extra, not a traceback
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(f"error: {_needs(args.command, extra, exc)}", file=sys.stderr)
        sys.exit(2)
    if isinstance(result, int):
        sys.exit(result)


if __name__ == "__main__":
    main()
