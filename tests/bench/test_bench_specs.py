"""The bench spec syntax (``--recipes``): names, ``+batch_invariant``, options, and clear errors."""

from __future__ import annotations

import pytest

from bench.pipeline.specs import parse_spec, parse_specs


def test_plain_names_and_aliases():
    assert parse_spec("reference").kind == "reference"
    baseline = parse_spec("baseline")
    assert baseline.kind == "reference" and baseline.text == "baseline"  # the row keeps its given name
    assert parse_spec("peer").kind == "peer" and parse_spec("sdnq-uint4").kind == "sdnq-uint4"
    exact = parse_spec("exact")
    assert (exact.kind, exact.recipe, exact.options, exact.batch_invariant) == ("farm", "exact", {}, None)


def test_batch_invariant_flag_and_key_and_recipe_overrides():
    flagged = parse_spec("exact+batch_invariant")
    assert flagged.recipe == "exact" and flagged.batch_invariant is True and flagged.options == {}
    keyed = parse_spec("fast:batch_invariant=false+fuse_qkv=false+num_threads=1+sdpa=cudnn")
    assert keyed.batch_invariant is False and keyed.sdpa == "cudnn"
    assert keyed.options == {"fuse_qkv": False, "num_threads": 1}  # left for apply_overrides to validate


def test_experiment_knobs():
    spec = parse_spec("fast:fp8=true+first_block_cache=0.1")
    assert spec.fp8 is True and spec.first_block_cache == 0.1 and spec.options == {}
    assert parse_spec("peer:first_block_cache=0.05").first_block_cache == 0.05  # any kind of row
    with pytest.raises(ValueError, match="threshold in"):
        parse_spec("exact:first_block_cache=2")
    with pytest.raises(ValueError, match="fp8 must be true or false"):
        parse_spec("exact:fp8=e4m3")


def test_diffusers_subject_options_are_typed():
    assert parse_spec("peer:compile_mode=default+compile=false").options == {"compile_mode": "default",
                                                                            "compile": False}
    assert parse_spec("reference:dtype=float32").options == {"dtype": "float32"}
    with pytest.raises(ValueError, match="reference has no option 'compile'"):
        parse_spec("reference:compile=true")
    with pytest.raises(ValueError, match="must be bool"):
        parse_spec("peer:compile=maybe")


@pytest.mark.parametrize("text, message", [
    ("exact+turbo", "unknown flag 'turbo'"),
    ("exact:fuse_qkv", "is not key=value"),
    ("exact:sdpa=fastest", "sdpa='fastest'"),
    ("exact:batch_invariant=3", "batch_invariant must be true or false"),
    (":fuse_qkv=false", "has no name"),
])
def test_bad_specs_are_refused_with_the_reason(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_references_come_first_and_duplicates_are_refused():
    assert [s.text for s in parse_specs(["exact", "peer", "reference"])] == ["reference", "exact", "peer"]
    with pytest.raises(ValueError, match="given twice: exact"):
        parse_specs(["exact", "reference", "exact"])
