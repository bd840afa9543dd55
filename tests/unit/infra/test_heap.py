"""infra.heap: start-up objects leave the cyclic collector; what work allocates afterwards is
still collected. Runs in this process and unfreezes at the end, so the rest of the session is as
before."""

from __future__ import annotations

import gc
import weakref

import pytest

from infra.heap import freeze_startup_objects


class _Node:
    def __init__(self):
        self.other: _Node | None = None


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # only the cyclic collector frees this pair
    return weakref.ref(a)


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_start_up_objects_are_frozen_and_later_cycles_are_still_collected(unfrozen):
    start_up = _cycle()  # garbage already at start-up: the first collect frees it
    kept = _Node()
    kept.other = kept  # alive, cyclic, from start-up: frozen from now on
    frozen = freeze_startup_objects("test")
    still_tracked = len(gc.get_objects())  # what the collector still visits: only what came after
    assert start_up() is None
    # A frozen object that another thread of this process drops afterwards leaves the permanent
    # generation (reference counting still frees it), so the count can only shrink, and by little.
    assert frozen > 0
    assert frozen - 1_000 <= gc.get_freeze_count() <= frozen
    assert still_tracked < max(1_000, frozen // 100), (still_tracked, frozen)
    assert not any(obj is kept for obj in gc.get_objects())  # collections no longer visit it
    later = _cycle()
    gc.collect()
    assert later() is None  # work's garbage cycles are still freed
