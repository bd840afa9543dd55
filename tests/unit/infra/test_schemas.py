"""RenderRequest / BatchSubmission validation: every limit refuses with the field and rule named."""

import pytest
from pydantic import ValidationError

from infra.schemas import BatchSubmission, RenderRequest


def _error(**kwargs) -> tuple[str, str]:
    with pytest.raises(ValidationError) as info:
        RenderRequest(**{"prompt": "a fox", **kwargs})
    err = info.value.errors()[0]
    return ".".join(map(str, err["loc"])), err["msg"]


@pytest.mark.parametrize("field,value,needle", [
    ("prompt", "", "at least 1 character"),
    ("prompt", "   ", "non-whitespace"),
    ("prompt", "x" * 2001, "at most 2000 characters"),
    ("width", 100, "multiple of 8"),
    ("height", 56, "greater than or equal to 64"),
    ("width", 2056, "less than or equal to 2048"),
    ("num_inference_steps", 0, "greater than or equal to 1"),
    ("num_inference_steps", 151, "less than or equal to 150"),
    ("guidance_scale", 30.5, "less than or equal to 30"),
    ("guidance_scale", -1, "greater than or equal to 0"),
    ("seed", -1, "greater than or equal to 0"),
    ("output_format", "gif", "'png', 'webp' or 'jpeg'"),
    ("scheduler", "magic", "Input should be"),
    ("metadata", {"k": "v" * 1025}, "at most 1,024"),
])
def test_limits_name_field_and_rule(field, value, needle):
    loc, msg = _error(**{field: value})
    assert loc == field
    assert needle in msg


def test_unknown_field_is_refused():
    loc, msg = _error(steps=20)
    assert loc == "steps" and "Extra inputs" in msg


def test_valid_request_keeps_values_and_defaults():
    r = RenderRequest(prompt="a fox", width=64, height=2048, seed=2**32 - 1, metadata={"sku": "A-1"})
    assert (r.width, r.height, r.seed, r.num_inference_steps, r.output_format) == (64, 2048, 2**32 - 1, 20, "png")


def test_batch_limits():
    one = {"prompt": "a fox"}
    with pytest.raises(ValidationError, match="at least 1 item"):
        BatchSubmission(jobs=[])
    with pytest.raises(ValidationError, match="at most 10000 items"):
        BatchSubmission(jobs=[one] * 10_001)
    with pytest.raises(ValidationError) as info:
        BatchSubmission(jobs=[one, {"prompt": "b", "width": 65}])
    assert info.value.errors()[0]["loc"] == ("jobs", 1, "width")
    assert len(BatchSubmission(jobs=[one] * 10_000).jobs) == 10_000
