"""Fixtures of the integration suite beside the session's services (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from producer import RenderClient


@pytest.fixture(scope="module")
def client(api_server, workers) -> Iterator[RenderClient]:
    """A RenderClient of the session farm (its API and tiny workers running)."""
    with RenderClient() as c:
        yield c
