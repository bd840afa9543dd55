"""Time budgets of one render group, scaled by its estimated seconds.

Place in the data flow: the render stage (:mod:`worker.render_stage`) asks here, before each
pipeline call, how long the call may take in all (its deadline, checked between denoising steps)
and how long it may go without a step (the watchdog's stall limit, :mod:`worker.watchdog`).

A fixed timeout fits images, whose renders take seconds; a video job takes minutes (frames ×
pixels × steps), so both limits grow with the group's estimated seconds, the estimate the quotas
charge (:func:`infra.state.quota.request_cost_s`, at the pool's
``s_per_mpx_step``). The configured limits (``RENDERFARM_JOB_TIMEOUT_S``,
``RENDERFARM_RENDER_STALL_S``) stay the floor, so images keep them.

Leases need no scaling: the heartbeat renews the leases of every job the worker holds, whatever
the render's length (:mod:`worker.heartbeat`); a lease runs out only when its worker is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from infra.schemas import RenderRequest
from infra.state.quota import request_cost_s

#: A render may take this many times its estimate before it is stopped (estimates are per pool,
#: from ``s_per_mpx_step``, and a device runs slower while it shares its memory or heats up).
TIMEOUT_FACTOR = 3.0


@dataclass(frozen=True)
class RenderBudget:
    """One group's limits: ``timeout_s`` for the whole call, ``stall_s`` without a denoising step
    (0: the watchdog never fires), and the ``estimate_s`` they were scaled by; seconds."""

    timeout_s: float
    stall_s: float
    estimate_s: float


def estimate_s(requests: Sequence[RenderRequest], s_per_mpx_step: float) -> float:
    """Estimated seconds of one pipeline call rendering ``requests`` (one group: the same size,
    steps and frames): the sum of their quota costs (:func:`infra.state.quota.request_cost_s`:
    ``s_per_mpx_step`` × megapixels × steps run × frames each)."""
    return sum(request_cost_s(r, s_per_mpx_step) for r in requests)


def render_budget(requests: Sequence[RenderRequest], *, s_per_mpx_step: float, job_timeout_s: float,
                  stall_s: float) -> RenderBudget:
    """The limits of one call rendering ``requests``: ``timeout_s`` = the larger of
    ``job_timeout_s`` and :data:`TIMEOUT_FACTOR` × the estimate; ``stall_s`` = the larger of
    ``stall_s`` and the whole estimate (a video's VAE decode, after its last step, can take
    a good part of its render), or 0 when ``stall_s`` is 0 (watchdog off)."""
    estimate = estimate_s(requests, s_per_mpx_step)
    stall = max(stall_s, estimate) if stall_s > 0 else 0.0
    return RenderBudget(max(job_timeout_s, TIMEOUT_FACTOR * estimate), stall, estimate)
