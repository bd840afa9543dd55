"""AUTOMATIC1111 sampler names ↔ farm scheduler names (infra/storage/samplers.py): the one table the
A1111 endpoint and the PNG infotext share."""

from __future__ import annotations

from typing import get_args

import pytest

from infra.schemas import RenderRequest, SchedulerName
from infra.storage import samplers
from infra.storage.images import format_parameters, parse_parameters, request_from_parameters


@pytest.mark.parametrize("sampler, schedule, expected", [
    ("Euler a", None, "euler_ancestral"),
    ("euler A", "automatic", "euler_ancestral"),        # names match in any case
    ("k_euler_a", None, "euler_ancestral"),             # the webui's aliases
    ("Euler", "uniform", "euler"),
    ("DPM++ 2M", None, "dpmpp_2m_karras"),              # A1111 >= 1.9: automatic is Karras for DPM++ 2M
    ("DPM++ 2M", "Automatic", "dpmpp_2m_karras"),
    ("DPM++ 2M", "uniform", "dpmpp_2m"),
    ("DPM++ 2M", "karras", "dpmpp_2m_karras"),
    ("DPM++ 2M Karras", None, "dpmpp_2m_karras"),       # the pre-1.9 combined name
    ("DPM++ 2M SDE Karras", None, "dpmpp_2m_sde_karras"),
    ("LMS", None, "lms"),
    ("LMS Karras", None, "lms_karras"),
    ("DPM2 a", "Karras", "dpm2_ancestral_karras"),
    ("PLMS", None, "pndm"),
    ("DDIM", None, "ddim"),
    ("UniPC", None, "unipc"),
    ("LCM", None, "lcm"),
    (None, None, "default"),                            # no sampler: the model's own scheduler
    ("", "automatic", "default"),
])
def test_a1111_names_map_onto_farm_schedulers(sampler, schedule, expected):
    assert samplers.scheduler_for(sampler, schedule) == expected


@pytest.mark.parametrize("sampler, schedule, field, words", [
    ("DPM adaptive", None, "sampler_name", "not available on this farm"),
    ("Euler a", "karras", "scheduler", "no Karras schedule"),
    ("DPM++ 2M", "exponential", "scheduler", "known: automatic, uniform, karras"),
    ("DPM++ 2M Karras", "uniform", "scheduler", "contradicts"),
    (None, "karras", "scheduler", "needs a sampler_name"),
])
def test_what_the_farm_cannot_render_is_refused_by_field(sampler, schedule, field, words):
    with pytest.raises(samplers.SamplerError, match=words) as caught:
        samplers.scheduler_for(sampler, schedule)
    assert caught.value.field == field


def test_every_farm_scheduler_has_an_a1111_label_and_reads_back():
    names = set(get_args(SchedulerName))
    assert set(samplers.LABELS) == names, "every farm scheduler (and only those) has an A1111 label"
    for name in names - {"default"}:
        assert samplers.from_label(samplers.label(name)) == name
    assert samplers.label("dpmpp_2m_karras") == "DPM++ 2M Karras"
    assert samplers.label("FlowMatchEulerDiscreteScheduler") == "FlowMatchEulerDiscreteScheduler"
    # A1111 >= 1.9 writes the schedule apart
    assert samplers.from_label("DPM++ 2M", "Karras") == "dpmpp_2m_karras"
    assert samplers.from_label("Restart") == "default"


def test_the_infotext_names_the_scheduler_the_worker_reports():
    request = RenderRequest(prompt="a fox", model="tiny", seed=3, scheduler="default")
    assert parse_parameters(format_parameters(request, model="tiny"))["Sampler"] == "Default"
    text = format_parameters(request, model="tiny", scheduler="dpmpp_2m_karras")
    assert parse_parameters(text)["Sampler"] == "DPM++ 2M Karras"
    assert request_from_parameters(text).scheduler == "dpmpp_2m_karras"
