"""A rendered video's files: the H.264 MP4, its poster frame and an animated WebP preview.

Place in the data flow: worker (a video's frames, :func:`infra.video.frames_of`) → **here**: the
frames are encoded to an MP4 in a temporary file, frame by frame (the encoded video is never held
in memory), its poster and preview as bytes → :mod:`infra.storage.video_results` uploads them.
No S3 here.

**MP4.** H.264 through PyAV (``libx264``, FFmpeg inside the PyAV wheel), ``yuv420p`` (4:2:0, the
one chroma format every browser's H.264 decoder plays), MP4 with ``movflags=+faststart``: FFmpeg's
mov muxer rewrites the file at the end so that the ``moov`` atom (the index) comes before ``mdat``
(the frames), and a browser can start playing and seek through HTTP range requests without
reading the whole file first (FFmpeg formats documentation, "mov, mp4, ismv": ``faststart``).
Colours are converted with the BT.709 matrix and tagged BT.709, limited range (:data:`BT709`).
4:2:0 needs even widths and heights: an odd frame is padded by one column or row repeating its
edge pixels (:func:`even_size`), and the MP4's size is the padded one.

**Metadata.** The container carries the same A1111 ``parameters`` text an image carries
(:func:`infra.storage.images.format_parameters`, plus ``Frames`` and ``FPS``,
:func:`video_parameters`) in the ``comment`` tag and the prompt in ``title``. FFmpeg's mov muxer
writes these standard keys as iTunes-style ``©cmt`` / ``©nam`` atoms (FFmpeg's movenc.c); a key
of our own (``renderfarm_job`` …) is dropped unless ``movflags=use_metadata_tags``, which writes
*every* key, the standard ones too, as QuickTime ``mdta`` keys instead (FFmpeg formats
documentation, "mov, mp4, ismv"). Checked with PyAV 18.1.1 (libavformat 62.12) by decoding:
without the flag, ``comment`` and ``title`` (UTF-8, line breaks kept) read back and a custom key
is lost; with it, all three read back. The farm keeps the iTunes-style atoms, the long-standing
place for them, and writes only the standard keys (the job id is in the ``parameters`` text).

**Poster.** The first frame, encoded as an image is (:func:`infra.storage.images.encode_image`),
in the request's ``output_format`` with the same ``parameters``.

**Preview.** An animated WebP (Pillow ``save_all``) of at most :data:`PREVIEW_MAX_FRAMES` frames
(every ``step``-th frame) at most :data:`PREVIEW_MAX_SIDE` pixels on the long side, each frame
shown ``step / fps`` seconds, looping: a gallery thumbnail that plays without a video element.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from av.video.reformatter import Colorspace
from PIL import Image

from infra.schemas import RenderRequest
from infra.storage.images import encode_image, format_parameters

#: x264's constant rate factor: 0 lossless … 51 worst; x264's own default is 23, and 17–18 is
#: "visually lossless or nearly so" (FFmpeg's "H.264 Video Encoding Guide", trac.ffmpeg.org/wiki/
#: Encode/H.264): a rendered video is the product, so it is kept at 18.
CRF = 18
#: x264's speed/compression preset: ``medium`` is x264's default (the same guide: "use the slowest
#: preset that you have patience for"; slower presets shrink the file at the same quality).
PRESET = "medium"
#: Seconds between keyframes (x264 ``keyint``): a seek decodes from the keyframe before it. Two
#: seconds is what Apple's "HTTP Live Streaming (HLS) authoring specification for Apple devices"
#: asks of segments' keyframes (x264's default is 250 frames, 10 s at 25 fps).
KEYFRAME_INTERVAL_S = 2
#: The chroma format: 4:2:0, the one browsers' H.264 decoders play (High profile).
PIX_FMT = "yuv420p"
#: Colour code points written in the stream (ITU-T H.273): 1 = BT.709 for the matrix, the
#: primaries (the same as sRGB's) and the transfer; range 1 = limited ("MPEG", 16–235), what the
#: conversion below produces. The RGB → YUV conversion uses the BT.709 matrix to match: an
#: untagged stream leaves each player to guess BT.601 or BT.709, and a wrong guess shifts colours.
BT709, LIMITED_RANGE = 1, 1
#: Preview bounds: the long side in pixels, the number of frames (every ``step``-th frame kept).
PREVIEW_MAX_SIDE = 320
PREVIEW_MAX_FRAMES = 48
#: The preview's lossy WebP quality (0–100) and method (0 fast … 6 small; Pillow's default 4).
PREVIEW_QUALITY = 75
PREVIEW_METHOD = 4
#: The MP4 user metadata keys: the A1111 ``parameters`` text, and the prompt.
COMMENT_TAG, TITLE_TAG = "comment", "title"


@dataclass(frozen=True)
class EncodedVideo:
    """An MP4 written by :func:`encode_mp4`: its ``path``, frame ``width`` × ``height`` in pixels
    (even: the padded size), ``num_frames``, ``fps`` (frames per second) and ``bytes`` (file size)."""

    path: Path
    width: int
    height: int
    num_frames: int
    fps: int
    bytes: int

    @property
    def duration_s(self) -> float:
        """The video's length in seconds: ``num_frames / fps``."""
        return self.num_frames / self.fps


