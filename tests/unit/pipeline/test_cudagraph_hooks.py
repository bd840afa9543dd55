"""CUDA-graph safety hooks (pipeline.optimize.compile.cudagraph_safe), checked on the CPU: the
logic around a CUDA-graph replay (a step mark before each call, outputs cloned after it) does not
need a GPU; the replays themselves are measured by the GPU session (deploy/gpu)."""

from __future__ import annotations

import torch
from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

from pipeline.optimize.compile import cudagraph_safe


class Keep(torch.nn.Module):
    """Returns its own buffer, as a CUDA-graph replay returns its static output."""

    def __init__(self, wrap: str) -> None:
        super().__init__()
        self.out = torch.zeros(2, 3)
        self.wrap = wrap

    def forward(self, x: torch.Tensor):
        self.out.copy_(x)
        if self.wrap == "output":
            return UNet2DConditionOutput(sample=self.out)
        return (self.out,) if self.wrap == "tuple" else self.out


def _sample(result):
    return result.sample if hasattr(result, "sample") else result[0] if isinstance(result, tuple) else result


def test_outputs_survive_the_next_call_and_every_call_marks_a_step():
    from torch._inductor import cudagraph_trees

    for wrap in ("tensor", "tuple", "output"):
        module = cudagraph_safe(Keep(wrap))
        before = cudagraph_trees.MarkStepBox.mark_step_counter
        first = _sample(module(torch.ones(2, 3)))
        second = _sample(module(torch.full((2, 3), 2.0)))
        assert torch.equal(first, torch.ones(2, 3)), wrap  # a kept prediction is not overwritten
        assert torch.equal(second, torch.full((2, 3), 2.0)) and first.data_ptr() != module.out.data_ptr()
        assert cudagraph_trees.MarkStepBox.mark_step_counter != before, wrap


def test_regionally_compiled_blocks_never_replay_cuda_graphs():
    """One block graph replayed for every FLUX block overwrote the previous block's output on an
    H200 (reduce-overhead); the blocks compile without CUDA graphs, the reason kept for the report."""
    from pipeline.optimize.compile import CUDAGRAPH_MODES, regional_mode

    for mode in CUDAGRAPH_MODES:
        block_mode, why = regional_mode(mode, cuda_graphs=True)
        assert "cudagraphs" not in block_mode.replace("no-cudagraphs", "") and block_mode not in CUDAGRAPH_MODES
        assert why and "CUDA graphs off" in why
    assert regional_mode("reduce-overhead", cuda_graphs=False) == ("reduce-overhead", None)  # the CPU: no graphs
    assert regional_mode("default", cuda_graphs=False) == ("default", None)
