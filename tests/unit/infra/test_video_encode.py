"""A rendered video's files (infra/storage/video.py), decoded back with real PyAV and Pillow: the
H.264 MP4's frames, rate, size, pixels, tags and atom order; odd sizes padded; the poster is the
first frame in the request's format; the animated WebP preview's frames, durations and bounds."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, WebPImagePlugin

from infra.schemas import RenderRequest
from infra.storage.images import parse_parameters, read_parameters
from infra.storage.video import (
    PREVIEW_MAX_FRAMES,
    PREVIEW_MAX_SIDE,
    encode_mp4,
    encode_poster,
    encode_preview,
    probe_mp4,
    video_parameters,
)
from infra.video import frames_of
from pipeline.null import null_video


def _request(**kw) -> RenderRequest:
    return RenderRequest(**{"prompt": "a red fox, running; 雪地", "model": "null", "width": 80, "height": 64,
                            "seed": 5, "kind": "video", "num_frames": 9, "fps": 8, **kw})


def _frames(request: RenderRequest) -> np.ndarray:
    carried = frames_of(null_video(request))
    assert carried is not None
    return carried[0]


def _top_atoms(data: bytes) -> list[str]:
    """The MP4's top-level box types in file order (ISO/IEC 14496-12 box headers)."""
    names, pos = [], 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if size == 1:
            size = struct.unpack(">Q", data[pos + 8:pos + 16])[0]
        names.append(kind.decode("latin-1"))
        if size < 8:
            break
        pos += size
    return names


