"""The chart's Sentinel option (``deploy/helm/values-redis-sentinel.yaml``) run as its pods would
run it, by the host's ``redis-server``: three pods of two containers each (Redis and a sentinel),
started in ordinal order as the StatefulSet starts them. The first elects itself primary, the
others replicate it; the farm's ``RENDERFARM_REDIS_URL`` (a ``sentinel://`` URL) reaches the
primary; the first pod lost (both containers ``kill -9``, the machine gone) makes the sentinels
promote a replica, the same URL reaches it with the data, and the first pod started again joins
as a replica of the new primary.

From ``helm template`` with that values file and ``downAfterMilliseconds=1000`` (the chart's 10 s
would make the test wait). Each container's command, environment and ConfigMap files as the
kubelet gives them (:class:`tests.deploy.pod_runner.Manifests`). Adjusted for the host, and
nothing else:

* the mount paths (``/etc/redis``, ``/data``, ``/run/redis``, ``/run/sentinel``) are directories
  under the test's tmp dir, in the scripts and the config;
* each pod's address (``status.podIP``) is a loopback address of its own (127.a.b.1…3: Linux
  routes all of 127/8 to loopback), and its cluster DNS name (``<pod>.<headless service>.<namespace>.svc``)
  is written as that address where the chart's environment names it, since this machine has no
  cluster DNS; so the ports stay the pods' own 6379 and 26379.
"""

from __future__ import annotations

import base64
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from infra.localstack import ManagedProcess
from infra.state.connect import redis_client
from tests.deploy.conftest import CHART, SENTINEL, by_kind, run_helm
from tests.deploy.pod_runner import Manifests

pytestmark = pytest.mark.integration

NAMESPACE = "render"


@dataclass
class Pod:
    """One pod of the group run here: its address and its two containers' processes."""

    name: str
    ip: str
    processes: dict[str, ManagedProcess]


class SentinelChart:
    """The rendered Sentinel group, run pod by pod on loopback addresses."""

    def __init__(self, docs: list[dict], root: Path):
        self.manifests = Manifests(docs, NAMESPACE)
        self.sts = next(s for s in by_kind(docs, "StatefulSet") if s["metadata"]["name"].endswith("-redis"))
        self.spec = self.sts["spec"]["template"]["spec"]
        self.meta = self.sts["spec"]["template"].get("metadata") or {}
        self.root = root
        net = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}"
        name, domain = self.sts["metadata"]["name"], f"{self.sts['spec']['serviceName']}.{NAMESPACE}.svc"
        self.ips = {f"{name}-{i}": f"{net}.{i + 1}" for i in range(self.sts["spec"]["replicas"])}
        self.dns = {f"{pod}.{domain}": ip for pod, ip in self.ips.items()}
        secret = next(s for s in by_kind(docs, "Secret")
                      if s["metadata"]["labels"].get("app.kubernetes.io/component") == "redis")
        self.password = base64.b64decode(secret["data"]["redis-password"]).decode()
        api = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-api"))
        api_spec = api["spec"]["template"]["spec"]
        env = self.manifests.environment(api_spec["containers"][0], "api-0", api_spec, {})
        #: the farm's RENDERFARM_REDIS_URL, the pods' DNS names written as their addresses
        self.farm_url = self._resolve(env["RENDERFARM_REDIS_URL"])
        self.pods: dict[str, Pod] = {}

    def _resolve(self, text: str) -> str:
        for host, ip in self.dns.items():
            text = text.replace(host, ip)
        return text

    def start(self, pod_name: str) -> Pod:
        """Start both containers of one pod and wait until each answers."""
        ip = self.ips[pod_name]
        volumes = {v["name"]: v for v in self.spec["volumes"]}
        processes = {}
        for container in self.spec["containers"]:
            folder = self.root / pod_name / container["name"]
            mounts: dict[str, Path] = {}
            for mount in container["volumeMounts"]:
                path = folder / mount["name"]
                volume = volumes.get(mount["name"], {})
                if "configMap" in volume:
                    self.manifests.volume_files(volume, path)
                else:  # an emptyDir, or the claim template's volume (kept across restarts)
                    path = self.root / pod_name / mount["name"] if mount["name"] == "data" else path
                    path.mkdir(parents=True, exist_ok=True)
                mounts[mount["mountPath"]] = path
            for file in mounts["/etc/redis"].iterdir():
                file.write_text(_on_host(file.read_text(), mounts))
            env = self.manifests.environment(container, pod_name, self.spec, self.meta)
            env = {k: self._resolve(v) for k, v in env.items()} | {"POD_IP": ip}
            command, args = self.manifests.argv(container, env)
            port = container["ports"][0]["containerPort"]
            processes[container["name"]] = ManagedProcess(
                f"{pod_name}-{container['name']}", [_on_host(a, mounts) for a in command + args], env=env,
                run_dir=self.root / "logs", ready=lambda ip=ip, port=port: _answers(ip, port, self.password),
                ready_timeout=30).start()
        for process in processes.values():
            process.wait_ready()
        self.pods[pod_name] = Pod(pod_name, ip, processes)
        return self.pods[pod_name]

    def lose(self, pod_name: str) -> None:
        """The pod's machine gone: both containers SIGKILLed."""
        for process in self.pods.pop(pod_name).processes.values():
            process.kill()

    def stop(self) -> None:
        for pod in self.pods.values():
            for process in pod.processes.values():
                process.kill()

    def server(self, pod_name: str, port: int = 6379) -> redis.Redis:
        return redis.Redis(host=self.ips[pod_name], port=port, password=self.password, decode_responses=True,
                           socket_timeout=5)


