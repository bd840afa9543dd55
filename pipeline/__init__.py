"""The pipeline package: model specs → warm diffusers pipelines → batched, batch-invariant renders.

Place in the data flow: producer → queue → worker → **pipeline** → storage → status. It knows
nothing of queues, Redis or S3; it imports only ``infra.schemas`` and ``infra.settings``.

The public names load lazily, so that ``import pipeline.device`` does not import diffusers.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "load_pipeline": "pipeline.models",
    "build_offline_model": "pipeline.models",
    "OFFLINE_MODELS": "pipeline.models",
    "Renderer": "pipeline.render",
    "compat_key": "pipeline.compat",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from pipeline.compat import compat_key as compat_key
    from pipeline.models import OFFLINE_MODELS as OFFLINE_MODELS
    from pipeline.models import build_offline_model as build_offline_model
    from pipeline.models import load_pipeline as load_pipeline
    from pipeline.render import Renderer as Renderer


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
