"""Image references as requests carry them: an object key in the farm's bucket or an ``https`` URL.

Place in the data flow: producer → request validation (:mod:`infra.schemas`: ``init_image``,
``mask_image``; :mod:`infra.controls`: each control unit's ``image``) → submission, which fetches
URLs once and replaces them by keys (:mod:`infra.submission.input_refs`) → the worker reads keys
from the bucket only. One rule for every image field, so a control image is referenced exactly as
an init image is.
"""

from __future__ import annotations

import re

#: Where uploaded and fetched input images live in the farm's bucket: ``inputs/<sha256>.<ext>``.
INPUT_KEY_PREFIX = "inputs/"
#: An image reference: an object key in the farm's bucket, or an ``https`` URL the API fetches once.
IMAGE_REF_RE = re.compile(r"(?:https://\S{1,2000}|[A-Za-z0-9][A-Za-z0-9._/-]{0,1023})")


def is_url(ref: str) -> bool:
    """Whether an image reference is a URL (the API fetches it) rather than an object key."""
    return ref.startswith("https://")


def check_image_ref(value: str, field: str) -> str:
    """``value`` when it is an image reference (an object key of letters, digits, ``.``, ``_``,
    ``-``, ``/`` without a ``..`` segment, or an https URL).

    Raises:
        ValueError: naming ``field`` and the value's first 80 characters.
    """
    if not IMAGE_REF_RE.fullmatch(value) or ".." in value.split("/"):
        raise ValueError(f"{field} must be an object key in the farm's bucket (letters, digits, "
                         f"'.', '_', '-', '/') or an https:// URL, got {value[:80]!r}")
    return value