@dataclass(frozen=True)
class VideoInfo:
    """What :func:`probe_mp4` reads back from an MP4: ``codec`` (FFmpeg's decoder name, ``h264``),
    ``pix_fmt``, ``width`` × ``height`` pixels, ``num_frames`` (decoded, not the header's
    claim), ``fps`` (the stream's average frame rate), ``duration_s`` (seconds, from the
    container) and ``metadata`` (the container's tags: ``comment``, ``title``, …)."""

    codec: str
    pix_fmt: str
    width: int
    height: int
    num_frames: int
    fps: Fraction
    duration_s: float
    metadata: dict[str, str]


def video_parameters(request: RenderRequest, *, model: str, job_id: str | None = None,
                     scheduler: str | None = None, num_frames: int, fps: int) -> str:
    """The infotext of a video: A1111's (:func:`infra.storage.images.format_parameters`) with
    ``Frames: N, FPS: F`` added to its fields line (A1111 has no video fields; these are the
    farm's, parsed like any other by :func:`infra.storage.images.parse_parameters`)."""
    return (format_parameters(request, model=model, job_id=job_id, scheduler=scheduler)
            + f", Frames: {num_frames}, FPS: {fps}")


def even_size(width: int, height: int) -> tuple[int, int]:
    """The frame size an MP4 of ``width`` × ``height`` frames gets: each side rounded up to even
    (4:2:0 halves both in chroma, and libx264 refuses odd sizes)."""
    return width + width % 2, height + height % 2


def _check_frames(frames: np.ndarray, fps: int) -> None:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] < 1:
        raise ValueError(f"frames must be a uint8 array (num_frames >= 1, height, width, 3), got "
                         f"{frames.dtype} {frames.shape}")
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")


