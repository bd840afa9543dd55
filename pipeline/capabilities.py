"""What a loaded pipeline can do, and the call arguments it gets: only those its ``__call__`` takes.

Place in the data flow: worker start-up → :func:`derive_capabilities` / :func:`check_pool_family`
(refuse a pool declared with the wrong family); every group → :func:`call_arguments` (here) →
the pipeline call in :class:`pipeline.render.Renderer`.

The capability record is infra's (:data:`infra.pools.FAMILIES`, the one table the API checks at
submission); here it is derived from the loaded pipeline: its family (class and configs), narrowed
by its ``__call__`` signature. A FLUX.2 pipeline has no ``negative_prompt``; passing one always
(as the farm used to) failed every job. A request that asks for what the pipeline cannot do is
refused with ValueError (the request's own error: its job fails at once, not its batch-mates).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

from infra.pools import FAMILIES, Capabilities, capability_errors
from infra.schemas import SchedulerName
from pipeline.models.families import detect_family

_DISCRETE = ("StableDiffusionPipeline", "StableDiffusionXLPipeline")


def call_parameters(pipe) -> frozenset[str]:
    """The keyword arguments ``pipe.__call__`` accepts."""
    return frozenset(inspect.signature(type(pipe).__call__).parameters) - {"self"}


def derive_capabilities(pipe) -> Capabilities:
    """The capability record of a loaded pipeline: its family's, narrowed by its signature; for a
    pipeline of no known family, read from the signature alone (``default`` scheduler only unless
    it is an SD-style UNet pipeline)."""
    params = call_parameters(pipe)
    family = detect_family(pipe)
    if family in FAMILIES:
        caps = FAMILIES[family]
        return caps._replace(negative_prompt=caps.negative_prompt and "negative_prompt" in params,
                             guidance_scale=caps.guidance_scale and "guidance_scale" in params)
    from typing import get_args

    discrete = type(pipe).__name__ in _DISCRETE
    return Capabilities(negative_prompt="negative_prompt" in params and "true_cfg_scale" not in params,
                        guidance_scale="guidance_scale" in params,
                        schedulers=get_args(SchedulerName) if discrete else ("default",),
                        size_multiple=8 if discrete else 16, batch_invariant=True)


def check_pool_family(pipe, declared: str | None) -> str | None:
    """The loaded pipeline's family; ValueError when a pool declared another one (its 422 checks
    would then be wrong), or when the declared family's capabilities are not the pipeline's."""
    family = detect_family(pipe)
    if declared is None:
        return family
    if family is not None and family != declared:
        raise ValueError(f"the pool declares family {declared!r} but the loaded pipeline "
                         f"({type(pipe).__name__}) is of family {family!r}")
    if derive_capabilities(pipe) != FAMILIES[declared]:
        raise ValueError(f"the pool declares family {declared!r}, whose capabilities {FAMILIES[declared]} "
                         f"differ from the loaded pipeline's {derive_capabilities(pipe)}")
    return declared


def call_arguments(pipe, requests: Sequence, *, generators: list, step_end: Callable | None = None,
                   use_pe: bool = False, output_type: str = "pil") -> dict:
    """Keyword arguments of one pipeline call for a group of compatible ``requests``.

    Only what ``pipe.__call__`` takes: ``negative_prompt`` and ``guidance_scale`` where they
    exist, ``use_pe`` (ERNIE-Image's prompt enhancer, a pool setting) where it exists.

    Raises:
        ValueError: a request asks for what the pipeline cannot do (see :func:`derive_capabilities`).
    """
    params = call_parameters(pipe)
    caps = derive_capabilities(pipe)
    first = requests[0]
    for r in requests:
        errors = capability_errors(r, caps)
        if errors:
            raise ValueError(errors[0]["msg"])
    kwargs = {"prompt": [r.prompt for r in requests], "width": first.width, "height": first.height,
              "num_inference_steps": first.num_inference_steps, "generator": generators, "output_type": output_type}
    if "negative_prompt" in params and caps.negative_prompt and any(r.negative_prompt for r in requests):
        # only when one is given: with none, the pipeline's own default applies (SDXL then uses zero
        # embeddings, ``force_zeros_for_empty_prompt``, as diffusers does; the others encode "")
        kwargs["negative_prompt"] = [r.negative_prompt for r in requests]
    if "guidance_scale" in params:
        kwargs["guidance_scale"] = first.guidance_scale
    if "use_pe" in params:
        kwargs["use_pe"] = use_pe
    if step_end is not None and "callback_on_step_end" in params:
        kwargs["callback_on_step_end"] = step_end
    return kwargs
