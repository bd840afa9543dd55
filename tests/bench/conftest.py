"""Fixtures for the benchmark tests: one offline cache per session, with ``tiny`` built once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_cache(cache_with_shared_models: Callable[[str], Path]) -> Path:
    """A cache dir with the offline ``tiny`` model built in it (in the session's shared
    ``models/``, so the farm's workers and the pipeline tests find it built)."""
    from pipeline.models import build_offline_model

    cache = cache_with_shared_models("bench-cache")
    build_offline_model("tiny", cache)
    return cache
