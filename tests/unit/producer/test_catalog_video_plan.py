"""Video items in a catalog: a ``video`` column (or ``kind``, ``frames``/``fps`` columns, or the
command line's ``--video``/``--frames``/``--fps`` defaults) makes an item a video job whose content
key covers its frames and rate; image items keep their keys; a bad ``video`` value fails its item."""

from __future__ import annotations

from producer.catalog import plan_items, prepare_catalog
from producer.catalog.items import read_catalog
from producer.catalog.templates import Template

DEFAULTS = {"model": "null", "width": 64, "height": 64}


def _plans(tmp_path, text, defaults=DEFAULTS):
    path = tmp_path / "c.csv"
    path.write_text(text, encoding="utf-8")
    return plan_items(read_catalog(path)[1], Template("{name}"), defaults)


def test_a_video_column_makes_video_items_with_their_frames_in_the_key(tmp_path):
    mug, cup, turn, turn_longer, framed = _plans(tmp_path, "name,video,frames,fps,seed\nmug,,,,1\ncup,no,,,1\n"
                                                           "turn,yes,9,8,1\nturn,true,17,8,1\nturn,,9,8,1\n")
    assert [p.error for p in (mug, cup, turn, turn_longer, framed)] == [None] * 5
    assert not mug.request.is_video and "kind" not in mug.request.model_dump()
    assert cup.request.kind == "image"
    assert (turn.request.kind, turn.request.num_frames, turn.request.fps) == ("video", 9, 8)
    assert framed.request.kind == "video" and framed.key == turn.key  # frames alone imply a video
    assert turn_longer.key != turn.key  # another frame count is another render
    image_turn = _plans(tmp_path, "name,seed\nturn,1\n")[0]
    assert image_turn.key not in (turn.key, framed.key)  # the same prompt as an image is another render too


def test_an_image_items_key_does_not_change_with_the_video_columns(tmp_path):
    before = _plans(tmp_path, "name,seed\nmug,1\n")[0]
    after = _plans(tmp_path, "name,video,frames,seed\nmug,,,1\nturn,1,9,1\n")[0]
    assert before.key == after.key and before.request.seed == after.request.seed


def test_the_command_lines_video_defaults_and_an_item_that_stays_an_image(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"name": "turn"}\n{"name": "still", "video": false}\n{"name": "long", "frames": 17}\n')
    plans, _ = prepare_catalog(path, "{name}", model="null",
                               params={"width": 64, "height": 64, "kind": "video", "num_frames": 9, "fps": 8})
    turn, still, long = (p.request for p in plans)
    assert (turn.kind, turn.num_frames, turn.fps) == ("video", 9, 8)
    assert still.kind == "image" and still.num_frames is None and still.fps is None
    assert (long.kind, long.num_frames, long.fps) == ("video", 17, 8)


def test_a_bad_video_value_or_a_video_with_upscaling_fails_its_item_by_name(tmp_path):
    bad, upscaled, fine = _plans(tmp_path, "name,video,upscale,upscaler,seed\nx,maybe,,,1\ny,yes,2,esrgan,1\n"
                                           "z,yes,,,1\n")
    assert bad.error["type"] == "ValidationError" and "column 'video': 'maybe'" in bad.error["message"]
    assert upscaled.error["type"] == "ValidationError"
    assert "a video request takes no upscale" in upscaled.error["message"]
    assert fine.error is None and fine.request.is_video
