"""What a pool declares that the pipeline needs, as one value (:class:`PoolOptions`).

Place in the data flow: the worker builds it from the pool's spec (``infra.pools.PoolSpec``) →
:func:`pipeline.warm.prepare_renderer` fits the recipe to it and :class:`pipeline.render.Renderer`
keeps it (``renderer.pool``). Its own module so that the renderer and the warm-up both read it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolOptions"]


@dataclass(frozen=True)
class PoolOptions:
    """What a pool declares that the pipeline needs. Pixels are ``width × height``."""

    family: str | None = None
    max_pixels: int | None = None
    steps: int | None = None
    use_pe: bool = False
    batch_invariant: bool | None = None
    upscalers: tuple[str, ...] | None = None  # the upscalers a worker may load (None: any)
    sizes: tuple[tuple[int, int], ...] = ()  # (width, height) its jobs ask for; () = the family's native square
    guidance_scale: float | None = None  # its jobs' usual guidance (None: the request default where taken)
    lora_adapters: bool = False  # the pool declares LoRA adapters (the denoiser must stay in PyTorch)
    controlnets: bool = False  # the pool declares ControlNets or IP-Adapters (the denoiser must stay in PyTorch)
    #: The ControlNet unit sets (names, one per unit) a compiled worker warms at every bucket × size
    #: (:mod:`pipeline.warm_controls`); None: each ControlNet the worker declares, alone; (): none.
    control_sets: tuple[tuple[str, ...], ...] | None = None
