import json

import pytest

from pipeline.models import OFFLINE_MODELS, build_offline_model, load_pipeline


def test_offline_names():
    assert {"tiny", "sd15-arch", "sd-turbo-arch", "bk-sdm-tiny-arch"} <= set(OFFLINE_MODELS)


def test_build_once(offline_cache, tiny_pipe):
    path = build_offline_model("tiny", offline_cache)  # tiny_pipe built it already
    assert path == offline_cache / "models" / "tiny"
    weights = path / "unet" / "diffusion_pytorch_model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_offline_model("tiny", offline_cache) == path
    assert weights.stat().st_mtime_ns == before
    assert (path / "tokenizer" / "vocab.json").is_file() and (path / "tokenizer" / "merges.txt").is_file()
    assert json.loads((path / "model_index.json").read_text())["safety_checker"] == [None, None]
    assert not [p for p in path.parent.iterdir() if ".build-" in p.name]  # no temp dirs left


def test_stale_build_is_rebuilt(tmp_path):
    path = build_offline_model("tiny", tmp_path)
    stamp = path / "renderfarm_build.json"
    stamp.write_text(json.dumps({"name": "tiny", "fingerprint": "old"}))
    assert build_offline_model("tiny", tmp_path) == path
    assert json.loads(stamp.read_text())["fingerprint"] == OFFLINE_MODELS["tiny"].fingerprint()
    assert sorted(p.name for p in tmp_path.joinpath("models").iterdir() if not p.name.endswith(".lock")) == ["tiny"]


def test_unknown_offline_name(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        build_offline_model("nope", tmp_path)


def test_loaded_pipeline(tiny_pipe):
    assert tiny_pipe.safety_checker is None
    assert tiny_pipe.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert type(tiny_pipe.scheduler).__name__ == "DDIMScheduler"


def test_missing_local_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_pipeline("/no/such/model")


def test_directory_that_is_not_a_pipeline(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_pipeline(str(tmp_path))
