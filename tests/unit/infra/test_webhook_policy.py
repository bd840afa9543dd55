"""The webhook SSRF policy (infra/webhooks_policy.py): pure checks with IP literals and a fake
resolver (no real DNS except "localhost"), and the 422 the API answers at submission."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from infra.submission.url_policy import WebhookRefused, address_problem, check_webhook_url

REFUSED_ADDRESSES = {
    "127.0.0.1": "loopback", "127.5.5.5": "loopback", "::1": "loopback",
    "0.0.0.0": "unspecified", "::": "unspecified",
    "169.254.169.254": "link-local", "fe80::1": "link-local",
    "224.0.0.1": "multicast", "ff02::1": "multicast", "239.1.2.3": "multicast",
    "10.0.0.1": "private", "172.16.5.4": "private", "192.168.1.1": "private", "fc00::1": "private",
    "fd00:ec2::254": "private", "192.0.0.1": "private", "198.18.0.1": "private", "2001:db8::1": "private",
    "240.0.0.1": "reserved", "255.255.255.255": "reserved",
    "100.64.0.1": "not globally routable",
    "::ffff:127.0.0.1": "loopback", "::ffff:10.1.2.3": "private",
    "2002:a00:1::": "private",           # 6to4 of 10.0.0.1
    "64:ff9b::a9fe:a9fe": "link-local",  # NAT64 of 169.254.169.254
}
PUBLIC_ADDRESSES = ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "1.1.1.1"]


@pytest.mark.parametrize("address,label", sorted(REFUSED_ADDRESSES.items()))
def test_non_public_addresses_are_named(address, label):
    assert address_problem(ipaddress.ip_address(address)).startswith(label)


@pytest.mark.parametrize("address", PUBLIC_ADDRESSES)
def test_public_addresses_pass(address):
    assert address_problem(ipaddress.ip_address(address)) is None


def _fake_dns(table: dict[str, list[str]]):
    def resolve(host, port, type=0, **_):
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port))
                for a in table[host]]
    return resolve


@pytest.mark.parametrize("url", ["http://93.184.216.34/hook", "https://[2606:4700:4700::1111]:8443/x?y=1",
                                 "HTTPS://93.184.216.34"])
def test_public_ip_literals_pass(url):
    assert check_webhook_url(url, resolver=_fake_dns({}))


@pytest.mark.parametrize("url,needle", [
    ("http://127.0.0.1:8000/hook", "loopback"),
    ("http://[::1]/hook", "loopback"),
    ("http://169.254.169.254/latest/meta-data", "link-local"),
    ("http://10.0.0.5/hook", "private"),
    ("http://[::ffff:192.168.0.1]/", "private"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://2130706433/", "loopback"),  # 127.0.0.1 as one number, parsed by the resolver
    ("ftp://93.184.216.34/hook", "scheme must be http or https"),
    ("file:///etc/passwd", "scheme must be http or https"),
    ("gopher://93.184.216.34:70/_", "scheme must be http or https"),
    ("//93.184.216.34/hook", "scheme must be http or https"),
    ("http:///nohost", "names no host"),
    ("http://93.184.216.34:99999/", "not a valid URL"),
    ("http://no-such-host.invalid/", "does not resolve"),
])
def test_refused_urls_name_the_reason(url, needle):
    with pytest.raises(WebhookRefused, match=needle):
        check_webhook_url(url, resolver=_fake_dns({"2130706433": ["127.0.0.1"]}))


def test_every_resolved_address_must_be_public():
    dns = _fake_dns({"mixed.example": ["93.184.216.34", "10.0.0.7"], "public.example": ["93.184.216.34"]})
    with pytest.raises(WebhookRefused, match=r"'mixed.example' resolves to 10.0.0.7, which is not a public"):
        check_webhook_url("https://mixed.example/hook", resolver=dns)
    assert check_webhook_url("https://public.example/hook", resolver=dns) == [ipaddress.ip_address("93.184.216.34")]


def test_localhost_by_name_is_refused_with_the_real_resolver():
    with pytest.raises(WebhookRefused, match="loopback"):
        check_webhook_url("http://localhost:9000/hook")


def test_allow_private_lifts_the_address_rule_only():
    for url in ("http://127.0.0.1/hook", "http://localhost/hook", "http://10.0.0.1/", "http://169.254.169.254/"):
        assert check_webhook_url(url, allow_private=True)
    with pytest.raises(WebhookRefused, match="scheme"):
        check_webhook_url("file:///etc/passwd", allow_private=True)


# -- at submission ------------------------------------------------------------------------
