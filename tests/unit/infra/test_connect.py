"""Redis URLs: one Redis, a Sentinel group, a Cluster; what the farm's clients and Celery get.
Parsing only; the Sentinel group itself runs in tests/faults/test_sentinel.py."""

from __future__ import annotations

import ssl

import pytest
from celery import Celery

from infra.broker.app import make_celery
from infra.settings import Settings
from infra.state.connect import SentinelGroup, celery_broker, is_sentinel_url, redis_client


def test_a_sentinel_url_names_its_sentinels_master_database_and_passwords():
    group = SentinelGroup.parse("sentinel://user:p%40ss@10.0.0.1:26380,sentinel-b,[::1]:26381/farm/3"
                                "?sentinel_password=s3cret")
    assert group.sentinels == (("10.0.0.1", 26380), ("sentinel-b", 26379), ("::1", 26381))
    assert (group.master_name, group.db, group.username, group.password) == ("farm", 3, "user", "p@ss")
    assert group.sentinel_password == "s3cret" and group.tls is False
    assert SentinelGroup.parse("sentinels://h/farm").tls is True
    assert SentinelGroup.parse("sentinel://:pw@h/farm").username is None


@pytest.mark.parametrize("url, message", [
    ("sentinel:///farm", "at least one sentinel"),
    ("sentinel://h:26379", "/master_name"),
    ("sentinel://h/farm/x", "database"),
    ("sentinel://h:port/farm", "port is a number"),
    ("sentinel://h/farm?master=x", "unknown Sentinel URL parameter"),
    ("redis://h/0", "not a Sentinel URL"),
])
def test_a_malformed_sentinel_url_is_refused_with_what_is_wrong(url, message):
    with pytest.raises(ValueError, match=message):
        SentinelGroup.parse(url)


def test_celery_gets_kombus_sentinel_form_and_the_master_name():
    broker = celery_broker("sentinel://:pw@a:26379,b:26380/farm/2?sentinel_password=sp")
    assert broker.url == "sentinel://:pw@a:26379/2;sentinel://:pw@b:26380/2"
    assert broker.transport_options == {"master_name": "farm", "sentinel_kwargs": {"password": "sp"}}
    assert broker.use_ssl is None
    assert celery_broker("sentinels://a/farm").use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert celery_broker("redis://h:6379/0") == ("redis://h:6379/0", {}, None)
    with pytest.raises(ValueError, match="cannot be a Redis Cluster"):
        celery_broker("redis+cluster://h:7000")


def test_the_celery_app_keeps_the_farms_transport_options_beside_sentinels():
    app: Celery = make_celery(Settings(redis_url="sentinel://a:26379,b:26379/farm/1"))
    options = app.conf.broker_transport_options
    assert options["master_name"] == "farm" and options["visibility_timeout"] == 12 * 3600
    assert app.conf.broker_url == "sentinel://a:26379/1;sentinel://b:26379/1"


def test_a_sentinel_client_asks_the_sentinels_for_its_primary():
    assert is_sentinel_url("SENTINEL://h/farm") and not is_sentinel_url("redis://h")
    client = redis_client("sentinel://:pw@127.0.0.1:1,127.0.0.1:2/farm/4")
    pool = client.connection_pool
    assert pool.service_name == "farm" and pool.connection_kwargs["db"] == 4
    assert pool.connection_kwargs["password"] == "pw" and pool.connection_kwargs["decode_responses"] is True
    assert [(c.connection_pool.connection_kwargs["port"]) for c in pool.sentinel_manager.sentinels] == [1, 2]
