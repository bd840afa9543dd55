"""Control maps: a control unit's image fitted to the render's size and preprocessed.

Place in the data flow: worker → pipeline: for a group with ControlNet units,
:func:`pipeline.controlnet.control_arguments` reads each unit's image (the worker's input loader:
the farm's bucket only) and makes its control map here, next to the render and inside its timing;
the maps go to the ControlNet pipeline and on to storage beside the image (``{job_id}.control-N.png``).

Fitting (:func:`fit`, sd-webui-controlnet's resize modes): ``resize`` stretches to width × height
(Lanczos), ``crop`` scales to cover and crops the centre (``PIL.ImageOps.fit``), ``fill`` scales to
fit inside and pads with black (``PIL.ImageOps.pad``; black is "no edge" in an edge map).

Preprocessors: ``none`` (the image is the map, as RGB) and ``canny``: OpenCV's ``cv2.Canny`` on
the grayscale image with the unit's hysteresis thresholds (J. Canny, "A Computational Approach to
Edge Detection", IEEE PAMI 1986; OpenCV's imgproc documentation, "Canny Edge Detector"), the
one-channel edge map (0 or 255) repeated to RGB, as the ControlNet canny models were trained on
(lllyasviel's ControlNet model cards).
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import PIL.ImageOps

from infra.controls import ControlUnit

_LANCZOS = PIL.Image.Resampling.LANCZOS


def fit(image: PIL.Image.Image, size: tuple[int, int], mode: str) -> PIL.Image.Image:
    """``image`` as RGB at ``size`` = (width, height) pixels, fitted by ``mode`` (``resize``,
    ``crop`` or ``fill``; see the module docstring).

    Raises:
        ValueError: an unknown mode.
    """
    rgb = image.convert("RGB")
    if mode == "resize":
        return rgb.resize(size, _LANCZOS)
    if mode == "crop":
        return PIL.ImageOps.fit(rgb, size, _LANCZOS)
    if mode == "fill":
        return PIL.ImageOps.pad(rgb, size, _LANCZOS, color=(0, 0, 0))
    raise ValueError(f"unknown resize mode {mode!r}; known: resize, crop, fill")


def canny(image: PIL.Image.Image, low: int, high: int) -> PIL.Image.Image:
    """The Canny edge map of ``image`` (any mode; converted to 8-bit grayscale), thresholds ``low``
    ≤ ``high`` in 0…255: an RGB image of the same size, 255 on edges and 0 elsewhere."""
    import cv2

    gray = np.asarray(image.convert("L"), dtype=np.uint8)
    edges = cv2.Canny(gray, int(low), int(high))
    return PIL.Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2))


def control_map(unit: ControlUnit, image: PIL.Image.Image, width: int, height: int) -> PIL.Image.Image:
    """The control map of ``unit`` for a render of ``width`` × ``height`` pixels: its ``image``
    fitted (:func:`fit`) and preprocessed (``none`` or ``canny``), RGB, width × height.

    Raises:
        ValueError: an unknown preprocessor (the request schema admits none).
    """
    fitted = fit(image, (width, height), unit.resize)
    if unit.preprocess == "none":
        return fitted
    if unit.preprocess == "canny":
        return canny(fitted, *unit.canny_thresholds)
    raise ValueError(f"unknown preprocessor {unit.preprocess!r}")
