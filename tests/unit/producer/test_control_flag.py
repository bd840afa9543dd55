"""``renderfarm submit --control TYPE:IMAGE[:WEIGHT]``: the unit a flag makes (keys and https URLs
as given, the weight only where the last part is a number) and the flags it refuses."""

from __future__ import annotations

import pytest

from producer.cli import _control


@pytest.mark.parametrize(("text", "unit"), [
    ("canny:inputs/edges.png", {"type": "canny", "image": "inputs/edges.png"}),
    ("canny:inputs/edges.png:0.8", {"type": "canny", "image": "inputs/edges.png", "weight": 0.8}),
    ("depth:https://example.com/d.png", {"type": "depth", "image": "https://example.com/d.png"}),
    ("depth:https://example.com/d.png:1.5", {"type": "depth", "image": "https://example.com/d.png", "weight": 1.5}),
    ("depth:https://example.com:8443/d.png", {"type": "depth", "image": "https://example.com:8443/d.png"}),
])
def test_a_flag_makes_one_unit(text, unit):
    assert _control(text, client=None) == unit  # no local file: nothing is uploaded


@pytest.mark.parametrize("text", ["canny", "canny:", ":inputs/edges.png"])
def test_a_flag_without_type_or_image_is_refused(text):
    with pytest.raises(ValueError, match="expected TYPE:IMAGE"):
        _control(text, client=None)
