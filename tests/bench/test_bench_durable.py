"""``renderfarm bench durable``: a private primary and replica, one batch per durable-ack mode per
round through the API's submitter, and how each mode was confirmed (which depends on the
redis-server this machine has: WAITAOF from 7.2, else WAIT / the appendfsync policy)."""

from __future__ import annotations

import json
import subprocess
import sys

from infra.localstack import RedisServer
from infra.state.durable import redis_version


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", "bench", "durable", *args], capture_output=True,
                          text=True, timeout=300)


def test_each_mode_is_timed_and_says_how_it_was_confirmed(tmp_path):
    out = tmp_path / "durable.json"
    done = _bench("--rounds", "3", "--batch", "5", "--json", str(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    with RedisServer(run_dir=tmp_path) as server:
        waitaof = redis_version(server.client()) >= (7, 2)
    rows = {r["mode"]: r for r in result["rows"]}
    assert {m: r["confirmed_by"] for m, r in rows.items()} == (
        {"off": "off", "local": "waitaof", "replicas": "waitaof"} if waitaof else
        {"off": "off", "local": "always", "replicas": "wait"})
    assert rows["off"]["over_off_ms"] == 0 and all(0 < r["best_ms"] <= r["median_ms"] <= r["worst_ms"]
                                                   for r in rows.values())
    assert result["config"] == {"batch": 5, "rounds": 3, "appendfsync": "always"} and result["machine"]["cpu"]["name"]
    assert "median over off" in done.stdout


def test_a_bad_option_is_one_line_and_exit_2():
    done = _bench("--appendfsync", "never")
    assert done.returncode == 2 and "appendfsync must be always or everysec" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
