"""Job ids made for a whole batch at once (:func:`infra.submission.submitter.new_ids`) have the shape
of :func:`infra.submission.submitter.new_id`'s, and large bodies parse to what ``json.loads`` gives
(:mod:`infra.api.json_body`), with its errors where it has one."""

from __future__ import annotations

import json
import uuid

import pytest

from infra import keys
from infra.api.json_body import parse_json
from infra.schemas import is_farm_id
from infra.submission.submitter import new_id, new_ids


def test_batch_ids_are_uuid4_shaped_farm_ids_in_the_batch_shard():
    batch_id = new_id()
    ids = new_ids(5000, keys.shard(batch_id))
    assert len(set(ids)) == 5000
    for job_id in ids:
        assert is_farm_id(job_id) and keys.shard(job_id) == keys.shard(batch_id)
        parsed = uuid.UUID(hex="00" + job_id[2:])
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert new_ids(0, "ab") == []


@pytest.mark.parametrize("body", [
    b'{"jobs": [{"prompt": "a fox", "seed": 1, "guidance_scale": 7.5}], "priority": "high"}',
    b'{"a": 1, "a": 2}', b'{"a": NaN, "b": Infinity, "c": 1e400, "d": 123456789012345678901234567890}',
    b'{"a": "\\ud83d\\ude00 \\u0000"}', b'{"a": "\\ud800"}',  # a lone surrogate: json.loads keeps it
    b'\xef\xbb\xbf{"a": 1}', '{"a": 1}'.encode("utf-16"), b"[" * 500 + b"]" * 500,
])
def test_bodies_parse_as_json_loads_parses_them(body):
    assert repr(parse_json(body)) == repr(json.loads(body))


@pytest.mark.parametrize("body", [b"", b'{"a": 1} x', b'{"a": "x\ny"}', b'{"a": 01}', b'{"a": "\xff"}'])
def test_refused_bodies_raise_what_json_loads_raises(body):
    with pytest.raises(ValueError) as expected:
        json.loads(body)
    with pytest.raises(type(expected.value)) as got:
        parse_json(body)
    assert str(got.value) == str(expected.value)