def _padded(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """``frame`` (h, w, 3) grown to ``height`` × ``width`` by repeating its last row and column."""
    pad_h, pad_w = height - frame.shape[0], width - frame.shape[1]
    if not pad_h and not pad_w:
        return np.ascontiguousarray(frame)
    return np.pad(frame, ((0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def encode_mp4(frames: np.ndarray, fps: int, path: Path, *, parameters: str, title: str,
               crf: int = CRF, preset: str = PRESET) -> EncodedVideo:
    """Write ``frames`` to ``path`` as an H.264 MP4 (see the module docstring), one frame at a time.

    Args:
        frames: uint8 array ``(num_frames, height, width, 3)``, RGB.
        fps: frames per second (the MP4's frame rate; each frame lasts ``1 / fps`` s).
        path: the file to write (created or replaced); the caller removes it.
        parameters: the infotext for the ``comment`` tag; title: the ``title`` tag (the prompt).
        crf, preset: x264's rate factor and preset (:data:`CRF`, :data:`PRESET`).
    Returns:
        the written file's facts (the size padded to even, :func:`even_size`).
    Raises:
        ValueError: ``frames`` is not such an array, or ``fps`` < 1.
        av.FFmpegError: FFmpeg could not encode or write.
    """
    _check_frames(frames, fps)
    num_frames, height, width = frames.shape[:3]
    out_w, out_h = even_size(width, height)
    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"}) as container:
        container.metadata[COMMENT_TAG] = parameters
        container.metadata[TITLE_TAG] = title
        stream = container.add_stream("libx264", rate=fps, options={
            "crf": str(crf), "preset": preset, "g": str(max(1, KEYFRAME_INTERVAL_S * fps))})
        stream.width, stream.height, stream.pix_fmt = out_w, out_h, PIX_FMT
        codec = stream.codec_context
        codec.colorspace = codec.color_primaries = codec.color_trc = BT709
        codec.color_range = LIMITED_RANGE
        for frame in frames:
            video_frame = av.VideoFrame.from_ndarray(_padded(frame, out_w, out_h), format="rgb24")
            container.mux(stream.encode(video_frame.reformat(format=PIX_FMT, dst_colorspace=Colorspace.ITU709)))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
    return EncodedVideo(path=path, width=out_w, height=out_h, num_frames=num_frames, fps=fps,
                        bytes=path.stat().st_size)


def probe_mp4(source: Any) -> VideoInfo:
    """Read an MP4 back with PyAV: codec, size, frame rate, duration, tags, and the frame count
    by decoding every frame.

    Args:
        source: a path, or a binary file object (``io.BytesIO`` of a downloaded body).
    Raises:
        av.FFmpegError: not a video FFmpeg can read. ValueError: it has no video stream.
    """
    with av.open(source if not isinstance(source, Path) else str(source)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        info = dict(codec=stream.codec_context.name, pix_fmt=str(stream.codec_context.pix_fmt),
                    width=stream.codec_context.width, height=stream.codec_context.height,
                    fps=Fraction(stream.average_rate or 0),
                    duration_s=(container.duration or 0) / av.time_base, metadata=dict(container.metadata))
        num_frames = sum(1 for _ in container.decode(stream))
    return VideoInfo(num_frames=num_frames, **info)


def encode_poster(poster: Image.Image, fmt: str, parameters: str) -> tuple[bytes, str]:
    """The poster frame (``poster``, RGB, the video's first frame) as ``fmt`` (png, webp or jpeg)
    bytes with ``parameters`` embedded, as an image is (:func:`infra.storage.images.encode_image`).

    Returns: (bytes, content type). Raises: ValueError for an unknown format."""
    return encode_image(poster, fmt, parameters)


def preview_plan(num_frames: int, width: int, height: int) -> tuple[int, tuple[int, int]]:
    """The preview's frame ``step`` (every step-th frame, at most :data:`PREVIEW_MAX_FRAMES`) and
    its ``(width, height)`` in pixels (the long side at most :data:`PREVIEW_MAX_SIDE`, aspect kept,
    never enlarged, at least 1)."""
    step = max(1, math.ceil(num_frames / PREVIEW_MAX_FRAMES))
    scale = min(1.0, PREVIEW_MAX_SIDE / max(width, height))
    return step, (max(1, round(width * scale)), max(1, round(height * scale)))


def encode_preview(frames: np.ndarray, fps: int) -> bytes:
    """An animated WebP of ``frames`` (uint8 ``(num_frames, height, width, 3)`` RGB) bounded by
    :func:`preview_plan`: every ``step``-th frame, downscaled (Lanczos), each shown
    ``round(1000 × step / fps)`` ms, looping forever (WebP container specification, ``ANIM`` loop
    count 0). Raises ValueError for frames or fps as :func:`encode_mp4` refuses them."""
    _check_frames(frames, fps)
    step, size = preview_plan(frames.shape[0], frames.shape[2], frames.shape[1])
    images = [Image.fromarray(frame).resize(size, Image.Resampling.LANCZOS) if size != frame.shape[1::-1]
              else Image.fromarray(frame) for frame in frames[::step]]
    out = io.BytesIO()
    images[0].save(out, format="WEBP", save_all=True, append_images=images[1:], loop=0,
                   duration=round(1000 * step / fps), quality=PREVIEW_QUALITY, method=PREVIEW_METHOD)
    return out.getvalue()

