"""Input image checks without a server: Pillow's own decompression-bomb limit, the farm's, formats,
truncated files; URL fetching under the SSRF policy, redirects included (an httpx transport
stands in for the internet, which this machine cannot reach; DNS is a fake resolver)."""

from __future__ import annotations

import io
import socket

import httpx
import pytest
from PIL import Image

from infra.storage.input_images import InputRefused, inspect_image
from infra.submission.input_refs import MAX_REDIRECTS, fetch_url


def _png(size=(64, 48), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, "PNG")
    return buf.getvalue()


def test_a_good_image_is_keyed_by_its_hash():
    data = _png()
    image = inspect_image(data, max_bytes=10**6, max_pixels=10**6)
    assert (image.width, image.height, image.format) == (64, 48, "PNG")
    assert image.key == f"inputs/{image.sha256}.png" and image.bytes == len(data)


def test_pillows_max_image_pixels_applies_below_the_farms_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow's guard, lowered for a small file
    with pytest.raises(InputRefused, match="decompression-bomb") as refused:
        inspect_image(_png((64, 48)), max_bytes=10**6, max_pixels=10**9)
    assert refused.value.status == 422


@pytest.mark.parametrize(("data", "status", "words"), [
    (_png((2000, 1000), "1"), 422, "over the limit of 1,000,000 pixels"),
    (_png()[:60], 422, "does not decode"),
    (b"GIF89a" + b"\0" * 64, 422, "not an image"),
    (_png(), 413, "over the limit"),
])
def test_refusals(data, status, words):
    with pytest.raises(InputRefused, match=words) as refused:
        inspect_image(data, max_bytes=len(data) - 1 if status == 413 else 10**6, max_pixels=10**6)
    assert refused.value.status == status


def _resolver(table):
    def resolve(host, port, type=0):  # getaddrinfo's shape
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]
    return resolve


PUBLIC = {"photos.example": "93.184.216.34", "cdn.example": "93.184.216.35", "evil.example": "10.0.0.7"}


def _client(routes) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        status, headers, body = routes[str(request.url)]
        return httpx.Response(status, headers=headers, content=body)
    return httpx.Client(transport=httpx.MockTransport(handle))


def test_a_redirect_to_a_private_address_is_refused():
    client = _client({"https://photos.example/p.png": (302, {"location": "https://evil.example/p.png"}, b""),
                      "https://evil.example/p.png": (200, {}, _png())})
    with pytest.raises(InputRefused, match="10.0.0.7, which is not a public address"):
        fetch_url("https://photos.example/p.png", max_bytes=10**6, client=client, resolver=_resolver(PUBLIC))


def test_redirects_to_public_hosts_are_followed_and_bounded():
    data = _png()
    client = _client({"https://photos.example/p.png": (301, {"location": "https://cdn.example/p.png"}, b""),
                      "https://cdn.example/p.png": (200, {}, data)})
    assert fetch_url("https://photos.example/p.png", max_bytes=10**6, client=client,
                     resolver=_resolver(PUBLIC)) == data
    loop = _client({"https://photos.example/p.png": (302, {"location": "/p.png"}, b"")})
    with pytest.raises(InputRefused, match=f"more than {MAX_REDIRECTS} redirects"):
        fetch_url("https://photos.example/p.png", max_bytes=10**6, client=loop, resolver=_resolver(PUBLIC))
    downgrade = _client({"https://photos.example/p.png": (302, {"location": "http://cdn.example/p.png"}, b"")})
    with pytest.raises(InputRefused, match="must be https"):
        fetch_url("https://photos.example/p.png", max_bytes=10**6, client=downgrade, resolver=_resolver(PUBLIC))


def test_a_body_over_the_limit_is_a_413():
    client = _client({"https://photos.example/p.png": (200, {}, b"x" * 5000)})
    with pytest.raises(InputRefused) as refused:
        fetch_url("https://photos.example/p.png", max_bytes=4096, client=client, resolver=_resolver(PUBLIC))
    assert refused.value.status == 413
