"""Fixtures for the benchmark tests: one offline cache per session, with ``tiny`` built once."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bench_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir with the offline ``tiny`` model built in it."""
    from pipeline.models import build_offline_model

    cache = tmp_path_factory.mktemp("bench-cache")
    build_offline_model("tiny", cache)
    return cache
