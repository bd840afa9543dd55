"""The chart's bundled Redis run as its pod would run it, by the host's ``redis-server``: the
settings that keep the broker and job state safe (``requirepass``, protected mode, the AOF,
``maxmemory`` with ``noeviction``) are checked on a running server, not as rendered text.

From ``helm template`` with the chart's defaults: the StatefulSet's container command and its
environment resolved by Kubernetes' rules (``REDIS_PASSWORD`` from the chart's Secret,
``$(VAR)`` expanded: :class:`tests.deploy.pod_runner.Manifests`), the ConfigMap's ``redis.conf``
written where its volume is mounted. Adjusted for the host, and nothing else:

* the mount paths: ``/etc/redis`` (the ConfigMap) and ``/data`` (the PersistentVolumeClaim) are
  directories under the test's tmp dir, so the argv's ``/etc/redis/redis.conf`` and the
  config's one line ``dir /data`` name those (Redis changes into ``dir`` while it reads the
  config and stops if it cannot);
* ``--port <free port> --bind 127.0.0.1`` appended to the argv: in the pod Redis has its own
  network namespace and 6379; here 6379 is the machine's Redis and the server must listen on
  loopback only.

The image runs Redis 7.4 (``redis.bundled.image.tag``); the host's is Debian's (7.0 here), which
reads every directive of the rendered config. Place in the data flow: beside it (the queue's and
the job records' store as deployed).
"""

from __future__ import annotations

import base64
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from infra.localstack import ManagedProcess, free_port
from tests.deploy.conftest import ROOT, by_kind
from tests.deploy.pod_runner import Manifests

pytestmark = pytest.mark.integration

NAMESPACE = "render"
DOCUMENTED = (ROOT / "docs" / "operations" / "security.md", ROOT / "deploy" / "README.md")
#: Redis's memory units (redis.conf's header: 1k = 1000 bytes, 1kb = 1024 bytes, …)
UNITS = {"": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9, "gb": 2**30}


@dataclass
class ChartRedis:
    """The running server and what the chart gave it.

    ``password``: the chart's Secret's ``redis-password``; ``env``: the container's environment;
    ``pod_argv``: the argv the pod runs (before the host's adjustments); ``adjusted``: the
    ``redis.conf`` lines changed for the host (rendered, run); ``data_dir``: the data volume.
    """

    process: ManagedProcess
    port: int
    password: str
    env: dict[str, str] = field(repr=False)
    pod_argv: list[str]
    adjusted: list[tuple[str, str]]
    data_dir: Path
    docs: list[dict] = field(repr=False)

    def client(self, password: str | None = None) -> redis.Redis:
        """A client of the server, authenticating with ``password`` (none when None)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=password, decode_responses=True,
                           socket_timeout=10)


def _reply(port: int, *command: str) -> str:
    """The first line of Redis's reply to ``command`` on a fresh connection, as sent on the wire
    (RESP: ``+PONG``, ``-NOAUTH …``), with no client library's handshake before it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"*{len(command)}\r\n".encode() + b"".join(f"${len(c)}\r\n{c}\r\n".encode() for c in command))
        return sock.makefile("rb").readline().decode().rstrip("\r\n")


def _answers(port: int) -> bool:
    """Whether a Redis listens on ``port``: PONG, or NOAUTH from one that wants a password."""
    return _reply(port, "PING") in ("+PONG", "-NOAUTH Authentication required.")


@pytest.fixture(scope="module")
def chart_redis(render, tmp_path_factory) -> Iterator[ChartRedis]:
    """The default chart's Redis pod run here (see the module docstring), ready; stopped with
    SIGTERM at the module's end."""
    docs = render("default")
    sts = next(s for s in by_kind(docs, "StatefulSet") if s["metadata"]["name"].endswith("-redis"))
    spec, meta = sts["spec"]["template"]["spec"], sts["spec"]["template"].get("metadata") or {}
    (container,) = spec["containers"]
    manifests = Manifests(docs, NAMESPACE)
    env = manifests.environment(container, f"{sts['metadata']['name']}-0", spec, meta)
    command, args = manifests.argv(container, env)
    root = tmp_path_factory.mktemp("chart-redis")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        folder = root / mount["name"]
        if "emptyDir" not in volumes.get(mount["name"], {"emptyDir": {}}):
            manifests.volume_files(volumes[mount["name"]], folder)
        else:  # an emptyDir, or the StatefulSet's volumeClaimTemplate: an empty volume
            folder.mkdir()
        mounts[mount["mountPath"]] = folder
    pattern = re.compile("|".join(rf"(?<![\w/]){re.escape(p)}(?=/|\s|$)" for p in mounts))

    def on_host(text: str) -> str:
        return pattern.sub(lambda m: str(mounts[m.group(0)]), text)

    conf_path = mounts["/etc/redis"] / "redis.conf"
    lines = [(line, on_host(line)) for line in conf_path.read_text().splitlines()]
    conf_path.write_text("".join(f"{run}\n" for _, run in lines))
    port = free_port()
    argv = [on_host(a) for a in command + args] + ["--port", str(port), "--bind", "127.0.0.1"]
    secret = next(s for s in by_kind(docs, "Secret") if s["metadata"]["labels"].get("app.kubernetes.io/component")
                  == "redis")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    process = ManagedProcess("chart-redis", argv, env=env, ready=lambda: _answers(port), run_dir=root,
                             stop_timeout=float(spec["terminationGracePeriodSeconds"]), ready_timeout=30)
    with process:
        yield ChartRedis(process, port, password, env, command + args, [(r, h) for r, h in lines if r != h],
                         mounts["/data"], docs)


