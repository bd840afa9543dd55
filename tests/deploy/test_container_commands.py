"""Every container the chart renders runs a command that ``renderfarm`` accepts, and every KEDA
metrics-api trigger can authenticate when the API requires a key.

Offline (``helm template``), no cluster: for each container of each rendered workload, the argv
Kubernetes would run is built by its rules (``command`` replaces the image's ENTRYPOINT and, with
it, the CMD; ``args`` alone replaces the CMD; neither runs ENTRYPOINT + CMD), from the ENTRYPOINT
and CMD of the image's Dockerfile under ``deploy/docker``; then ``renderfarm``'s own argument
parser must accept it. An API container whose ``args`` forgot the subcommand
(``renderfarm --host 0.0.0.0``) fails here, as it would exit 2 in the pod.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from infra.cli import build_parser
from tests.deploy.conftest import ROOT, VALUES

DOCKER = ROOT / "deploy" / "docker"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"}
#: Images this repository builds: repository suffix → Dockerfile.
OWN_IMAGES = {"renderfarm/api": "api.Dockerfile", "renderfarm/worker-cpu": "worker-cpu.Dockerfile",
              "renderfarm/worker-cuda": "worker-cuda.Dockerfile"}
THIRD_PARTY = ("redis",)  # images the chart runs as published, with their own command


def dockerfile_exec(path: Path) -> tuple[list[str], list[str]]:
    """(ENTRYPOINT, CMD) of the final stage of a Dockerfile, both in exec (JSON) form."""
    entrypoint: list[str] = []
    cmd: list[str] = []
    for line in path.read_text().splitlines():
        if re.match(r"^FROM\s", line):
            entrypoint, cmd = [], []
        elif m := re.match(r"^(ENTRYPOINT|CMD)\s+(\[.*\])\s*$", line):
            value = json.loads(m.group(2))
            if m.group(1) == "ENTRYPOINT":
                entrypoint = value
            else:
                cmd = value
    return entrypoint, cmd


def kubernetes_argv(container: dict, entrypoint: list[str], cmd: list[str]) -> list[str]:
    """The argv Kubernetes runs for ``container`` on an image with ``entrypoint`` and ``cmd``."""
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    if "args" in container:
        return [*entrypoint, *container["args"]]
    return [*entrypoint, *cmd]


def containers(docs: list[dict]):
    """(workload name, container) for every container and init container of every workload."""
    for doc in docs:
        if doc.get("kind") not in WORKLOADS:
            continue
        spec = doc["spec"]
        if doc["kind"] == "CronJob":
            spec = spec["jobTemplate"]["spec"]
        pod = spec["template"]["spec"]
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            yield f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}", c


def parse_error(argv: list[str]) -> str | None:
    """None when ``renderfarm``'s parser accepts ``argv`` (after the program name), else its message."""
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            return err.getvalue().strip() or f"exit {exc.code}"
    return None if isinstance(args, argparse.Namespace) else "no namespace"


def renderfarm_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``renderfarm`` in ``argv`` (behind an optional ``tini --``), or None."""
    if argv[:2] == ["tini", "--"]:
        argv = argv[2:]
    return argv[1:] if argv[:1] == ["renderfarm"] else None


VALUE_SETS = sorted(VALUES)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_container_runs_a_command_renderfarm_accepts(render, values: str) -> None:
    checked = 0
    for where, c in containers(render(values)):
        repository = c["image"].rsplit(":", 1)[0]
        own = next((f for r, f in OWN_IMAGES.items() if repository.endswith(r)), None)
        if own is None:
            assert repository.rsplit("/", 1)[-1] in THIRD_PARTY, f"{where}: unknown image {c['image']}"
            continue
        argv = kubernetes_argv(c, *dockerfile_exec(DOCKER / own))
        rest = renderfarm_argv(argv)
        assert rest is not None, f"{where} does not run renderfarm: {argv}"
        error = parse_error(rest)
        assert error is None, f"{where} runs {argv}, which renderfarm refuses: {error}"
        checked += 1
    assert checked >= 2  # the API and at least one worker pool


def test_the_api_container_ignores_the_images_cmd(render) -> None:
    """The API's argv is the same whatever CMD its image has: the chart names the subcommand."""
    (api,) = [c for where, c in containers(render("default")) if where.endswith("/api")]
    entrypoint, _ = dockerfile_exec(DOCKER / "api.Dockerfile")
    assert kubernetes_argv(api, entrypoint, ["worker"]) == kubernetes_argv(api, entrypoint, ["api"])
    assert renderfarm_argv(kubernetes_argv(api, entrypoint, []))[0] == "api"


