"""The compile counter counts TorchDynamo compilations, including after ``torch._dynamo.reset()``
(which clears every registered callback: a counter installed before it would stay at zero)."""

from __future__ import annotations

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
