"""The suite's pytest-xdist scheduler (tests/xdist_lanes.py), driven through the calls pytest-xdist
makes: nodes join, report their collection, the schedule starts, tests complete. Nodes are stand-ins
that record which tests they were sent."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.xdist_lanes import WAITING_FILES, LaneScheduling

WAITING = sorted(WAITING_FILES)[:2]
BUSY = [f"tests/unit/test_{name}.py" for name in "abcdef"]


class Node:
    """What the scheduler uses of pytest-xdist's WorkerController."""

    def __init__(self, gateway_id: str) -> None:
        self.gateway = SimpleNamespace(id=gateway_id)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def _scheduler(workers: int, files: list[str]) -> tuple[LaneScheduling, list[Node], list[str]]:
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None,
                             option=SimpleNamespace(loadscopereorder=False))
    sched = LaneScheduling(config)
    collection = [f"{path}::test_{i}" for path in files for i in range(3)]
    nodes = [Node(f"gw{i}") for i in (1, 2, 0)][:workers]  # joined out of order, as real workers do
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return sched, sorted(nodes, key=lambda n: n.gateway.id), collection


def _files(node: Node, collection: list[str]) -> list[str]:
    return list(dict.fromkeys(collection[i].split("::")[0] for i in node.sent))


def _finish(sched: LaneScheduling, node: Node) -> None:
    """``node`` completes every test it was sent (pytest-xdist then sends it its next file)."""
    for index in list(node.sent):
        sched.mark_test_complete(node, index)


def test_the_last_worker_takes_the_waiting_files_and_the_others_the_rest():
    files = [BUSY[0], WAITING[0], BUSY[1], BUSY[2], WAITING[1], BUSY[3]]
    sched, (gw0, gw1, gw2), collection = _scheduler(3, files)
    # a file each to start (three tests to a file: xdist sends more when two or fewer are left)
    assert (_files(gw0, collection), _files(gw1, collection), _files(gw2, collection)) == (
        [BUSY[1]], [BUSY[0]], [WAITING[0]])  # gw1 joined first, gw2 is the lane
    _finish(sched, gw0)
    _finish(sched, gw0)  # waiting file 1 is first in the queue now: gw0 passes it by
    assert _files(gw0, collection) == [BUSY[1], BUSY[2], BUSY[3]]
    _finish(sched, gw2)
    assert _files(gw2, collection) == WAITING


def test_a_worker_whose_kind_ran_out_takes_the_other_kind():
    files = [WAITING[0], WAITING[1], *BUSY[:3]]
    sched, (gw0, gw1, gw2), collection = _scheduler(3, files)
    _finish(sched, gw2)
    _finish(sched, gw2)  # no waiting file is left: the lane takes a busy one
    assert _files(gw2, collection) == [*WAITING, BUSY[2]]
    sched, (gw0, gw1, gw2), collection = _scheduler(3, [*WAITING, BUSY[0]])
    assert _files(gw0, collection) == [WAITING[1]]  # no busy file is left for gw0: it takes a waiting one


def test_under_three_workers_it_is_plain_loadfile_in_collection_order():
    files = [BUSY[0], WAITING[0], BUSY[1], WAITING[1]]
    sched, (first, second), collection = _scheduler(2, files)  # joined in this order
    _finish(sched, first)
    _finish(sched, second)
    assert (_files(first, collection), _files(second, collection)) == ([files[0], files[2]], [files[1], files[3]])


def test_every_waiting_file_is_a_test_file_of_the_suite():
    # the lane matches by path: a renamed or moved file would drop out of it without a word
    root = Path(__file__).resolve().parents[2]
    assert all((root / path).is_file() and Path(path).name.startswith("test_") for path in WAITING_FILES)
