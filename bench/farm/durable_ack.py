"""What a durable 202 costs: the submission of one batch with ``RENDERFARM_DURABLE_ACK`` off,
``local`` and ``replicas`` (``renderfarm bench durable``).

Place in the data flow: beside submission. The bench starts its own redis-server with the AOF on
(``appendfsync`` as given) and one replica of it on loopback, and submits batches through the
API's own :class:`infra.submission.submitter.Submitter` (no HTTP: the figure is the store's
writes and the wait, not the web server). Each round submits one batch per mode, the modes'
order rotating from round to round; the table gives each mode's median and best milliseconds
per batch and the median's excess over ``off``, with how the wait was confirmed (``WAITAOF`` on
Redis ≥ 7.2; ``WAIT 1`` for ``replicas`` and nothing to wait for under ``appendfsync always``
before it: :mod:`infra.state.durable`).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = ("off", "local", "replicas")


@dataclass(frozen=True)
class DurableBenchConfig:
    """``batch``: jobs per submission; ``rounds``: batches per mode; ``appendfsync``: the
    primary's and the replica's AOF fsync policy (``always`` or ``everysec``)."""

    batch: int = 100
    rounds: int = 30
    appendfsync: str = "always"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.rounds < 1:
            raise ValueError("--batch and --rounds must be at least 1")
        if self.appendfsync not in ("always", "everysec"):
            raise ValueError(f"--appendfsync must be always or everysec, not {self.appendfsync!r}")


def run_durable_bench(config: DurableBenchConfig, log=print) -> dict:
    """Submit ``config.rounds`` batches of ``config.batch`` null-model jobs per durable-ack mode to
    a private primary with one replica. Returns ``{"config", "machine", "redis_version", "rows"}``,
    a row per mode with ``confirmed_by`` and milliseconds per batch (``median_ms``, ``best_ms``,
    ``worst_ms``, ``over_off_ms``)."""
    from infra.broker.app import make_celery
    from infra.localstack import RedisServer
    from infra.schemas import RenderRequest
    from infra.settings import Settings
    from infra.state.durable import DurableAck, redis_version
    from infra.state.job_store import JobStore
    from infra.submission.submitter import Submitter
    from pipeline.device import cpu_summary

    with tempfile.TemporaryDirectory(prefix="rf-durable-") as tmp:
        primary = RedisServer(appendonly=True, appendfsync=config.appendfsync, dir=Path(tmp) / "primary",
                              name="bench-primary", run_dir=tmp)
        with primary:
            replica = RedisServer(appendonly=True, appendfsync=config.appendfsync, dir=Path(tmp) / "replica",
                                  name="bench-replica", run_dir=tmp,
                                  extra_args=["--replicaof", "127.0.0.1", str(primary.port)])
            with replica:
                client = primary.client()
                _wait_replica_online(client)
                celery = make_celery(Settings(redis_url=primary.url))
                acks = {mode: DurableAck(client, mode, timeout_ms=5000) for mode in MODES}
                confirmed = {mode: ack.wait() for mode, ack in acks.items()}
                submitters = {mode: Submitter(JobStore(client), celery, "null", client, durable=acks[mode])
                              for mode in MODES}
                requests = [RenderRequest(prompt=f"durable {i}", model="null", width=64, height=64,
                                          num_inference_steps=1, seed=i) for i in range(config.batch)]
                times: dict[str, list[float]] = {mode: [] for mode in MODES}
                for i in range(config.rounds + 1):  # round 0 settles connections and scripts, unkept
                    for mode in MODES[i % 3:] + MODES[:i % 3]:
                        start = time.perf_counter()
                        submitters[mode].submit(requests)
                        if i:
                            times[mode].append(1000 * (time.perf_counter() - start))
                    if i and i % 10 == 0:
                        log(f"{i}/{config.rounds} rounds")
                version = ".".join(map(str, redis_version(client)))
    off = statistics.median(times["off"])
    rows = [{"mode": mode, "confirmed_by": confirmed[mode], "median_ms": round(statistics.median(t), 3),
             "best_ms": round(min(t), 3), "worst_ms": round(max(t), 3),
             "over_off_ms": round(statistics.median(t) - off, 3)} for mode, t in times.items()]
    return {"benchmark": "durable-ack", "config": asdict(config), "machine": {"cpu": cpu_summary()},
            "redis_version": version, "rows": rows}


def _wait_replica_online(client, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.info("replication").get("slave0", {}).get("state") != "online":
        if time.monotonic() > deadline:
            raise RuntimeError("the bench's replica did not come online")
        time.sleep(0.05)


def durable_table(result: dict):
    """A rich Table of :func:`run_durable_bench`."""
    from rich.table import Table

    c, cpu = result["config"], result["machine"]["cpu"]
    table = Table(title=f"one batch of {c['batch']} jobs submitted, per durable-ack mode ({c['rounds']} rounds; "
                        f"redis-server {result['redis_version']} + 1 replica on loopback, appendfsync "
                        f"{c['appendfsync']})", caption=f"{cpu['name']} ({cpu['isa']}, {cpu['cores']} cores)")
    for col in ("mode", "confirmed by", "median ms", "best ms", "worst ms", "median over off, ms"):
        table.add_column(col, justify="right")
    for r in result["rows"]:
        table.add_row(r["mode"], r["confirmed_by"], f"{r['median_ms']:.2f}", f"{r['best_ms']:.2f}",
                      f"{r['worst_ms']:.2f}", f"{r['over_off_ms']:+.2f}")
    return table
