"""The CLI reference, generated from the argparse parsers of every registered command.

``infra.cli.build_parser`` reads the ``renderfarm.commands`` entry points and calls each
``register(subparsers)``, as ``renderfarm --help`` does; this walks the resulting parsers
(nested subcommands included) and writes each one's usage, description and arguments.
"""

from __future__ import annotations

import argparse

from mdtable import cell, code, table


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _arguments(parser: argparse.ArgumentParser) -> str:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        names = ", ".join(code(o) for o in action.option_strings) or code(action.metavar or action.dest)
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.option_strings == [] else code(default)
        help_text = parser._get_formatter()._expand_help(action) if action.help else ""
        rows.append((names, shown, cell(help_text)))
    return table(("argument", "default", "meaning"), rows) if rows else ""


def _section(parser: argparse.ArgumentParser, path: list[str], summary: str, level: int) -> list[str]:
    out = [f"{'#' * level} `{' '.join(path)}`", ""]
    text = parser.description or summary
    if text:
        out += [text.strip(), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    args = _arguments(parser)
    if args:
        out += [args]
    for name, sub in _subcommands(parser).items():
        out += _section(sub, [*path, name], _help_of(parser, name), min(level + 1, 4))
    return out


def cli_reference() -> str:
    """Markdown: one section per ``renderfarm`` command and subcommand, in registry order."""
    from infra.cli import build_parser

    root = build_parser()
    out: list[str] = []
    for name, sub in _subcommands(root).items():
        out += _section(sub, ["renderfarm", name], _help_of(root, name), 2)
    return "\n".join(out)