def _on_host(text: str, mounts: dict[str, Path]) -> str:
    """``text`` with each mount path (a whole path, or the start of one) written as its host directory."""
    pattern = re.compile("|".join(rf"(?<![\w/]){re.escape(p)}(?=/|\s|$|\")" for p in mounts))
    return pattern.sub(lambda m: str(mounts[m.group(0)]), text)


def _answers(ip: str, port: int, password: str) -> bool:
    try:
        return bool(redis.Redis(host=ip, port=port, password=password, socket_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


def _wait(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := predicate():
                return value
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not within {timeout} s")


@pytest.fixture
def chart(render, tmp_path) -> Iterator[SentinelChart]:
    docs = render([SENTINEL], "--set", "redis.bundled.sentinel.downAfterMilliseconds=1000")
    group = SentinelChart(docs, tmp_path)
    try:
        yield group
    finally:
        group.stop()


def test_the_pods_elect_the_first_replicate_it_and_fail_over_when_its_machine_is_lost(chart):
    first, second, third = chart.ips
    for pod in (first, second, third):  # the StatefulSet's ordered start
        chart.start(pod)
    primary = chart.server(first)
    _wait(lambda: primary.info("replication")["connected_slaves"] == 2)
    for pod in (second, third):
        assert chart.server(pod).info("replication")["master_host"] == chart.ips[first]
    sentinel = chart.server(third, 26379)
    _wait(lambda: sentinel.sentinel_master("farm")["num-other-sentinels"] == 2)
    # the password is required on Redis and on the sentinels
    for port in (6379, 26379):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host=chart.ips[first], port=port, socket_timeout=5).ping()
    # the farm's URL reaches the primary, and its writes reach the replicas
    assert chart.farm_url.startswith("sentinel://") and "/farm/0?" in chart.farm_url
    farm = redis_client(chart.farm_url, socket_timeout=2, socket_connect_timeout=1)
    farm.set("rf:chart-sentinel", "before")
    assert primary.get("rf:chart-sentinel") == "before"
    _wait(lambda: chart.server(second).get("rf:chart-sentinel") == "before")
    # the first pod's machine lost: a replica is promoted and the same URL reaches it
    chart.lose(first)
    lost_at = time.monotonic()
    promoted = _wait(lambda: sentinel.sentinel_get_master_addr_by_name("farm")[0] != chart.ips[first]
                     and sentinel.sentinel_get_master_addr_by_name("farm")[0])
    _wait(lambda: farm.set("rf:chart-sentinel-after", "after"), timeout=30)
    failover_s = time.monotonic() - lost_at
    new_primary = next(pod for pod, ip in chart.ips.items() if ip == promoted)
    assert chart.server(new_primary).get("rf:chart-sentinel") == "before"
    assert chart.server(new_primary).info("replication")["role"] == "master"
    print(f"the farm's URL wrote to the promoted replica {failover_s:.1f} s after the primary's pod was lost")
    assert failover_s < 15
    # the first pod started again (the StatefulSet recreates it) joins as the new primary's replica
    chart.start(first)
    back = chart.server(first)
    _wait(lambda: back.info("replication")["role"] == "slave"
          and back.info("replication")["master_host"] == promoted)
    _wait(lambda: back.get("rf:chart-sentinel-after") == "after")


def test_network_policy_lets_the_farm_reach_the_sentinels_and_the_group_reach_itself(render):
    docs = render("redis-sentinel")
    (policy,) = [p for p in by_kind(docs, "NetworkPolicy") if p["metadata"]["name"].endswith("-redis")]
    rules = {}
    for rule in policy["spec"]["ingress"]:
        (peer,) = rule["from"]
        selector = peer["podSelector"]
        components = selector.get("matchLabels", {}).get("app.kubernetes.io/component") or \
            tuple(selector["matchExpressions"][0]["values"])
        rules[components] = sorted(p["port"] for p in rule["ports"])
    assert rules == {("api", "worker", "catalog"): [6379, 26379], "redis": [6379, 26379]}
    # the default chart's single Redis: the farm's pods on 6379 only
    (single,) = [p for p in by_kind(render("default"), "NetworkPolicy") if p["metadata"]["name"].endswith("-redis")]
    assert [sorted(p["port"] for p in r["ports"]) for r in single["spec"]["ingress"]] == [[6379]]


def test_a_group_too_small_for_a_quorum_is_refused_at_install(helm):
    out = run_helm(helm, "template", "farm", str(CHART), "-f", str(SENTINEL), "--set",
                   "redis.bundled.sentinel.replicas=2", check=False)
    assert out.returncode != 0 and "/redis/bundled/sentinel/replicas" in out.stderr, out.stderr
