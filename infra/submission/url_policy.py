"""Which URLs the farm may call on a client's behalf: the server-side request forgery (SSRF)
policy, for webhook URLs and input images fetched by URL.

Data flow: producer → ``POST /v1/batches`` with ``webhook_url`` → **checked here at submission**
(a refused URL is a 422 naming ``webhook_url`` and the reason) → stored on the batch → the
webhook sender checks it **again here at delivery time**, because a name can resolve to another
address by then (DNS rebinding). The sender should connect to one of the addresses this check
returned, not resolve the name a third time.

A URL passes when its scheme is ``http`` or ``https``, it names a host, and every address the
host resolves to is public: not loopback, link-local, private, shared (CGNAT), multicast,
reserved or unspecified, including IPv4 addresses embedded in IPv6 ones (``::ffff:10.0.0.1``,
6to4, Teredo, NAT64). ``allow_private=True`` (``RENDERFARM_WEBHOOK_ALLOW_PRIVATE``) lifts the
address rule, for farms whose receivers live on a private network; the scheme rule stays. Input
images fetched by URL (:mod:`infra.submission.input_refs`) pass the same check with their own switch,
``RENDERFARM_INPUT_ALLOW_PRIVATE``, named in the refusal.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: ``socket.getaddrinfo``-compatible resolver; tests pass a fake so no real DNS is done.
Resolver = Callable[..., list]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")


class WebhookRefused(ValueError):
    """The webhook URL is not allowed; ``reason`` says why in words a client can act on."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address carried inside an IPv4-mapped, 6to4, Teredo or NAT64 IPv6 address."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def address_problem(ip: IPAddress) -> str | None:
    """Why a webhook must not be sent to ``ip``, or None when the address is public.

    The reason names the first matching class: ``loopback``, ``unspecified``, ``link-local``,
    ``multicast``, ``reserved``, ``private`` (which includes documentation and benchmarking
    ranges) or ``not globally routable`` (e.g. 100.64.0.0/10).
    """
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_ipv4(ip)
        if inner is not None:
            problem = address_problem(inner)
            if problem is not None:
                return f"{problem} (IPv4 {inner} inside {ip})"
    for attribute, label in (("is_loopback", "loopback"), ("is_unspecified", "unspecified"),
                             ("is_link_local", "link-local"), ("is_multicast", "multicast"),
                             ("is_reserved", "reserved"), ("is_private", "private")):
        if getattr(ip, attribute):
            return label
    if not ip.is_global:
        return "not globally routable"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id ("fe80::1%eth0")
    except ValueError:
        return None


def resolve_host(host: str, port: int, resolver: Resolver = socket.getaddrinfo) -> list[IPAddress]:
    """Every address ``host`` resolves to (IP literals resolve to themselves), without duplicates.

    Raises:
        WebhookRefused: the name does not resolve.
    """
    literal = _literal(host)
    if literal is not None:
        return [literal]
    try:
        infos = resolver(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError) as exc:
        raise WebhookRefused(f"host {host!r} does not resolve ({exc.__class__.__name__})") from None
    addresses: list[IPAddress] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = _literal(str(sockaddr[0]))
        if ip is not None and ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise WebhookRefused(f"host {host!r} does not resolve to any address")
    return addresses


def check_webhook_url(url: str, *, allow_private: bool = False, resolver: Resolver = socket.getaddrinfo,
                      switch: str = "RENDERFARM_WEBHOOK_ALLOW_PRIVATE") -> list[IPAddress]:
    """Check ``url`` against the policy; return the addresses it may be delivered to.

    Args:
        url: the webhook URL as the client sent it.
        allow_private: accept hosts that resolve to non-public addresses.
        resolver: ``socket.getaddrinfo`` or a stand-in with its signature (blocking DNS).
        switch: the setting that lifts the address rule, named in the refusal.
    Raises:
        WebhookRefused: naming the rule that failed: the scheme, a missing host or bad port,
            a name that does not resolve, or the first non-public address and its class.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise WebhookRefused(f"scheme must be http or https, got {scheme or 'none'!r}")
    host = parts.hostname
    if not host:
        raise WebhookRefused("the URL names no host")
    addresses = resolve_host(host, port or (443 if scheme == "https" else 80), resolver)
    if not allow_private:
        for ip in addresses:
            problem = address_problem(ip)
            if problem is not None:
                shown = "" if _literal(host) is not None else f" resolves to {ip}, which"
                raise WebhookRefused(f"host {host!r}{shown} is not a public address ({problem}); set "
                                     f"{switch}=true to allow it")
    return addresses
