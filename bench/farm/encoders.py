"""``renderfarm bench encode``: what each image encoder costs the worker's CPU, and what it keeps.

Place in the data flow: beside it. The worker encodes each rendered image
(:func:`infra.storage.images.encode_image`) before the upload; this module times the candidate
encoders on the null renderer's render-like image (:func:`pipeline.null.null_image`: smooth
colour waves plus Gaussian noise, whose PNG is the size of a real render's) at each size:

- Pillow PNG at ``compress_level`` 0..9 (zlib; ``parameters`` in an ``iTXt`` chunk);
- ``fpng`` (Rich Geldreich's fpng through the ``fpng`` wheel), with the ``iTXt`` chunk spliced in
  after ``IHDR`` (fpng writes no text chunks);
- WebP lossless and lossy (quality 95), ``method=0`` (libwebp's fastest), EXIF ``UserComment``;
- JPEG quality 95 through Pillow (EXIF) and ``simplejpeg`` (libjpeg-turbo, the EXIF APP1 segment
  spliced in after SOI).

Each row gives the median CPU ms per image (thread CPU time over ``repeats`` encodes), the bytes,
whether decoding gives back the same pixels (lossless) and whether
:func:`infra.storage.images.read_parameters` reads the A1111 ``parameters`` back. A second table
encodes ``pool_images`` images with the default PNG encoder (:func:`infra.storage.images.encode_png`)
on 1..cores threads and on a process pool of the same sizes (images/s, wall clock), since
Pillow's encoders release the GIL.

``fpng`` and ``simplejpeg`` are optional: a row says "not installed" when their wheel is absent.
"""

from __future__ import annotations

import io
import os
import statistics
import struct
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

PARAMETERS = ("a lighthouse at dusk, 35mm, 雪\nNegative prompt: blurry\nSteps: 4, Sampler: Euler a, CFG scale: 7.5, "
              "Seed: 7, Size: 512x512, Model: null")


@dataclass(frozen=True)
class EncodeBenchConfig:
    """What ``bench encode`` measures: square ``sizes`` in pixels, ``repeats`` encodes per
    encoder (median shown), ``pool_images`` images per thread/process pool run."""

    sizes: tuple[int, ...] = (512, 1024)
    repeats: int = 7
    pool_images: int = 32

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.pool_images < 1 or not self.sizes:
            raise ValueError("repeats and pool_images must be >= 1, sizes non-empty")


def _exif(parameters: str) -> bytes:
    from PIL import Image

    from infra.storage.images import _EXIF_IFD, _USER_COMMENT

    exif = Image.Exif()
    exif.get_ifd(_EXIF_IFD)[_USER_COMMENT] = b"UNICODE\0" + parameters.encode("utf-16-be")
    return exif.tobytes()


def _encoders(parameters: str) -> dict[str, Callable | str]:
    """name → ``encode(image) -> bytes``, or a string saying why the encoder is missing."""
    from PIL import PngImagePlugin

    from infra.storage.images import png_text_chunk

    def pillow(fmt: str, **kw):
        def encode(image):
            buf = io.BytesIO()
            image.save(buf, format=fmt, **kw)
            return buf.getvalue()
        return encode

    info = PngImagePlugin.PngInfo()
    info.add_itxt("parameters", parameters)
    exif = _exif(parameters)
    out: dict[str, Callable | str] = {f"png-{level}": pillow("PNG", pnginfo=info, compress_level=level)
                                      for level in range(10)}
    try:
        import fpng

        out["fpng"] = lambda image: (lambda png: png[:33] + png_text_chunk("parameters", parameters) + png[33:])(
            fpng.from_pil(image))
    except ImportError:
        out["fpng"] = "not installed (pip install fpng)"
    out["webp-lossless-m0"] = pillow("WEBP", lossless=True, method=0, exif=exif)
    out["webp-q95-m0"] = pillow("WEBP", quality=95, method=0, exif=exif)
    out["jpeg-q95-pillow"] = pillow("JPEG", quality=95, exif=exif)
    try:
        import numpy as np
        import simplejpeg

        app1 = b"\xff\xe1" + struct.pack(">H", len(exif) + 8) + b"Exif\0\0" + exif
        out["jpeg-q95-simplejpeg"] = lambda image: (lambda jpg: jpg[:2] + app1 + jpg[2:])(
            simplejpeg.encode_jpeg(np.asarray(image), quality=95, colorspace="RGB"))
    except ImportError:
        out["jpeg-q95-simplejpeg"] = "not installed (pip install simplejpeg)"
    return out


def _measure(encode: Callable, image, repeats: int) -> tuple[float, bytes]:
    times, data = [], b""
    for _ in range(repeats):
        t0 = time.thread_time()
        data = encode(image)
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1000, data


