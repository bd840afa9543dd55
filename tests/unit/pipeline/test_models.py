import json

import pytest

from infra.schemas import RenderRequest
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


def test_loaded_pipeline(offline_cache):
    # its own load: the session's tiny_pipe has the scheduler of whichever render ran last
    pipe = load_pipeline("tiny", cache_dir=offline_cache)
    assert pipe.safety_checker is None
    assert pipe.tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert type(pipe.scheduler).__name__ == "DDIMScheduler"


def test_missing_local_path():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        load_pipeline("/no/such/model")


def test_directory_that_is_not_a_pipeline(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_pipeline(str(tmp_path))


def test_tiny_taiyi_is_sd1_with_a_chinese_bert_text_encoder(offline_cache):
    from pipeline.models.build import parameter_counts
    from pipeline.render import Renderer

    pipe = load_pipeline("tiny-taiyi", cache_dir=offline_cache)
    assert type(pipe.text_encoder).__name__ == "BertModel" and type(pipe.tokenizer).__name__ == "BertTokenizer"
    assert pipe.tokenizer.tokenize("一只狐狸") == ["一", "只", "狐", "狸"]  # one token per character
    assert "[UNK]" not in pipe.tokenizer.tokenize("小桥流水人家，水彩。")
    renderer = Renderer(pipe, model="tiny-taiyi")
    assert renderer.family == "sd1"
    requests = [RenderRequest(prompt=p, model="tiny-taiyi", seed=1, width=64, height=64, num_inference_steps=2)
                for p in ("红烧肉", "清蒸鲈鱼")]
    images = renderer.render(requests)
    assert [im.size for im in images] == [(64, 64)] * 2
    assert images[0].tobytes() != images[1].tobytes()  # the Chinese prompt conditions the picture
    counts = parameter_counts("taiyi-sd-arch")
    assert counts["unet"] == 859_520_964 and round(counts["text_encoder"] / 1e6) == 102  # Taiyi-CLIP-RoBERTa-102M


def test_tiny_kolors_batches_chinese_prompts_with_chatglm(offline_cache):
    import numpy as np

    from pipeline.render import Renderer

    pipe = load_pipeline("tiny-kolors", cache_dir=offline_cache)
    assert type(pipe).__name__ == "KolorsPipeline"
    assert (type(pipe.text_encoder).__name__, type(pipe.tokenizer).__name__) == ("ChatGLMModel", "ChatGLMTokenizer")
    assert [t for t in pipe.tokenizer.tokenize("一只狐狸") if t != "▁"] == ["一", "只", "狐", "狸"]
    renderer = Renderer(pipe, model="tiny-kolors")
    assert renderer.family == "kolors" and renderer.invariance == "cpu-kernels"
    cases = (("红烧肉，美食摄影", "", 1), ("山水画，水墨", "模糊", 2))
    requests = [RenderRequest(prompt=p, negative_prompt=n, model="tiny-kolors", seed=s, width=64, height=64,
                              num_inference_steps=2) for p, n, s in cases]
    images = renderer.render(requests)
    assert [im.size for im in images] == [(64, 64)] * 2
    alone = renderer.render(requests[1:])[0]
    assert np.array_equal(np.asarray(alone), np.asarray(images[1]))  # batch invariance holds for Kolors too


def test_an_offline_addon_build_is_published_once_and_leaves_nothing_behind(tmp_path):
    from pipeline.models.build import addon_build_dir, name_seed, published_once

    class Pipe:
        _renderfarm_model = "tiny"

    final = addon_build_dir(tmp_path, "controlnets", Pipe(), "tiny-controlnet-canny")
    assert final.parent.parent == tmp_path / "controlnets" and final.name == "tiny-controlnet-canny"
    assert name_seed("a") == name_seed("a") != name_seed("b")
    with published_once(final) as tmp:
        (tmp / "config.json").write_text("mine")
    assert (final / "config.json").read_text() == "mine"
    with published_once(final) as tmp:  # another build of the same name came second: the first is kept
        (tmp / "config.json").write_text("second")
    assert (final / "config.json").read_text() == "mine"
    with pytest.raises(RuntimeError), published_once(final.with_name("broken")) as tmp:
        raise RuntimeError("the save failed")
    assert sorted(p.name for p in final.parent.iterdir()) == ["tiny-controlnet-canny"]  # no temp dir, no half build
