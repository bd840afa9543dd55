"""Run the chart's rendered pods as Docker containers, by Kubernetes' rules, without a cluster.

:class:`PodRunner` takes ``helm template`` output and starts one replica of each Deployment and
StatefulSet as a host-network container (one, because host-network replicas would share a port):

* argv: ``command`` replaces the image's ENTRYPOINT (and its CMD), ``args`` alone replaces the
  CMD (``docker run --entrypoint`` and the trailing arguments do the same), and ``$(VAR)`` in
  both is expanded from the container's environment, ``$$`` escaping a ``$``
  (https://kubernetes.io/docs/tasks/inject-data-application/define-command-argument-container/);
* env: ``envFrom`` ConfigMaps and Secrets, then ``env`` values with ``$(VAR)`` references,
  ``configMapKeyRef``, ``secretKeyRef`` and ``fieldRef`` (``metadata.name`` is the pod name);
* each Service gets its own loopback address, 127.0.0.N, and its DNS names (``name``,
  ``name.ns``, ``name.ns.svc``, ``name.ns.svc.cluster.local``) map to it through ``--add-host``;
  a pod on the host network listening on 0.0.0.0 answers there. A Service whose ``port`` is not
  its pods' port would need a proxy: the runner refuses it with a clear error;
* the pod and container securityContext (user, group, dropped capabilities, no new privileges,
  read-only root), memory limits, and emptyDir / ConfigMap / Secret volumes;
* readiness and liveness probes (httpGet, tcpSocket, exec) are polled (:meth:`PodRunner.probe`,
  :meth:`PodRunner.wait_ready`); :meth:`PodRunner.stop` sends SIGTERM and, after the pod's
  ``terminationGracePeriodSeconds`` (default 30 s), SIGKILL, as the kubelet does.

Its base, :class:`Manifests`, resolves a container's environment, argv and ConfigMap / Secret
volume files from the same documents without Docker (tests/deploy/test_chart_redis.py runs the
bundled Redis's container command with the host's ``redis-server`` from them).
"""

from __future__ import annotations

import base64
import hashlib
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.deploy.docker_images import Dockerd

WORKLOADS = ("Deployment", "StatefulSet")


@dataclass
class Pod:
    """One running pod: its workload (``Kind/name``), pod name, the (first) container's spec,
    its resolved environment, the argv Kubernetes would run and the Docker container id."""

    workload: str
    name: str
    spec: dict
    container: dict
    env: dict[str, str]
    argv: list[str]
    container_id: str = ""
    events: list[str] = field(default_factory=list)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``,
    an undefined ``$(VAR)`` stays as written."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class Manifests:
    """What the kubelet reads from rendered chart documents, without running anything: a
    container's environment, its argv, and the files of its ConfigMap and Secret volumes.

    ``docs``: the parsed ``helm template`` documents; ``namespace``: the one it was rendered for.
    """

    def __init__(self, docs: list[dict], namespace: str) -> None:
        self.docs = docs
        self.namespace = namespace
        self.objects = {(d["kind"], d["metadata"]["name"]): d for d in docs if d}

    def _data(self, kind: str, name: str) -> dict[str, str]:
        obj = self.objects.get((kind, name))
        if obj is None:
            raise LookupError(f"{kind} {name!r} is referenced but not rendered")
        if kind == "Secret":
            out = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
            return {**out, **(obj.get("stringData") or {})}
        return dict(obj.get("data") or {})

    def _field(self, path: str, pod_name: str, spec: dict, meta: dict) -> str:
        simple = {"metadata.name": pod_name, "metadata.namespace": self.namespace,
                  "metadata.uid": hashlib.sha1(pod_name.encode()).hexdigest(),
                  "spec.nodeName": socket.gethostname(), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
                  "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1"}
        if path in simple:
            return simple[path]
        if m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path):
            return (meta.get(m.group(1)) or {}).get(m.group(2), "")
        raise NotImplementedError(f"fieldRef {path!r} is not supported by the runner")

    def environment(self, container: dict, pod_name: str, spec: dict, meta: dict) -> dict[str, str]:
        """The container's environment as the kubelet builds it (envFrom first, then env in order)."""
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in source:
                    try:
                        env.update({prefix + k: v for k, v in self._data(kind, source[key]["name"]).items()})
                    except LookupError:
                        if not source[key].get("optional"):
                            raise
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(str(var["value"]), env)
                continue
            ref = var.get("valueFrom", {})
            if "fieldRef" in ref:
                env[var["name"]] = self._field(ref["fieldRef"]["fieldPath"], pod_name, spec, meta)
            elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
                kind, r = ("ConfigMap", ref["configMapKeyRef"]) if "configMapKeyRef" in ref \
                    else ("Secret", ref["secretKeyRef"])
                data = self._data(kind, r["name"])
                if r["key"] in data:
                    env[var["name"]] = data[r["key"]]
                elif not r.get("optional"):
                    raise LookupError(f"{kind} {r['name']} has no key {r['key']!r}")
            else:
                raise NotImplementedError(f"env {var['name']}: {sorted(ref)} is not supported by the runner")
        return env

    @staticmethod
    def argv(container: dict, env: dict[str, str]) -> tuple[list[str], list[str]]:
        """The container's ``command`` and ``args`` with ``$(VAR)`` expanded from ``env``."""
        return ([expand(a, env) for a in container.get("command", [])],
                [expand(a, env) for a in container.get("args", [])])

    def volume_files(self, volume: dict, folder: Path) -> Path:
        """Write a ConfigMap or Secret volume's keys as files into ``folder`` (mode 0644), as the
        kubelet projects them; returns ``folder``. Raises LookupError for an unrendered object."""
        kind, name = ("ConfigMap", volume["configMap"]["name"]) if "configMap" in volume \
            else ("Secret", volume["secret"]["secretName"])
        folder.mkdir(parents=True, exist_ok=True)
        for k, value in self._data(kind, name).items():
            (folder / k).write_text(value)
            (folder / k).chmod(0o644)
        return folder


