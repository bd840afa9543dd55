"""A real HTTPS server on loopback for the tests that fetch image inputs by URL: a folder served by
the standard library's ``http.server`` behind TLS, with a self-signed certificate made by
``openssl`` for ``IP:127.0.0.1``. Its place in the data flow is the internet's: producer (a
catalog run) or status API (an ``init_image`` URL) → **here** → the fetched bytes go on to S3.

A client trusts the certificate the honest way, through a CA bundle naming it (``SSL_CERT_FILE``,
which httpx reads when it builds its TLS context); nothing turns verification off.
"""

from __future__ import annotations

import http.server
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HttpsSite:
    """A served ``folder``, its base ``url`` (``https://127.0.0.1:<port>``) and ``cert``, the PEM
    file of its self-signed certificate (a CA bundle of one for ``SSL_CERT_FILE``)."""

    folder: Path
    url: str
    cert: Path


@contextmanager
def https_site(workdir: Path) -> Iterator[HttpsSite]:
    """Serve ``workdir/served`` over HTTPS on 127.0.0.1 (a free port) until the block ends.

    Args:
        workdir: an empty directory for the served folder, the certificate and its key.
    Raises:
        subprocess.CalledProcessError: openssl could not make the certificate.
    """
    served = workdir / "served"
    served.mkdir()
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(served), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield HttpsSite(served, f"https://127.0.0.1:{server.server_address[1]}", cert)
    finally:
        server.shutdown()
        server.server_close()