def _auth_required(docs: list[dict]) -> bool:
    config = next(d for d in docs if d.get("kind") == "ConfigMap" and "RENDERFARM_AUTH_REQUIRED" in d.get("data", {}))
    return config["data"]["RENDERFARM_AUTH_REQUIRED"].lower() in ("true", "1", "yes", "on")


def _user_auth_ref(values: str) -> str:
    """autoscaling.metricsApi.authenticationRef as the values files of ``values`` set it ("" = none)."""
    ref = ""
    for f in VALUES[values]:
        doc = yaml.safe_load(Path(f).read_text()) or {}
        ref = ((doc.get("autoscaling") or {}).get("metricsApi") or {}).get("authenticationRef", ref) or ref
    return ref


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_metrics_api_trigger_can_authenticate(render, values: str) -> None:
    """With auth required, each metrics-api trigger names a TriggerAuthentication the chart
    renders, which reads the scrape token from a Secret the chart renders and the API reads too."""
    docs = render(values)
    assert _auth_required(docs)
    user_ref = _user_auth_ref(values)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs if d}
    api = next(c for where, c in containers(docs) if where.endswith("/api"))
    api_token = next(e["valueFrom"]["secretKeyRef"] for e in api["env"] if e["name"] == "RENDERFARM_METRICS_TOKEN")
    triggers = [(d["metadata"]["name"], t) for d in docs if d.get("kind") == "ScaledObject"
                for t in d["spec"]["triggers"] if t["type"] == "metrics-api"]
    assert triggers, "no metrics-api trigger rendered"
    for name, t in triggers:
        ref = t.get("authenticationRef", {}).get("name")
        assert ref, f"{name}: metrics-api trigger without authenticationRef while auth is required (401)"
        if user_ref:  # the user's own TriggerAuthentication, outside the chart, holds a tenant key
            assert ref == user_ref and t["metadata"].get("authMode") == "apiKey"
            continue
        auth = by_kind.get(("TriggerAuthentication", ref))
        assert auth is not None, f"{name}: TriggerAuthentication {ref} is not rendered"
        assert t["metadata"].get("authMode") == "bearer"
        (target,) = [s for s in auth["spec"]["secretTargetRef"] if s["parameter"] == "token"]
        assert ("Secret", target["name"]) in by_kind, f"{name}: Secret {target['name']} is not rendered"
        assert target["key"] in by_kind[("Secret", target["name"])]["data"]
        assert {"name": target["name"], "key": target["key"]} == {k: api_token[k] for k in ("name", "key")}


def test_a_user_trigger_authentication_wins(render) -> None:
    docs = render("default", "--set", "autoscaling.metricsApi.authenticationRef=mine")
    assert not [d for d in docs if d.get("kind") == "TriggerAuthentication"]
    for d in docs:
        if d.get("kind") == "ScaledObject":
            (t,) = d["spec"]["triggers"]
            assert t["authenticationRef"] == {"name": "mine"} and t["metadata"]["authMode"] == "apiKey"


def test_auth_off_renders_no_scrape_credentials(render) -> None:
    docs = render("default", "--set", "auth.required=false")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs if d}
    assert not any(k == "TriggerAuthentication" for k, _ in kinds)
    assert ("Secret", "farm-renderfarm-scrape") not in kinds
    for d in docs:
        if d.get("kind") == "ScaledObject":
            assert "authenticationRef" not in d["spec"]["triggers"][0]
