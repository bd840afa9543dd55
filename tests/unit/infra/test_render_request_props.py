"""Property tests of RenderRequest (infra/schemas.py): every valid request is accepted and
survives a JSON round trip unchanged; every out-of-range or wrongly typed size, step count or
guidance scale is refused with an error naming that field."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from infra.schemas import MAX_SEED, BatchSubmission, RenderRequest, SchedulerName

SCHEDULERS = list(SchedulerName.__args__)

prompts = st.text(min_size=1, max_size=2000).filter(lambda s: s.strip())
sizes = st.integers(8, 256).map(lambda n: n * 8)  # 64…2048, multiples of 8
metadata = st.dictionaries(st.text(min_size=1, max_size=64), st.text(max_size=1024), max_size=32)

valid_requests = st.fixed_dictionaries(
    {"prompt": prompts},
    optional={
        "negative_prompt": st.text(max_size=2000),
        "model": st.none() | st.text(min_size=1, max_size=200),
        "width": sizes,
        "height": sizes,
        "num_inference_steps": st.integers(1, 150),
        "guidance_scale": st.floats(0.0, 30.0, allow_nan=False) | st.integers(0, 30),
        "seed": st.none() | st.integers(0, MAX_SEED),
        "scheduler": st.sampled_from(SCHEDULERS),
        "output_format": st.sampled_from(["png", "webp", "jpeg"]),
        "metadata": metadata,
    },
)


@settings(max_examples=300)
@given(valid_requests)
def test_valid_requests_are_accepted_and_round_trip_through_json(body):
    request = RenderRequest.model_validate(body)
    for key, value in body.items():
        assert getattr(request, key) == value
    as_json = request.model_dump_json()
    assert RenderRequest.model_validate_json(as_json) == request
    assert RenderRequest.model_validate(json.loads(as_json)) == request  # as an HTTP client sends it


@settings(max_examples=50)
@given(st.lists(valid_requests, min_size=1, max_size=5))
def test_batches_of_valid_requests_round_trip(bodies):
    batch = BatchSubmission(jobs=bodies)
    assert BatchSubmission.model_validate_json(batch.model_dump_json()) == batch


def _refused_on(body: dict, field: str) -> str:
    with pytest.raises(ValidationError) as info:
        RenderRequest.model_validate(body)
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [(field,)], errors
    return errors[0]["msg"]


bad_sizes = (st.integers(-10**6, 10**6).filter(lambda n: not (64 <= n <= 2048 and n % 8 == 0))
             | st.sampled_from(["512px", "", None, [512], {"w": 512}, 512.5, True]))


@settings(max_examples=200)
@given(field=st.sampled_from(["width", "height"]), value=bad_sizes)
def test_bad_sizes_are_refused_naming_the_field(field, value):
    msg = _refused_on({"prompt": "x", field: value}, field)
    if isinstance(value, int) and not isinstance(value, bool) and 64 <= value <= 2048:
        assert f"{field} must be a multiple of 8" in msg


@settings(max_examples=100)
@given(st.integers(-10**6, 10**6).filter(lambda n: not 1 <= n <= 150)
       | st.sampled_from([2.5, "twenty", None, [], float("nan")]))
def test_bad_step_counts_are_refused_naming_the_field(value):
    _refused_on({"prompt": "x", "num_inference_steps": value}, "num_inference_steps")


@settings(max_examples=100)
@given(st.floats(allow_nan=True, allow_infinity=True).filter(lambda g: math.isnan(g) or not 0 <= g <= 30)
       | st.sampled_from(["7.5x", None, [7.5], {}]))
def test_bad_guidance_is_refused_naming_the_field(value):
    _refused_on({"prompt": "x", "guidance_scale": value}, "guidance_scale")


@settings(max_examples=100)
@given(st.text(max_size=50).filter(lambda s: not s.strip()) | st.text(min_size=2001, max_size=2100))
def test_blank_or_long_prompts_are_refused(value):
    _refused_on({"prompt": value}, "prompt")


@given(st.text(min_size=1, max_size=20).filter(lambda k: k not in RenderRequest.model_fields))
def test_unknown_fields_are_refused(key):
    with pytest.raises(ValidationError) as info:
        RenderRequest.model_validate({"prompt": "x", key: 1})
    assert info.value.errors()[0]["type"] == "extra_forbidden"