def _decoded(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_mp4_round_trip_frames_rate_codec_and_parameters(tmp_path):
    request = _request()
    frames = _frames(request)
    text = video_parameters(request, model="null", job_id="job-1", num_frames=9, fps=8)
    video = encode_mp4(frames, 8, tmp_path / "v.mp4", parameters=text, title=request.prompt)
    assert (video.width, video.height, video.num_frames, video.fps) == (80, 64, 9, 8)
    assert video.bytes == (tmp_path / "v.mp4").stat().st_size and video.duration_s == 9 / 8

    info = probe_mp4(tmp_path / "v.mp4")
    assert (info.codec, info.pix_fmt, info.width, info.height) == ("h264", "yuv420p", 80, 64)
    assert info.num_frames == 9 and info.fps == 8 and info.duration_s == pytest.approx(1.125, abs=1e-3)
    assert info.metadata["comment"] == text and info.metadata["title"] == request.prompt
    fields = parse_parameters(info.metadata["comment"])
    assert (fields["prompt"], fields["Frames"], fields["FPS"], fields["Seed"], fields["Job id"]) == (
        request.prompt, "9", "8", "5", "job-1")


def test_mp4_pixels_follow_the_frames_in_rgb_order(tmp_path):
    frames = np.zeros((3, 64, 64, 3), np.uint8)
    frames[0, ..., 0] = 220  # red, green, blue: a swapped channel order would show
    frames[1, ..., 1] = 220
    frames[2, ..., 2] = 220
    encode_mp4(frames, 4, tmp_path / "rgb.mp4", parameters="p", title="t")
    decoded = _decoded(tmp_path / "rgb.mp4").astype(int)
    assert decoded.shape == frames.shape
    assert np.abs(decoded - frames).mean() < 6  # limited-range 4:2:0 and CRF 18: close, not exact

    import av

    with av.open(str(tmp_path / "rgb.mp4")) as container:  # tagged, so a player need not guess the matrix
        codec = container.streams.video[0].codec_context
        assert (codec.colorspace, codec.color_primaries, codec.color_trc, codec.color_range) == (1, 1, 1, 1)

    smooth = _frames(_request())
    encode_mp4(smooth, 8, tmp_path / "s.mp4", parameters="p", title="t")
    mse = ((_decoded(tmp_path / "s.mp4").astype(float) - smooth) ** 2).mean()
    assert 10 * np.log10(255**2 / mse) > 30  # PSNR, dB


def test_moov_comes_before_mdat_for_range_playback(tmp_path):
    encode_mp4(_frames(_request()), 8, tmp_path / "v.mp4", parameters="p", title="t")
    atoms = _top_atoms((tmp_path / "v.mp4").read_bytes())
    assert atoms[0] == "ftyp" and atoms.index("moov") < atoms.index("mdat"), atoms


def test_odd_sizes_are_padded_to_even_with_edge_pixels(tmp_path):
    rng = np.random.default_rng(1)
    frames = np.repeat(rng.integers(0, 256, (1, 47, 63, 3), dtype=np.uint8), 5, axis=0)
    frames[:, :, -1] = (200, 30, 30)  # the last column, which the padding repeats
    video = encode_mp4(frames, 5, tmp_path / "odd.mp4", parameters="p", title="t")
    assert (video.width, video.height) == (64, 48)
    info = probe_mp4(tmp_path / "odd.mp4")
    assert (info.width, info.height, info.num_frames) == (64, 48, 5)
    decoded = _decoded(tmp_path / "odd.mp4").astype(int)
    assert np.abs(decoded[:, :47, 63] - [200, 30, 30]).mean() < 25  # the padded column repeats the last one


@pytest.mark.parametrize("frames, fps", [(np.zeros((2, 8, 8, 3), np.float32), 8), (np.zeros((8, 8, 3), np.uint8), 8),
                                         (np.zeros((0, 8, 8, 3), np.uint8), 8), (np.zeros((2, 8, 8, 3), np.uint8), 0)])
def test_bad_frames_or_rate_are_refused(tmp_path, frames, fps):
    with pytest.raises(ValueError):
        encode_mp4(frames, fps, tmp_path / "x.mp4", parameters="p", title="t")
    assert not (tmp_path / "x.mp4").exists()


@pytest.mark.parametrize("fmt, pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_poster_is_the_first_frame_in_the_requested_format(fmt, pil_format):
    request = _request(output_format=fmt)
    image = null_video(request)
    text = video_parameters(request, model="null", num_frames=9, fps=8)
    body, content_type = encode_poster(image, fmt, text)
    assert content_type == f"image/{fmt}"
    poster = Image.open(io.BytesIO(body))
    assert poster.format == pil_format and poster.size == (80, 64)
    first = _frames(request)[0].astype(int)
    error = np.abs(np.asarray(poster.convert("RGB")).astype(int) - first)
    assert error.max() == 0 if fmt == "png" else error.mean() < 4
    assert read_parameters(body) == text


def _webp(data: bytes) -> WebPImagePlugin.WebPImageFile:
    image = Image.open(io.BytesIO(data))
    assert isinstance(image, WebPImagePlugin.WebPImageFile)
    return image


def test_preview_is_an_animated_webp_at_the_video_rate():
    frames = _frames(_request())
    data = encode_preview(frames, 8)
    preview = _webp(data)
    assert preview.format == "WEBP" and preview.is_animated and preview.n_frames == 9
    assert preview.size == (80, 64)  # small already: not enlarged
    durations = []
    for n in range(preview.n_frames):
        preview.seek(n)
        preview.load()
        durations.append(preview.info["duration"])
    assert durations == [125] * 9 and preview.info["loop"] == 0


def test_a_long_large_video_previews_bounded():
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 256, (121, 480, 832, 3), dtype=np.uint8)
    preview = _webp(encode_preview(frames, 24))
    step = 3  # ceil(121 / 48)
    assert preview.n_frames == len(range(0, 121, step)) <= PREVIEW_MAX_FRAMES
    assert max(preview.size) == PREVIEW_MAX_SIDE and preview.size == (320, 185)
    preview.seek(1)
    preview.load()
    assert preview.info["duration"] == round(1000 * step / 24)


def test_keyframes_are_at_most_two_seconds_apart_for_seeking(tmp_path):
    import av

    frames = _frames(_request(num_frames=41))  # 10 s at 4 fps: x264's own default would key frame 0 alone
    encode_mp4(frames, 4, tmp_path / "k.mp4", parameters="p", title="t")
    with av.open(str(tmp_path / "k.mp4")) as container:
        keys = [n for n, packet in enumerate(p for p in container.demux(video=0) if p.size) if packet.is_keyframe]
    assert keys[0] == 0 and len(keys) >= 5 and max(b - a for a, b in zip(keys, keys[1:])) <= 2 * 4, keys
