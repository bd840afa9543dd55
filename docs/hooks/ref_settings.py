"""The settings reference, generated from the fields of ``infra.settings.Settings``.

Each pydantic-settings field gives one row: the environment variable it is read from
(``RENDERFARM_`` + the field name, or its validation aliases), its type, its default and the
``description`` the field declares, so the page changes when the model does.
"""

from __future__ import annotations

from pathlib import Path

from mdtable import cell, code, table
from pydantic import AliasChoices, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined


def _env_vars(name: str, field: FieldInfo, prefix: str) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(a) for a in alias.choices if str(a).isupper()] or [prefix + name.upper()]
    if isinstance(alias, str):
        return [alias]
    return [prefix + name.upper()]


def _type(field: FieldInfo) -> str:
    ann = field.annotation
    text = getattr(ann, "__name__", None) if getattr(ann, "__args__", None) is None else None
    return text or str(ann).replace("typing.", "").replace("infra.pools.", "").replace("pathlib.", "")


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, Path):
        value = str(value).replace(str(Path.home()), "~", 1)
    if value is None or value == "" or value == []:
        return "empty"
    return code(value)


def settings_table() -> str:
    """Markdown: one row per field of :class:`infra.settings.Settings` (variable, type, default, meaning)."""
    from infra.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", ""))
    rows = []
    for name, field in Settings.model_fields.items():
        names = ", ".join(code(v) for v in _env_vars(name, field, prefix))
        rows.append((names, code(_type(field)), _default(field), cell(field.description)))
    return table(("variable", "type", "default", "meaning"), rows)
