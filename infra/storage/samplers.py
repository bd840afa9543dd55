"""AUTOMATIC1111's sampler names ↔ the farm's scheduler names: one table for every place that
speaks A1111.

Place in the data flow: the A1111-compatible endpoint (:mod:`infra.api.compat.a1111`) maps a
request's ``sampler_name`` and ``scheduler`` (A1111's "schedule type") onto a farm scheduler name
(:data:`infra.schemas.SchedulerName`) → the worker renders with that diffusers scheduler
(:mod:`pipeline.schedulers`) → the ``parameters`` infotext of each image
(:mod:`infra.storage.images`) names it back in A1111's words, and rebuilding a request from an
infotext reads them again.

The names are the sampler dropdown of the AUTOMATIC1111 stable-diffusion-webui (its
``sd_samplers_kdiffusion`` and ``sd_samplers_timesteps`` tables) with their ``k_…`` aliases.
Since A1111 1.9 the noise schedule is a separate ``scheduler`` field (``automatic``, ``uniform``,
``karras``, …) and ``automatic`` means the sampler's own default, which is Karras for the DPM++ 2M
family; before 1.9 a Karras sampler was its own name (``DPM++ 2M Karras``), which both versions
still accept and which the infotext writes, so every A1111 version reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A1111 schedule types the farm serves ("automatic" = the sampler's own default).
SCHEDULES: tuple[str, ...] = ("automatic", "uniform", "karras")
#: The infotext's sampler for requests that keep the model's own scheduler, when no worker named it.
DEFAULT_LABEL = "Default"
_KARRAS = " Karras"


@dataclass(frozen=True)
class Sampler:
    """One A1111 sampler: its ``name`` and ``aliases``, the farm scheduler names of its uniform
    and (when the farm has one) Karras noise schedules, and whether A1111 ≥ 1.9 picks Karras for
    it under the ``automatic`` schedule."""

    name: str
    aliases: tuple[str, ...]
    uniform: str
    karras: str | None = None
    karras_by_default: bool = False

    def options(self) -> dict[str, str]:
        """A1111's ``options`` of the sampler in ``GET /sdapi/v1/samplers``."""
        return {"scheduler": "karras"} if self.karras_by_default else {}


SAMPLERS: tuple[Sampler, ...] = (
    Sampler("Euler a", ("k_euler_a", "k_euler_ancestral"), "euler_ancestral"),
    Sampler("Euler", ("k_euler",), "euler"),
    Sampler("LMS", ("k_lms",), "lms", "lms_karras"),
    Sampler("Heun", ("k_heun",), "heun"),
    Sampler("DPM2", ("k_dpm_2",), "dpm2", "dpm2_karras"),
    Sampler("DPM2 a", ("k_dpm_2_a",), "dpm2_ancestral", "dpm2_ancestral_karras"),
    Sampler("DPM++ 2M", ("k_dpmpp_2m",), "dpmpp_2m", "dpmpp_2m_karras", karras_by_default=True),
    Sampler("DPM++ 2M SDE", ("k_dpmpp_2m_sde",), "dpmpp_2m_sde", "dpmpp_2m_sde_karras", karras_by_default=True),
    Sampler("DDIM", ("ddim",), "ddim"),
    Sampler("PLMS", ("plms",), "pndm"),
    Sampler("UniPC", ("unipc",), "unipc"),
    Sampler("LCM", ("k_lcm", "lcm"), "lcm"),
)

_BY_NAME: dict[str, Sampler] = {n.lower(): s for s in SAMPLERS for n in (s.name, *s.aliases)}
#: farm scheduler name → A1111 label (Karras schedules under their pre-1.9 combined name)
LABELS: dict[str, str] = {"default": DEFAULT_LABEL, **{s.uniform: s.name for s in SAMPLERS},
                          **{s.karras: s.name + _KARRAS for s in SAMPLERS if s.karras}}
_BY_LABEL: dict[str, str] = {label.lower(): name for name, label in LABELS.items()}


class SamplerError(ValueError):
    """A sampler or schedule the farm cannot serve; ``field`` is ``sampler_name`` or ``scheduler``."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _sampler(name: str) -> tuple[Sampler, bool]:
    """The sampler named ``name`` (any case, aliases too) and whether the name itself said Karras."""
    key = name.strip().lower()
    if key in _BY_NAME:
        return _BY_NAME[key], False
    if key.endswith(_KARRAS.lower()) and key[: -len(_KARRAS)] in _BY_NAME:
        return _BY_NAME[key[: -len(_KARRAS)]], True
    known = ", ".join(s.name for s in SAMPLERS)
    raise SamplerError("sampler_name", f"sampler {name!r} is not available on this farm; known: {known} "
                                       "(and the Karras variants of LMS, DPM2, DPM2 a, DPM++ 2M, DPM++ 2M SDE)")


def scheduler_for(sampler_name: str | None, schedule: str | None = None) -> str:
    """The farm scheduler name for an A1111 ``sampler_name`` and ``scheduler`` (schedule type).

    No sampler keeps the model's own scheduler (``default``). ``schedule`` None or ``automatic``
    is the sampler's default (Karras for DPM++ 2M and DPM++ 2M SDE, as in A1111 ≥ 1.9); a
    ``… Karras`` sampler name asks for Karras itself.

    Raises:
        SamplerError: an unknown sampler, an unknown schedule, or a Karras schedule for a sampler
            the farm has none of; the message names what is available.
    """
    if not sampler_name or not sampler_name.strip():
        if schedule and schedule.strip().lower() not in ("automatic", ""):
            raise SamplerError("scheduler", f"schedule {schedule!r} needs a sampler_name")
        return "default"
    sampler, karras_named = _sampler(sampler_name)
    kind = (schedule or "automatic").strip().lower()
    if kind not in SCHEDULES:
        raise SamplerError("scheduler", f"schedule type {schedule!r} is not available on this farm; "
                                        f"known: {', '.join(SCHEDULES)}")
    karras = karras_named or kind == "karras" or (kind == "automatic" and sampler.karras_by_default)
    if karras_named and kind == "uniform":
        raise SamplerError("scheduler", f"sampler {sampler_name!r} is a Karras sampler; schedule 'uniform' "
                                        "contradicts it")
    if karras and sampler.karras is None:
        raise SamplerError("scheduler", f"sampler {sampler.name!r} has no Karras schedule on this farm")
    return sampler.karras if karras else sampler.uniform  # type: ignore[return-value]


def label(scheduler: str) -> str:
    """The A1111 sampler label of a farm scheduler name (``dpmpp_2m_karras`` → ``DPM++ 2M
    Karras``); a name the table does not know (a scheduler class a worker reported) as it is."""
    return LABELS.get(scheduler, scheduler)


def from_label(text: str, schedule_type: str | None = None) -> str:
    """The farm scheduler name of an infotext's ``Sampler`` (and, from A1111 ≥ 1.9, its
    ``Schedule type``); ``default`` for a label this farm cannot render."""
    if schedule_type and schedule_type.strip().lower() != "automatic":
        try:
            return scheduler_for(text, schedule_type)
        except SamplerError:
            return "default"
    return _BY_LABEL.get(text.strip().lower(), "default")
