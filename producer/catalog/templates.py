"""Prompt templates over catalog item fields: plain ``{field}`` placeholders only.

Place in the data flow: items (:mod:`producer.catalog.items`) → **templates** → prompts of the
planned requests (:mod:`producer.catalog.plan`).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from producer.catalog.items import CatalogError


class TemplateFieldError(KeyError):
    """An item lacks a field its template needs."""


class _Strict(dict):
    def __missing__(self, name):
        raise TemplateFieldError(name)


class Template:
    """A ``str.format`` template over item fields, restricted to plain ``{name}`` placeholders
    (with an optional ``!conversion`` and a ``:spec`` without nested fields).

    Raises:
        CatalogError: unbalanced braces, positional ``{}``/``{0}``, attribute or index access
            (``{a.b}``, ``{a[0]}``), or a nested field in a format spec.
    """

    def __init__(self, text: str, option: str = "--template"):
        self.text, self.option = text, option
        fields: list[str] = []
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise CatalogError(f"{option} {text!r}: {exc}") from None
        for _literal, name, spec, _conversion in parsed:
            if name is None:
                continue
            if name == "" or name.isdigit():
                raise CatalogError(f"{option} {text!r}: positional placeholder {{{name}}}; name a field, "
                                   f"e.g. {{name}}")
            if "." in name or "[" in name:
                raise CatalogError(f"{option} {text!r}: placeholder {{{name}}} uses attribute or index access, "
                                   f"which templates do not allow; use a plain field name")
            if spec and ("{" in spec or "}" in spec):
                raise CatalogError(f"{option} {text!r}: placeholder {{{name}}} has a nested field in its format spec")
            if name not in fields:
                fields.append(name)
        self.fields = tuple(fields)

    def render(self, values: Mapping[str, Any]) -> str:
        """Fill the placeholders. Raises :class:`TemplateFieldError` (a field is absent) or
        ``ValueError`` (a format spec does not fit the value)."""
        return self.text.format_map(_Strict(values))
