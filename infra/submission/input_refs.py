"""Input images at submission: URLs fetched once (SSRF policy), keys checked, mask sizes compared.

Place in the data flow: producer → route → submission (:class:`infra.submission.submitter.Submitter`)
→ **here**, its first step (before routing and recording).
A request's ``init_image`` / ``mask_image`` and each control unit's ``image`` leave here as object
keys in the farm's bucket, so the job record and the worker never see a URL:

- an ``https`` URL is fetched by the submitting process (the API), once per submission, under
  the SSRF policy of webhooks
  (:mod:`infra.submission.url_policy`: every address the host resolves to must be public, unless
  ``RENDERFARM_INPUT_ALLOW_PRIVATE``; each redirect's target is checked again, at most
  :data:`MAX_REDIRECTS`; the TLS certificate is verified against the CA bundle, certifi's or the
  one ``SSL_CERT_FILE`` names), at most
  ``RENDERFARM_INPUT_MAX_BYTES`` bytes, then checked and stored by content hash
  (:func:`infra.storage.input_images.store_input`);
- an object key must name an image in the bucket (a HEAD; its size from the upload's metadata);
- a mask must have its init image's size.

Residual risk, as for webhooks: between the policy's DNS lookup and the HTTP client's own, a name
may resolve elsewhere (DNS rebinding); the body limit and the https-only rule bound what such a
fetch can read, and the bytes must still decode as an image.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import httpx

from infra.schemas import RenderRequest, is_url
from infra.storage.input_images import InputRefused, input_size, store_input
from infra.storage.s3 import Storage
from infra.submission.url_policy import Resolver, WebhookRefused, check_webhook_url

MAX_REDIRECTS = 3
FETCH_TIMEOUT_S = 20.0
IMAGE_FIELDS = ("init_image", "mask_image")


class InputError(ValueError):
    """A request's input image was refused: the ``status`` an HTTP answer carries (413 too many
    bytes, 415 an unsupported format, 422 anything else), the request's ``index`` in its
    submission, the ``field`` and the ``reason``."""

    def __init__(self, status: int, index: int, field: str, reason: str):
        super().__init__(f"job {index}: {field}: {reason}")
        self.status, self.index, self.field, self.reason = status, index, field, reason


def fetch_url(url: str, *, max_bytes: int, allow_private: bool = False, client: httpx.Client | None = None,
              resolver: Resolver = socket.getaddrinfo) -> bytes:
    """The body of an ``https`` URL, following at most :data:`MAX_REDIRECTS` redirects, each
    target checked against the SSRF policy before it is requested.

    Args:
        url: an https URL. max_bytes: most body bytes read. allow_private: lift the address rule
            (``RENDERFARM_INPUT_ALLOW_PRIVATE``). client: the HTTP client (tests give one with
            a transport standing in for the internet). resolver: ``socket.getaddrinfo`` or a stand-in.
    Raises:
        InputRefused: 422 for a refused address or scheme, too many redirects, a non-2xx answer or
            a failed connection; 413 for a body over ``max_bytes``.
    """
    own = client is None
    http = client or httpx.Client(timeout=FETCH_TIMEOUT_S, follow_redirects=False)
    try:
        for _hop in range(MAX_REDIRECTS + 1):
            if not url.startswith("https://"):
                raise InputRefused(422, f"input URLs must be https, got {url[:80]!r}")
            try:
                check_webhook_url(url, allow_private=allow_private, resolver=resolver,
                                  switch="RENDERFARM_INPUT_ALLOW_PRIVATE")
            except WebhookRefused as exc:
                raise InputRefused(422, f"URL refused: {exc.reason}") from None
            try:
                with http.stream("GET", url) as response:
                    if response.is_redirect:
                        url = str(response.url.join(response.headers.get("location", "")))
                        continue
                    if response.status_code // 100 != 2:
                        raise InputRefused(422, f"fetching the image answered HTTP {response.status_code}")
                    body = bytearray()
                    for chunk in response.iter_bytes():
                        body += chunk
                        if len(body) > max_bytes:
                            raise InputRefused(413, f"the image at the URL is over the limit of {max_bytes:,} bytes")
                    return bytes(body)
            except httpx.HTTPError as exc:
                raise InputRefused(422, f"fetching the image failed ({type(exc).__name__})") from None
        raise InputRefused(422, f"more than {MAX_REDIRECTS} redirects")
    finally:
        if own:
            http.close()


class InputResolver:
    """Turns every input reference of a submission into a checked object key.

    Args:
        storage: the farm's bucket. max_bytes, max_pixels: the input limits
            (``RENDERFARM_INPUT_MAX_BYTES``, ``RENDERFARM_INPUT_MAX_PIXELS``). allow_private: the
            SSRF policy's switch (``RENDERFARM_INPUT_ALLOW_PRIVATE``). client, resolver: see
            :func:`fetch_url`.
    """

    def __init__(self, storage: Storage, *, max_bytes: int, max_pixels: int, allow_private: bool = False,
                 client: httpx.Client | None = None, resolver: Resolver = socket.getaddrinfo):
        self.storage = storage
        self.max_bytes, self.max_pixels = max_bytes, max_pixels
        self.allow_private = allow_private
        self.client, self.resolver = client, resolver

    def resolve(self, requests: Sequence[RenderRequest]) -> list[RenderRequest]:
        """``requests`` with URLs replaced by keys, in order; requests without inputs unchanged.
        The same URL or key is fetched or checked once per call.

        Raises:
            InputError: the first refused input (413, 415 or 422), naming its job and field.
        """
        keys: dict[str, tuple[str, tuple[int, int] | None]] = {}
        out = []
        for index, request in enumerate(requests):
            if request.init_image is None and not request.controls:
                out.append(request)
                continue
            updates: dict[str, Any] = {}
            sizes = {}
            for field in IMAGE_FIELDS:
                ref = getattr(request, field)
                if ref is None:
                    continue
                key, sizes[field] = self._checked(ref, keys, index, field)
                if key != ref:
                    updates[field] = key
            if "mask_image" in sizes and sizes["mask_image"] != sizes["init_image"]:
                (mw, mh), (iw, ih) = sizes["mask_image"], sizes["init_image"]
                raise InputError(422, index, "mask_image", f"the mask is {mw}×{mh} pixels but the init image "
                                                           f"is {iw}×{ih}; they must be the same size")
            units = [unit.model_copy(update={"image": self._checked(unit.image, keys, index,
                                                                    f"controls.{n}.image")[0]})
                     for n, unit in enumerate(request.controls)]
            if units != request.controls:
                updates["controls"] = units
            out.append(request.model_copy(update=updates) if updates else request)
        return out

    def _checked(self, ref: str, keys: dict[str, tuple[str, tuple[int, int] | None]], index: int,
                 field: str) -> tuple[str, tuple[int, int]]:
        """The object key and size (pixels) of image reference ``ref`` of job ``index``'s
        ``field``, fetched or checked once per submission (``keys`` remembers them).

        Raises:
            InputError: the image is refused, or no such object is in the bucket.
        """
        if ref not in keys:
            try:
                keys[ref] = self._key_and_size(ref)
            except InputRefused as exc:
                raise InputError(exc.status, index, field, exc.reason) from None
        key, size = keys[ref]
        if size is None:
            raise InputError(422, index, field, f"no image {ref!r} in the bucket (upload it with "
                                                "POST /v1/uploads, or send an https URL)")
        return key, size

    def _key_and_size(self, ref: str) -> tuple[str, tuple[int, int] | None]:
        if is_url(ref):
            data = fetch_url(ref, max_bytes=self.max_bytes, allow_private=self.allow_private, client=self.client,
                             resolver=self.resolver)
            image = store_input(self.storage, data, max_bytes=self.max_bytes, max_pixels=self.max_pixels)
            return image.key, (image.width, image.height)
        return ref, input_size(self.storage, ref)
