"""The compile counter counts TorchDynamo compilations, including after ``torch._dynamo.reset()``
(which clears every registered callback: a counter installed before it would stay at zero)."""

from __future__ import annotations

import pytest
import torch

from pipeline import compile_count


def _compile_once(scale: float) -> None:
    fn = torch.compile(lambda x: x * scale + 1, backend="eager", dynamic=False)
    fn(torch.ones(3))


def test_compilations_are_counted_before_and_after_a_dynamo_reset():
    compile_count.install()
    before = compile_count.compiles()
    _compile_once(2.0)
    assert compile_count.compiles() - before >= 1

    torch._dynamo.reset()
    compile_count.install()
    compile_count.install()  # idempotent: one callback, one count per compilation
    before = compile_count.compiles()
    _compile_once(3.0)
    counted = compile_count.compiles() - before
    assert counted >= 1
    from torch._dynamo import callback_handler

    assert callback_handler.start_callbacks.count(compile_count._on_start) == 1


class _Held(torch.nn.Module):
    """A module of this file's own (TorchDynamo keeps graphs per code object and guards on the
    module's type, so no other test's graph can serve it)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Chained(_Held):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


def _observe(module: torch.nn.Module, rows: int) -> compile_count.CallCounts:
    with torch.no_grad(), compile_count.observed() as calls:
        module(torch.ones(rows, 4))
    return calls


def test_a_graph_that_serves_is_seen_compiled_and_a_held_miss_eager():
    """TorchDynamo's guard outcomes are observed per call: a matched graph is a compiled call, a
    shape without a graph after the hold runs eagerly and is counted so, a miss that compiles
    (default stance) is a compile and not an eager call, and under fail_on_recompile a new shape
    raises while a compiled one still runs. The eager backend: the guards are TorchDynamo's
    whatever the backend, and Inductor would only add compile time."""
    compile_count.install()
    compile_count.release_compiled()
    module = _Held()
    module.compile(dynamic=False, backend="eager")
    compiles = compile_count.compiles()
    assert _observe(module, 2) == compile_count.CallCounts()  # the first call compiles its frame
    assert _observe(module, 3) == compile_count.CallCounts()  # a miss, then a compile: neither
    assert compile_count.compiles() - compiles == 2
    try:
        compile_count.hold_compiled()
        assert _observe(module, 2) == compile_count.CallCounts(compiled=1)
        assert _observe(module, 5) == compile_count.CallCounts(eager=1)  # ran eagerly
        assert _observe(module, 3) == compile_count.CallCounts(compiled=1)
        with compile_count.fail_on_recompile():
            assert compile_count.stance() == "fail_on_recompile"
            assert _observe(module, 2).compiled == 1
            with pytest.raises(RuntimeError, match="fail_on_recompile"):
                _observe(module, 6)
        assert compile_count.stance() == "eager_on_recompile"  # restored on exit
        assert _observe(module, 6).eager == 1
        with compile_count.eager():  # forced eager: no graph is looked up, nothing is seen
            assert _observe(module, 2) == compile_count.CallCounts()
    finally:
        compile_count.release_compiled()
    assert compile_count.compiles() - compiles == 2


def test_a_guard_hook_registered_before_is_still_called():
    """install() replaces TorchDynamo's one guard-complete hook; one registered before it (e.g.
    guard collectives) is called first and its answer kept."""
    from torch._C._dynamo.eval_frame import set_guard_complete_hook

    outcomes: list[bool] = []

    def earlier(hit: bool) -> bool:
        outcomes.append(hit)
        return hit

    compile_count.release_compiled()
    module = _Chained()
    module.compile(dynamic=False, backend="eager")
    _observe(module, 2)
    set_guard_complete_hook(earlier)
    try:
        compile_count.install()
        assert _observe(module, 2) == compile_count.CallCounts(compiled=1)
    finally:
        compile_count._chained[0] = None
        set_guard_complete_hook(compile_count._on_guards)
    assert outcomes == [True]