def _faithful(data: bytes, image, parameters: str) -> tuple[bool, bool]:
    """(lossless, parameters kept) for encoded ``data`` of ``image``."""
    from PIL import Image

    from infra.storage.images import read_parameters

    with Image.open(io.BytesIO(data)) as decoded:
        lossless = decoded.convert("RGB").tobytes() == image.tobytes()
    try:
        kept = read_parameters(data) == parameters
    except Exception:
        kept = False
    return lossless, kept


def _encode_raw(args: tuple[bytes, int, int]) -> int:
    """Process-pool task: rebuild the image from raw RGB and encode it as the worker does."""
    from PIL import Image

    from infra.storage.images import encode_image

    raw, width, height = args
    return len(encode_image(Image.frombytes("RGB", (width, height), raw), "png", PARAMETERS)[0])


def _encode_image(image) -> int:
    from infra.storage.images import encode_image

    return len(encode_image(image, "png", PARAMETERS)[0])


def _pools(side: int, images: int, log) -> list[dict]:
    """images/s of the default PNG encoder on thread pools and process pools of 1..cores."""
    from pipeline.null import null_image

    batch = [null_image(side, side, i) for i in range(images)]
    raws = [(im.tobytes(), side, side) for im in batch]
    rows = []
    for workers in range(1, (os.cpu_count() or 1) + 1):
        for kind in ("threads", "processes"):
            pool: Executor = ThreadPoolExecutor(workers) if kind == "threads" else ProcessPoolExecutor(workers)
            with pool:
                list(pool.map(_encode_raw if kind == "processes" else _encode_image,
                              raws[:workers] if kind == "processes" else batch[:workers]))  # warm
                t0 = time.perf_counter()
                if kind == "processes":  # the image crosses as raw bytes, as a worker would send it
                    list(pool.map(_encode_raw, [(im.tobytes(), side, side) for im in batch]))
                else:
                    list(pool.map(_encode_image, batch))
                wall = time.perf_counter() - t0
            rows.append({"size": side, "kind": kind, "workers": workers, "images_per_s": images / wall})
            log(f"pool {side}² {kind} x{workers}: {images / wall:.1f} images/s")
    return rows


def run_encode_bench(config: EncodeBenchConfig, log=print) -> dict:
    """Time every encoder at every size, then the thread and process pools (see the module
    docstring). Returns ``{"rows": [{"size", "encoder", "ms", "bytes", "lossless",
    "parameters_kept"} | {"size", "encoder", "missing"}], "pools": [...], "cpu", "cores",
    "load_average"}``."""
    from bench.farm.s3_client import _cpu_model
    from bench.farm.workload import load_average
    from pipeline.null import null_image

    encoders = _encoders(PARAMETERS)
    rows: list[dict] = []
    for side in config.sizes:
        image = null_image(side, side, 7)
        for name, encode in encoders.items():
            if isinstance(encode, str):
                rows.append({"size": side, "encoder": name, "missing": encode})
                continue
            ms, data = _measure(encode, image, config.repeats)
            lossless, kept = _faithful(data, image, PARAMETERS)
            rows.append({"size": side, "encoder": name, "ms": ms, "bytes": len(data), "lossless": lossless,
                         "parameters_kept": kept})
            log(f"{side}² {name}: {ms:.1f} ms, {len(data)} B")
    pools = [row for side in config.sizes for row in _pools(side, config.pool_images, log)]
    return {"config": config.__dict__, "rows": rows, "pools": pools, "cpu": _cpu_model(), "cores": os.cpu_count(),
            "load_average": load_average()}


def encode_tables(result: dict) -> list:
    """Two rich tables: the encoders (ms/image, KiB, lossless, parameters kept) and the pools."""
    from rich.table import Table

    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    head = f"{result['cpu']}, {result['cores']} cores, load {load}"
    enc = Table(title=f"Encoders, CPU ms per image (median) — {head}")
    for col in ("size", "encoder", "ms/image", "KiB", "lossless", "parameters kept"):
        enc.add_column(col, justify="right")
    for r in result["rows"]:
        if "missing" in r:
            enc.add_row(f"{r['size']}²", r["encoder"], r["missing"], "", "", "")
        else:
            enc.add_row(f"{r['size']}²", r["encoder"], f"{r['ms']:.1f}", f"{r['bytes'] / 1024:.0f}",
                        "yes" if r["lossless"] else "no", "yes" if r["parameters_kept"] else "no")
    pools = Table(title=f"Default PNG encoder, images/s by pool — {head}")
    for col in ("size", "workers", "threads", "processes"):
        pools.add_column(col, justify="right")
    by = {(p["size"], p["workers"], p["kind"]): p["images_per_s"] for p in result["pools"]}
    for size, workers, kind in by:
        if kind == "threads":
            pools.add_row(f"{size}²", str(workers), f"{by[size, workers, 'threads']:.1f}",
                          f"{by.get((size, workers, 'processes'), 0):.1f}")
    return [enc, pools]
