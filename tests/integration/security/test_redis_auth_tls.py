"""Redis URLs with a password (``redis://:pw@host``) and with TLS (``rediss://``) work for every
client of the farm: the job-state store, the Celery broker (kombu) and the status API.

TLS runs against a redis-server started with ``--tls-port`` and a certificate made here by
``openssl`` (a throw-away CA signing a server certificate for 127.0.0.1). The URL form that both
redis-py and kombu accept is ``rediss://host:port/0?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem``
(lowercase ``required|optional|none``; redis-py refuses ``CERT_REQUIRED``).
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import redis

from infra import keys
from infra.broker.app import make_celery
from infra.broker.publish import publish_jobs
from infra.localstack import LOCALHOST, ApiServer, ProcessExited, RedisServer, free_port, redis_answers
from infra.schemas import RenderRequest
from infra.settings import Settings
from infra.state.job_store import JobStore, NewJob

pytestmark = pytest.mark.integration


def _round_trip(url: str) -> None:
    """A job recorded and read back through the store, and one Celery message published and
    consumed through kombu, all on the Redis at ``url``."""
    store = JobStore.from_url(url)
    job_id = secrets.token_hex(8)
    store.create_batch(f"b{job_id}", [NewJob(job_id, RenderRequest(prompt="p", seed=1), "secure-pool")])
    assert store.get_job(job_id).state == "queued"
    app = make_celery(Settings(redis_url=url))
    try:
        assert publish_jobs(app, [(job_id, "secure-pool")]) == 1
        with app.connection_for_read() as conn:
            queue = conn.SimpleQueue("renderfarm.secure-pool")
            message = queue.get(timeout=5)
            assert message.headers["task"] == "renderfarm.render" and message.payload[1] == {"job_id": job_id}
            message.ack()
            queue.close()
    finally:
        app.close()


@pytest.fixture(scope="module")
def password_redis(run_dir, tmp_path_factory):
    password = secrets.token_urlsafe(18)
    server = RedisServer(free_port(), password=password, dir=tmp_path_factory.mktemp("redis-pw"), run_dir=run_dir,
                         name="redis-password")
    with server:
        yield server


def test_password_redis_refuses_without_the_password(password_redis):
    assert not redis_answers(f"redis://{LOCALHOST}:{password_redis.port}/0")
    assert not redis_answers(f"redis://:wrong@{LOCALHOST}:{password_redis.port}/0")
    assert redis_answers(password_redis.url)
    assert password_redis.password not in password_redis.log_path.read_text()  # not on the command line


def test_store_and_broker_work_with_a_password(password_redis):
    _round_trip(password_redis.url)


def test_api_works_with_a_password_redis(password_redis, farm_env, run_dir):
    env = {**farm_env, "RENDERFARM_REDIS_URL": password_redis.url, "RENDERFARM_DEFAULT_MODEL": "secure-none"}
    with ApiServer(free_port(), env, name="api-redis-password", run_dir=run_dir) as api:
        accepted = httpx.post(api.url + "/v1/jobs", json={"prompt": "a locked door"})
        assert accepted.status_code == 202
        assert httpx.get(f"{api.url}/v1/jobs/{accepted.json()['job_id']}").json()["state"] == "queued"
        assert password_redis.client().hget(keys.job(accepted.json()['job_id']), "state") == "queued"
        assert password_redis.password not in repr(password_redis)
        assert password_redis.password not in api.log_path.read_text()


# -- TLS ------------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=renderfarm-test-ca", cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.crt", "-days", "2", "-extfile", "san.cnf", cwd=d)
    return d


class TlsRedisServer(RedisServer):
    """redis-server listening only with TLS on ``port`` (plain port off)."""

    def __init__(self, port: int, tls: Path, **kwargs):
        self.tls = tls
        super().__init__(port, extra_args=[
            "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(tls / "server.crt"),
            "--tls-key-file", str(tls / "server.key"), "--tls-ca-cert-file", str(tls / "ca.crt"),
            "--tls-auth-clients", "no"], **kwargs)

    @property
    def url(self) -> str:
        return (f"rediss://{LOCALHOST}:{self.port}/0?ssl_cert_reqs=required"
                f"&ssl_ca_certs={quote(str(self.tls / 'ca.crt'), safe='/')}")

    def client(self, db: int = 0):
        return redis.Redis.from_url(self.url, decode_responses=True)


@pytest.fixture(scope="module")
def tls_redis(tls_files, run_dir, tmp_path_factory):
    server = TlsRedisServer(free_port(), tls_files, dir=tmp_path_factory.mktemp("redis-tls"), run_dir=run_dir,
                            name="redis-tls")
    try:
        server.start()
        server.wait_ready(timeout=30)
    except ProcessExited as exc:
        server.stop()
        if "tls" in str(exc).lower():
            pytest.skip(f"redis-server is built without TLS: {str(exc)[-200:]}")
        raise
    yield server
    server.stop()


def test_store_and_broker_work_over_tls(tls_redis):
    _round_trip(tls_redis.url)


def test_tls_verifies_the_server_certificate(tls_redis, tls_files, tmp_path):
    plain = redis.Redis(host=LOCALHOST, port=tls_redis.port, socket_timeout=2, socket_connect_timeout=2)
    with pytest.raises(redis.RedisError):
        plain.ping()  # a plain connection to the TLS port fails
    untrusted = f"rediss://{LOCALHOST}:{tls_redis.port}/0?ssl_cert_reqs=required"
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        redis.Redis.from_url(untrusted, socket_timeout=2).ping()  # system CAs do not know our CA
    unverified = f"rediss://{LOCALHOST}:{tls_redis.port}/0?ssl_cert_reqs=none"
    assert redis.Redis.from_url(unverified, socket_timeout=2).ping()