def test_only_the_mount_paths_were_adjusted(chart_redis):
    """What the host changed in the rendered config, and that the argv is the pod's, expanded:
    a shell that writes the config with the password into the in-memory volume and runs
    redis-server on it; the password is in no argument (``ps`` shows every process's argv)."""
    assert chart_redis.adjusted == [("dir /data", f"dir {chart_redis.data_dir}")]
    assert chart_redis.pod_argv[:2] == ["sh", "-c"] and chart_redis.pod_argv[3:] == ["redis-server"]
    assert "exec redis-server /run/redis/redis.conf" in chart_redis.pod_argv[2]
    assert not any(chart_redis.password in arg for arg in chart_redis.pod_argv)
    with open(f"/proc/{chart_redis.process.pid}/cmdline", "rb") as f:  # the running server's own argv
        assert chart_redis.password.encode() not in f.read()


def test_the_rendered_redis_requires_the_secrets_password(chart_redis):
    assert _reply(chart_redis.port, "PING") == "-NOAUTH Authentication required."
    assert _reply(chart_redis.port, "SET", "rf:chart-auth", "0") == "-NOAUTH Authentication required."
    assert _reply(chart_redis.port, "AUTH", "not-the-password").startswith("-WRONGPASS")
    assert _reply(chart_redis.port, "AUTH", chart_redis.password) == "+OK"
    authed = chart_redis.client(chart_redis.password)
    assert authed.set("rf:chart-auth", "1") and authed.get("rf:chart-auth") == "1"
    # the URL the API gets (RENDERFARM_REDIS_URL, its password expanded from the same Secret),
    # with the Service's name and port mapped to this server
    api = next(d for d in by_kind(chart_redis.docs, "Deployment") if d["metadata"]["name"].endswith("-api"))
    api_spec = api["spec"]["template"]["spec"]
    api_env = Manifests(chart_redis.docs, NAMESPACE).environment(api_spec["containers"][0], "farm-api", api_spec, {})
    url = re.sub(r"@[^/]+:6379/", f"@127.0.0.1:{chart_redis.port}/", api_env["RENDERFARM_REDIS_URL"])
    assert redis.Redis.from_url(url, decode_responses=True).get("rf:chart-auth") == "1"
    # the rendered readiness probe passes with REDISCLI_AUTH from the container's environment, and
    # fails with another password (redis-cli itself exits 0 on the WRONGPASS reply)
    assert _probe(chart_redis, chart_redis.env["REDISCLI_AUTH"]).returncode == 0
    wrong = _probe(chart_redis, "not-the-password")
    assert wrong.returncode != 0, wrong
    bare = subprocess.run(["redis-cli", "-p", str(chart_redis.port), "ping"], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", "REDISCLI_AUTH": "not-the-password"})
    assert bare.returncode == 0 and "PONG" not in bare.stdout, bare  # why the probe reads the answer


def _probe(chart_redis: ChartRedis, password: str) -> subprocess.CompletedProcess:
    """The StatefulSet's readiness probe as the kubelet runs it, ``redis-cli`` pointed at this
    server's port (the host's adjustment), with ``password`` as REDISCLI_AUTH."""
    (sts,) = by_kind(chart_redis.docs, "StatefulSet")
    command = sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["command"]
    command = [part.replace("redis-cli", f"redis-cli -p {chart_redis.port}") for part in command]
    return subprocess.run(command, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "REDISCLI_AUTH": password})


def documented() -> tuple[int, str]:
    """``maxmemory`` (bytes) and ``maxmemory-policy`` as the operator's docs state them; each page
    that names them must name the same."""
    seen = set()
    for page in DOCUMENTED:
        text = page.read_text()
        size = re.findall(r"`maxmemory (\d+)([a-z]*)`", text)
        policy = re.findall(r"`maxmemory-policy ([a-z-]+)`", text)
        assert len(size) == len(policy) == 1, (page, size, policy)
        seen.add((int(size[0][0]) * UNITS[size[0][1]], policy[0]))
    assert len(seen) == 1, seen
    return seen.pop()


def test_protected_mode_aof_and_maxmemory_as_documented(chart_redis):
    config = chart_redis.client(chart_redis.password).config_get("*")
    assert config["protected-mode"] == "yes"
    assert (config["appendonly"], config["appendfsync"]) == ("yes", "everysec")
    max_bytes, policy = documented()
    assert (int(config["maxmemory"]), config["maxmemory-policy"]) == (max_bytes, policy)
    (sts,) = by_kind(chart_redis.docs, "StatefulSet")
    assert max_bytes < 2**30 * int(sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
                                   .removesuffix("Gi"))


def test_a_write_survives_a_restart_from_the_aof(chart_redis):
    """SIGTERM (what the kubelet sends), then a start on the same data: the key comes back from
    the AOF. The RDB snapshot Redis also writes at shutdown (``save 900 1``) is removed first, so
    only the AOF can bring it back."""
    chart_redis.client(chart_redis.password).set("rf:chart-aof", "kept")
    assert chart_redis.process.stop() == 0, chart_redis.process.log_tail()
    (chart_redis.data_dir / "dump.rdb").unlink(missing_ok=True)
    chart_redis.process.start().wait_ready(30)
    assert chart_redis.client(chart_redis.password).get("rf:chart-aof") == "kept"
    assert "DB loaded from append only file" in chart_redis.process.log_tail(80)