class PodRunner(Manifests):
    """Start, probe and stop the Deployments and StatefulSets of rendered chart documents.

    ``docs``: the parsed ``helm template`` documents; ``namespace``: the one it was rendered for;
    ``log``: called with each line of what the runner does (the tests print it).
    """

    def __init__(self, docs: list[dict], dockerd: Dockerd, namespace: str, work_dir: Path,
                 log: Callable[[str], None] = print) -> None:
        super().__init__(docs, namespace)
        self.dockerd = dockerd
        self.work_dir = work_dir
        self.log = log
        self.pods: dict[str, Pod] = {}
        self._starts = 0
        self.services: dict[str, str] = {}  # Service name → loopback address
        for i, svc in enumerate(d for d in docs if d.get("kind") == "Service"):
            self.services[svc["metadata"]["name"]] = f"127.0.0.{10 + i}"

    # ------------------------------------------------------------------ manifests → docker run
    def _volumes(self, pod_name: str, spec: dict, container: dict) -> list[str]:
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in spec.get("_claims", [])}
        args: list[str] = []
        for mount in container.get("volumeMounts", []):
            path, ro = mount["mountPath"], ",readonly" if mount.get("readOnly") else ""
            v = volumes.get(mount["name"])
            if v is None and mount["name"] in claims or v is not None and "persistentVolumeClaim" in v:
                args += ["--mount", f"type=volume,dst={path}{ro}"]
            elif v is None:
                raise LookupError(f"{pod_name}: volumeMount {mount['name']!r} names no volume")
            elif "emptyDir" in v:
                kind = "tmpfs" if (v["emptyDir"] or {}).get("medium") == "Memory" else "volume"
                args += ["--mount", f"type={kind},dst={path}"]
            elif "configMap" in v or "secret" in v:
                folder = self.volume_files(v, self.work_dir / "volumes" / pod_name / mount["name"])
                src = folder / mount["subPath"] if mount.get("subPath") else folder
                args += ["--mount", f"type=bind,src={src},dst={path},readonly"]
            else:
                raise NotImplementedError(f"{pod_name}: volume {mount['name']} ({sorted(v)}) is not supported")
        return args

    def _security(self, spec: dict, container: dict) -> list[str]:
        pod_sc, sc = spec.get("securityContext") or {}, container.get("securityContext") or {}
        user, group = sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsGroup", pod_sc.get("runAsGroup"))
        args: list[str] = []
        if user is not None:
            args += ["--user", f"{user}:{group}" if group is not None else str(user)]
        if pod_sc.get("fsGroup") is not None:
            args += ["--group-add", str(pod_sc["fsGroup"])]
        for cap in (sc.get("capabilities") or {}).get("drop", []):
            args += ["--cap-drop", cap]
        for cap in (sc.get("capabilities") or {}).get("add", []):
            args += ["--cap-add", cap]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        if sc.get("readOnlyRootFilesystem"):
            args += ["--read-only"]
        return args

    def _service_hosts(self) -> list[str]:
        args = []
        for name, addr in self.services.items():
            for host in (name, f"{name}.{self.namespace}", f"{name}.{self.namespace}.svc",
                         f"{name}.{self.namespace}.svc.cluster.local"):
                args += ["--add-host", f"{host}:{addr}"]
        return args

    def _check_service_ports(self) -> None:
        for d in self.docs:
            if d.get("kind") != "Service":
                continue
            for port in d["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                numbers = {c["containerPort"] for w in self.docs if w.get("kind") in WORKLOADS
                           for c in w["spec"]["template"]["spec"]["containers"] for c in c.get("ports", [])
                           if target in (c.get("name"), c["containerPort"])}
                if numbers and numbers != {port["port"]}:
                    raise NotImplementedError(f"Service {d['metadata']['name']} port {port['port']} → {numbers}: "
                                              "host-network pods need the Service port to equal the pod's port")

    def start_all(self) -> list[Pod]:
        """Start one pod of every Deployment and StatefulSet, in document order."""
        self._check_service_ports()
        stale = self.dockerd.docker("ps", "-aq", "--filter", "label=renderfarm.test/pod").stdout.split()
        if stale:  # left by a run that was killed; the data root (and so they) outlive it
            self.dockerd.docker("rm", "-f", "-v", *stale, check=False)
        for name, addr in self.services.items():
            self.log(f"service {name}.{self.namespace}.svc → {addr}")
        return [self.start(d) for d in self.docs if d.get("kind") in WORKLOADS]

    def start(self, workload: dict) -> Pod:
        """``docker run`` the first container of ``workload``'s pod template (init containers
        first, each to completion). Returns the :class:`Pod`."""
        kind, wname = workload["kind"], workload["metadata"]["name"]
        template = workload["spec"]["template"]
        spec, meta = dict(template["spec"]), template.get("metadata") or {}
        spec["_claims"] = workload["spec"].get("volumeClaimTemplates", [])
        # A Deployment's pod: <name>-<pod-template hash>-<random>, new on every start; a
        # StatefulSet's: <name>-<ordinal>, the same again after a restart.
        template_hash = hashlib.sha1(repr(template).encode()).hexdigest()[:10]
        self._starts += 1
        random_part = hashlib.sha1(f"{wname} {self._starts}".encode()).hexdigest()[:5]
        pod_name = f"{wname}-0" if kind == "StatefulSet" else f"{wname}-{template_hash}-{random_part}"
        for init in spec.get("initContainers", []):
            code, out = self._run(kind, pod_name, spec, meta, init, detach=False)
            self.log(f"{pod_name}: init container {init['name']} exited {code}")
            if code != 0:
                raise RuntimeError(f"{pod_name}: init container {init['name']} exited {code}: {out[-800:]}")
        container = spec["containers"][0]
        pod = Pod(f"{kind}/{wname}", pod_name, spec, container, {}, [])
        pod.env = self.environment(container, pod_name, spec, meta)
        _, cid = self._run(kind, pod_name, spec, meta, container, detach=True, pod=pod)
        pod.container_id = cid.strip()
        self.pods[pod_name] = pod
        self.log(f"{pod.workload}: pod {pod_name} started: {' '.join(pod.argv)}")
        return pod

    def _run(self, kind: str, pod_name: str, spec: dict, meta: dict, container: dict, *, detach: bool,
             pod: Pod | None = None) -> tuple[int, str]:
        env = self.environment(container, pod_name, spec, meta)
        image = container["image"]
        entry = self.dockerd.docker("image", "inspect", "--format", "{{json .Config.Entrypoint}}", image).stdout
        entrypoint = [x for x in re.findall(r'"((?:[^"\\]|\\.)*)"', entry)]
        command, args = self.argv(container, env)
        run = ["run", "--pull", "never", "--network", "host", "--name", f"{pod_name}-{container['name']}",
               "--label", f"renderfarm.test/pod={pod_name}"]
        run += self._service_hosts() + self._security(spec, container)
        run += self._volumes(pod_name, spec, container)
        memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if memory:
            run += ["--memory", re.sub(r"([KMGT])i$", lambda m: m.group(1).lower(), memory)]
        env_file = self.work_dir / "env" / f"{pod_name}-{container['name']}.env"
        env_file.parent.mkdir(parents=True, exist_ok=True)
        for k, v in env.items():
            if "\n" in v:
                raise NotImplementedError(f"{pod_name}: env {k} holds a newline, which docker --env-file cannot")
        env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        env_file.chmod(0o600)
        run += ["--env-file", str(env_file)]
        if command:
            run += ["--entrypoint", command[0], image, *command[1:], *args]
            argv = [*command, *args]
        else:
            run += [image, *args] if "args" in container else [image]
            argv = [*entrypoint, *args] if "args" in container else [*entrypoint, "(the image's CMD)"]
        if pod is not None:
            pod.argv = argv
        if detach:
            out = self.dockerd.docker(*run[:1], "-d", *run[1:])
            return 0, out.stdout
        out = self.dockerd.docker(*run, check=False, timeout=600)
        self.dockerd.docker("rm", f"{pod_name}-{container['name']}", check=False)
        return out.returncode, out.stdout + out.stderr

    # ------------------------------------------------------------------ probes and lifecycle
    def state(self, pod: Pod) -> dict:
        """Docker's ``State`` of the pod's container (Running, ExitCode, OOMKilled, …)."""
        import json

        return json.loads(self.dockerd.docker("inspect", "--format", "{{json .State}}", pod.container_id).stdout)

    def logs(self, pod: Pod, tail: int = 200) -> str:
        """The last ``tail`` lines of the container's stdout and stderr."""
        out = self.dockerd.docker("logs", "--tail", str(tail), pod.container_id, check=False)
        return out.stdout + out.stderr

    def _port(self, pod: Pod, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(p["containerPort"] for p in pod.container.get("ports", []) if p.get("name") == port)

    def probe(self, pod: Pod, which: str) -> tuple[bool, str]:
        """Run the container's ``which`` probe (``readinessProbe``, ``livenessProbe`` or
        ``startupProbe``) once: (succeeded, what it saw). A container without it succeeds."""
        spec = pod.container.get(which)
        if not spec:
            return True, "no probe"
        timeout = float(spec.get("timeoutSeconds", 1))
        if "httpGet" in spec:
            get = spec["httpGet"]
            url = f"{get.get('scheme', 'HTTP').lower()}://{get.get('host', '127.0.0.1')}:" \
                  f"{self._port(pod, get['port'])}{get.get('path', '/')}"
            request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in get.get("httpHeaders", [])})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as answer:
                    return 200 <= answer.status < 400, f"GET {url} → {answer.status}"
            except urllib.error.HTTPError as exc:
                return False, f"GET {url} → {exc.code}"
            except OSError as exc:
                return False, f"GET {url}: {exc}"
        if "tcpSocket" in spec:
            port = self._port(pod, spec["tcpSocket"]["port"])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=timeout).close()
                return True, f"tcp 127.0.0.1:{port} open"
            except OSError as exc:
                return False, f"tcp 127.0.0.1:{port}: {exc}"
        if "exec" in spec:
            out = self.dockerd.docker("exec", pod.container_id, *spec["exec"]["command"], check=False,
                                      timeout=timeout + 5)
            return out.returncode == 0, f"exec {spec['exec']['command']} → exit {out.returncode}"
        raise NotImplementedError(f"{pod.name}: {which} {sorted(spec)} is not supported")

    def wait_ready(self, pod: Pod, timeout: float = 120, poll_s: float = 1.0) -> str:
        """Poll the readiness probe until it succeeds; returns what it saw. Raises RuntimeError
        with the container's log when the container exits or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        seen = ""
        while time.monotonic() < deadline:
            state = self.state(pod)
            if not state["Running"]:
                raise RuntimeError(f"{pod.name} exited {state['ExitCode']} before it was ready:\n{self.logs(pod)}")
            ok, seen = self.probe(pod, "readinessProbe")
            if ok:
                self.log(f"{pod.name}: ready ({seen})")
                return seen
            time.sleep(poll_s)
        raise RuntimeError(f"{pod.name} not ready after {timeout:.0f} s (last: {seen}):\n{self.logs(pod)}")

    def exec(self, pod: Pod, *argv: str, timeout: float = 120) -> str:
        """``kubectl exec POD -- ARGV`` as ``docker exec``; its stdout. Raises RuntimeError when it fails."""
        out = self.dockerd.docker("exec", pod.container_id, *argv, check=False, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"exec {argv} in {pod.name} exited {out.returncode}: {out.stderr[-800:]}")
        return out.stdout

    def stop(self, pod: Pod) -> dict:
        """SIGTERM, then SIGKILL after the pod's terminationGracePeriodSeconds; returns the final
        State (``ExitCode`` 137 means the grace period ran out)."""
        grace = int(pod.spec.get("terminationGracePeriodSeconds", 30))
        started = time.monotonic()
        self.dockerd.docker("stop", "--time", str(grace), pod.container_id, timeout=grace + 60)
        state = self.state(pod)
        self.log(f"{pod.name}: SIGTERM → exited {state['ExitCode']} after {time.monotonic() - started:.1f} s "
                 f"(grace {grace} s)")
        return state

    def remove_all(self) -> None:
        """Remove every container (and its anonymous volumes) this runner started."""
        for pod in self.pods.values():
            self.dockerd.docker("rm", "-f", "-v", pod.container_id, check=False)
        self.pods.clear()
