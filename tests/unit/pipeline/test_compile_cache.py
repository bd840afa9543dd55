"""The compile cache's key and blob checks (pipeline/compile_cache.py): what makes two workers share
an artifact, and what a damaged or foreign blob becomes (an outcome with a reason, never an error
that stops the worker)."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from pipeline.compile_cache import (
    CacheKey,
    CorruptArtifact,
    MismatchedArtifact,
    cache_key,
    import_artifacts,
    model_revision,
    pack,
    read_header,
    unpack,
)
from pipeline.warm import WarmPlan

RECIPE = {"name": "cpu-amx/exact", "dtype": "float32", "compile_denoiser": True, "compile_vae": True,
          "compile_mode": "default", "max_batch_size": 8, "memory_fraction": 0.8, "report": {"applied": {}}}
CPU = {"kind": "cpu", "name": "Some CPU", "compute_capability": None}
PLAN = WarmPlan((1, 2), ((64, 64),), 1, 7.5)


def _tar(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_key_depends_on_what_is_compiled_and_nothing_else() -> None:
    key = cache_key("tiny", RECIPE, CPU, PLAN)
    assert key.name == cache_key("tiny", dict(RECIPE), dict(CPU), WarmPlan((1, 2), ((64, 64),), 1, 7.5)).name
    assert key.name.startswith("tiny-")
    # the batch cap, the memory bound and the steps do not change compiled code: same artifact
    assert cache_key("tiny", {**RECIPE, "max_batch_size": 16, "memory_fraction": 0.5}, CPU,
                     WarmPlan((1, 2), ((64, 64),), 20, 5.0)).name == key.name
    others = [cache_key("tiny", RECIPE, CPU, WarmPlan((1, 2, 4), ((64, 64),), 1, 7.5)),
              cache_key("tiny", RECIPE, CPU, WarmPlan((1, 2), ((64, 64), (128, 64)), 1, 7.5)),
              cache_key("tiny", RECIPE, CPU, WarmPlan((1, 2), ((64, 64),), 1, 0.0)),  # no guidance: half the batch
              cache_key("tiny", RECIPE, CPU, WarmPlan((1, 2), ((64, 64),), 1, 7.5, (("canny",),))),  # residual graphs
              cache_key("tiny", {**RECIPE, "compile_mode": "max-autotune"}, CPU, PLAN),
              cache_key("tiny", RECIPE, {**CPU, "name": "Other CPU"}, PLAN),
              cache_key("tiny", RECIPE, {"kind": "cuda", "name": "H100", "compute_capability": [9, 0]}, PLAN),
              cache_key("tiny-sdxl", RECIPE, CPU, PLAN)]
    assert len({k.name for k in others} | {key.name}) == len(others) + 1
    fields = key.fields
    assert fields["versions"]["torch"] and fields["versions"]["diffusers"] and "triton" in fields["versions"]
    assert isinstance(fields["device"]["isa"], list)  # the CPU's ISA flags are part of the key
    assert fields["revision"] == model_revision("tiny")
    assert "control_sets" not in fields  # without unit sets, the keys stored before stand


def test_model_revision_of_offline_builds_and_local_directories(tmp_path) -> None:
    assert model_revision("tiny").startswith("offline:tiny:")
    assert model_revision("tiny") != model_revision("sd15-arch")
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    (tmp_path / "unet" / "config.json").write_text('{"sample_size": 64}')
    first = model_revision(str(tmp_path))
    assert first.startswith("sha256:") and model_revision(str(tmp_path)) == first
    (tmp_path / "unet" / "config.json").write_text('{"sample_size": 96}')
    assert model_revision(str(tmp_path)) != first
    assert model_revision("no-such-org/no-such-model-here") == "unknown"  # in no local hub cache


def test_blob_round_trip_and_its_checks() -> None:
    key = CacheKey({"model": "tiny", "buckets": [1, 2]})
    blob = pack(key, b"payload bytes")
    assert unpack(blob, key) == b"payload bytes"
    assert read_header(blob)["key"] == key.name
    flipped = bytearray(blob)
    flipped[-3] ^= 0x01
    with pytest.raises(CorruptArtifact, match="SHA-256"):
        unpack(bytes(flipped), key)
    with pytest.raises(CorruptArtifact, match="bytes"):
        unpack(blob[:-1], key)
    with pytest.raises(CorruptArtifact, match="magic"):
        unpack(b"PK\x03\x04" + blob[4:], key)
    with pytest.raises(MismatchedArtifact, match="buckets"):
        unpack(blob, CacheKey({"model": "tiny", "buckets": [1, 2, 4]}))


def test_import_outcomes_never_raise() -> None:
    key = CacheKey({"model": "tiny", "buckets": [1]})
    assert import_artifacts(None, key).outcome == "miss"
    corrupt = import_artifacts(b"garbage", key)
    assert (corrupt.outcome, corrupt.bytes) == ("corrupt", 7)
    foreign = import_artifacts(pack(CacheKey({"model": "tiny", "buckets": [2]}), b"x"), key)
    assert foreign.outcome == "mismatch" and "buckets" in foreign.reason
    not_tar = import_artifacts(pack(key, b"not a tar at all" * 64), key)
    assert not_tar.outcome == "corrupt"
    escaping = import_artifacts(pack(key, _tar({"megacache.bin": b"", "kernels/../../etc/passwd": b""})), key)
    assert escaping.outcome == "corrupt" and "unexpected member" in escaping.reason
    unloadable = import_artifacts(pack(key, _tar({"megacache.bin": b"\x00not a megacache"})), key)
    assert unloadable.outcome == "error" and "load_cache_artifacts" in unloadable.reason
    assert json.dumps(unloadable.to_dict())
