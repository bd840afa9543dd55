"""Fixtures of the fault-injection suite: a farm of real processes per scenario, and the table.

Every scenario breaks something (kills a worker, restarts Redis, stops S3), so each gets a
fresh :class:`FaultFarm`: the Redis flushed, its own bucket, its own status API (which runs the
reaper) and its own workers. The redis-server and SeaweedFS processes are shared by the suite
(restartable, and restarted by the scenarios that test their outages); they are not the
session fixtures of ``tests/conftest.py``, which other tests keep using undisturbed.

Workers pin the ``null`` model (64×64 images: the size their requests ask) behind the fault-injection wrapper of
``worker/faults.py``: ``RENDERFARM_TEST_STEP_DELAY_S`` gives each denoising step real time, so
a batch lasts long enough to be interrupted, and ``RENDERFARM_TEST_COUNTERS`` counts renders
and object writes per job in Redis, which is how "run twice" is measured. Leases are short
(``RENDERFARM_LEASE_S=5``), so recovery takes seconds.

Each scenario accounts for every job it submitted and records one row with
:func:`tests.fault_table.record_row`; rows are merged into ``test-artifacts/faults.json`` and
printed as a table at the end of the session (``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.localstack import RedisServer, SeaweedS3, free_port

from .farm import FaultFarm


@pytest.fixture(scope="session")
def fault_redis(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The suite's own redis-server with the AOF on (scenario b restarts it)."""
    server = RedisServer(free_port(), appendonly=True, dir=tmp_path_factory.mktemp("fault-redis"),
                         name="fault-redis", run_dir=run_dir)
    with server:
        yield server


@pytest.fixture(scope="session")
def fault_s3(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """The suite's own SeaweedFS (scenario c stops it for 10 s)."""
    server = SeaweedS3(dir=tmp_path_factory.mktemp("fault-seaweedfs"), name="fault-seaweedfs", run_dir=run_dir)
    with server:
        yield server


@pytest.fixture
def fault_farm(request, fault_redis: RedisServer, fault_s3: SeaweedS3, run_dir: Path,
               cache_dir: Path) -> Iterator[FaultFarm]:
    """A fresh :class:`FaultFarm` (API running, no workers yet), stopped after the test."""
    marker = request.node.get_closest_marker("farm_settings")
    settings = marker.kwargs if marker else {}
    if not fault_redis.running:  # a failed scenario may have left it down
        fault_redis.start().wait_ready()
    if not fault_s3.running:
        fault_s3.start().wait_ready()
    name = request.node.name.split("[")[0].removeprefix("test_")[:20].replace("_", "-").lower()
    farm = FaultFarm(name, fault_redis, fault_s3, run_dir, cache_dir, **settings)
    try:
        yield farm.start()
    finally:
        farm.stop()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "farm_settings(**env): extra RENDERFARM_* variables for the fault farm")
