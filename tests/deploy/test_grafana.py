"""deploy/grafana/renderfarm.json: a valid dashboard whose queries use the metric names that the
API's /metrics exposes (docs/operations/metrics.md)."""

from __future__ import annotations

import json
import re

from tests.deploy.conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "renderfarm.json"
FAMILIES = {  # name → Prometheus type, as the metrics page documents them
    "renderfarm_queue_wait_seconds": "histogram",
    "renderfarm_render_seconds_per_image": "histogram",
    "renderfarm_batch_size": "histogram",
    "renderfarm_images_total": "counter",
    "renderfarm_outstanding_jobs": "gauge",
    "renderfarm_live_workers": "gauge",
    "renderfarm_compiled_renders_total": "counter",
    "renderfarm_eager_renders_total": "counter",
    "renderfarm_recompiles_total": "counter",
}


def exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def family(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[: -len(suffix)] in FAMILIES:
            return name[: -len(suffix)]
    return name


def test_dashboard_is_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "renderfarm" and dash["panels"]
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["datasource", "pool"]
    cells = set()
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def test_queries_use_the_farm_metrics_and_cover_them_all():
    used = set()
    for e in exprs():
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert 'pool=~"$pool"' in e
        used |= {family(n) for n in re.findall(r"\brenderfarm_[a-z_]+", e)}
    assert used == set(FAMILIES)
    quantiles = " ".join(exprs())
    for metric in ("renderfarm_queue_wait_seconds", "renderfarm_render_seconds_per_image"):
        for q in ("0.5", "0.95"):
            assert f"histogram_quantile({q}, max by (le, pool) (rate({metric}_bucket" in quantiles


def test_metric_names_match_what_metrics_exposes(redis_server):
    """Each family the dashboard reads is a family /metrics serves (with its type), even before
    any job ran (infra/state/metrics.py)."""
    from fastapi.testclient import TestClient

    from infra.api.server import create_app
    from infra.settings import Settings

    settings = Settings(redis_url=redis_server.url, s3_endpoint_url="http://127.0.0.1:9")
    with TestClient(create_app(settings)) as client:
        text = client.get("/metrics").text
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    # prometheus-client's TYPE line names a counter without its _total suffix.
    for name, kind in FAMILIES.items():
        base = name[: -len("_total")] if kind == "counter" else name
        if name in exposed or base in exposed:
            assert exposed.get(name, exposed.get(base)) == kind, name
    missing = sorted(n for n in FAMILIES if n not in exposed and n[: -len("_total")] not in exposed)
    assert not missing, f"/metrics does not expose {', '.join(missing)}"
