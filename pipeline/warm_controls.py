"""The ControlNet unit sets a compiled worker warms up, and the control image its warm-up reads.

Place in the data flow: worker start-up → :func:`pipeline.warm.warm_plan` (the plan's
``control_sets``: :func:`warm_control_sets`, here) → :func:`pipeline.warm.warm_up` renders each set
at every bucket × size with :func:`control_units` and :func:`warm_control_images` (here) → the
graphs are held (:func:`pipeline.compile_count.hold_compiled`) → jobs.

Why: diffusers' ControlNet pipelines (:mod:`pipeline.controlnet`, made with ``from_pipe`` and so
sharing the pinned, compiled UNet) call the UNet with the ControlNets' residuals
(``down_block_additional_residuals``, ``mid_block_additional_residual``): inputs a plain call does
not pass, so no graph compiled by a plain warm-up matches them (TorchDynamo's guards), and once the
graphs are held such a call ran the UNet's Python (``eager_renders``). Rendering each declared set
at every bucket × size compiles the UNet's graphs with residuals before the worker takes jobs.

Which sets: the pool's ``control_sets`` (``infra.pools.PoolSpec``), else each ControlNet the
worker declares, alone (so each one is also loaded before the first job that names it); ``[]``
warms none. The UNet receives the same inputs whatever the set: ``MultiControlNetModel`` sums its
ControlNets' residuals, whose shapes are those of the UNet's own down and mid blocks. So the first
set compiles one graph per bucket × size and the others reuse those graphs; the ControlNets
themselves are not compiled (they run their PyTorch modules as loaded).

Only a worker whose recipe compiles warms sets (an uncompiled one has no graph to prepare); the
control image is a black RGB image (no edges, no control), handed to the renderer's input loader
under :data:`WARM_CONTROL_IMAGE` for the warm-up only, never read from the bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import PIL.Image

from infra.controls import ControlUnit

#: The image reference the warm-up's control units name (a valid object key no job can name:
#: the API writes inputs under ``inputs/``); :func:`warm_control_images` answers it.
WARM_CONTROL_IMAGE = "renderfarm-warm-up/control.png"


def warm_control_sets(renderer, pool) -> tuple[tuple[str, ...], ...]:
    """The unit sets (ControlNet names, one per unit, in order) the warm-up of ``renderer`` renders
    at every bucket × size: ``pool.control_sets`` (a :class:`pipeline.pool_options.PoolOptions`;
    checked against the declared ControlNets by ``infra.pools.PoolSpec``), else each ControlNet
    ``renderer.controlnets`` declares, alone; () when the renderer declares no ControlNets."""
    controlnets = getattr(renderer, "controlnets", None)
    if controlnets is None:
        return ()
    declared = getattr(pool, "control_sets", None)
    if declared is None:
        return tuple((name,) for name in controlnets.sources)
    return tuple(tuple(units) for units in declared)


def control_units(names: Sequence[str]) -> list[ControlUnit]:
    """One unit per ControlNet of ``names``, all reading :data:`WARM_CONTROL_IMAGE` as it is
    (``preprocess="none"``) at the default weight and guidance range (every step conditioned)."""
    return [ControlUnit(type=name, image=WARM_CONTROL_IMAGE) for name in names]


@contextlib.contextmanager
def warm_control_images(renderer) -> Iterator[None]:
    """Inside: ``renderer.input_loader`` answers :data:`WARM_CONTROL_IMAGE` with a black 64×64 RGB
    image (the units' maps are fitted to the render's size) and hands any other key to the loader
    it had (None: raises ``KeyError`` for it). The loader is restored on exit."""
    before = getattr(renderer, "input_loader", None)

    def load(key: str) -> PIL.Image.Image:
        if key == WARM_CONTROL_IMAGE:
            return PIL.Image.new("RGB", (64, 64))
        if before is None:
            raise KeyError(f"the warm-up reads no input {key!r}")
        return before(key)

    renderer.input_loader = load
    try:
        yield
    finally:
        renderer.input_loader = before


__all__ = ["WARM_CONTROL_IMAGE", "control_units", "warm_control_images", "warm_control_sets"]
