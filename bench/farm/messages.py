"""``renderfarm bench messages``: the broker's cost per job with one Celery message per job (the
farm's way) against one message per group of jobs.

Place in the data flow: the hop from the dispatcher to a worker's consumer (dispatcher → a pool's
Celery queue in Redis → the worker's kombu consumer → acks). A worker already keeps leases, starts
and acks per job in the job store; this measures what the messages themselves cost, to decide
whether publishing one message per compatible group of jobs is worth its price (a group would be
bound to one worker when it is published, and redelivered whole when that worker is lost).

It starts a private redis-server and, per round and mode, moves ``jobs`` job ids through the
farm's own Celery app configuration (:func:`infra.broker.app.make_celery`: priority lists,
visibility timeout, JSON) and records CPU seconds:

* **per-job**: :func:`infra.broker.publish.publish_jobs`, the dispatcher's path (one message per
  job, copies of one Celery-built message in pipelined LPUSHes);
* **group**: one ``send_task`` per ``group`` job ids (``kwargs={"job_ids": [...]}``).

Both are consumed by a kombu consumer with the farm's cheap acks
(:func:`infra.broker.kombu_redis.install_cheap_acks`, deferred acks flushed after each
``drain_events``), prefetch ``prefetch`` messages, every message decoded, its job ids collected
and acked. CPU: the bench process's (``time.process_time``) for publishing and for consuming, and
redis-server's (``INFO cpu``) for both. What it leaves out is Celery's own per-message work in a
worker (its strategy, the ``Request`` objects, celery-batches' buffering), which a group message
would also save: the saving measured here is a lower bound.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass

POOL = "bench-messages"
MODES = ("per-job", "group")


@dataclass(frozen=True)
class MessagesBenchConfig:
    """``jobs`` job ids per mode and round (1…100,000), ``group`` ids per group message (2…1,000),
    ``prefetch`` messages the consumer may hold, ``rounds`` (medians; the mode order alternates)."""

    jobs: int = 5000
    group: int = 64
    prefetch: int = 128
    rounds: int = 3


def _redis_cpu_s(client) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _publish(app, mode: str, job_ids: list[str], group: int) -> int:
    """Publish ``job_ids`` to :data:`POOL`'s queue the ``mode`` way; returns the messages sent."""
    from infra import keys
    from infra.broker.app import PRIORITY_VALUES
    from infra.broker.publish import publish_jobs

    if mode == "per-job":
        return publish_jobs(app, [(job_id, POOL) for job_id in job_ids])
    sent = 0
    with app.producer_or_acquire() as producer:
        for start in range(0, len(job_ids), group):
            app.send_task("renderfarm.bench_group", kwargs={"job_ids": job_ids[start:start + group]},
                          queue=keys.queue(POOL), routing_key=keys.queue(POOL),
                          priority=PRIORITY_VALUES["normal"], producer=producer)
            sent += 1
    return sent


def _consume(app, expected: int, prefetch: int, timeout_s: float = 60.0) -> list[str]:
    """Consume :data:`POOL`'s queue until ``expected`` job ids arrived; returns them in arrival order.

    Raises:
        TimeoutError: fewer than ``expected`` ids within ``timeout_s`` seconds.
    """
    from kombu import Queue

    from infra import keys
    from infra.broker.kombu_redis import flush_acks

    seen: list[str] = []

    def on_message(body, message) -> None:
        kwargs = body[1] if isinstance(body, list) else body.get("kwargs", {})
        seen.extend(kwargs["job_ids"] if "job_ids" in kwargs else [kwargs["job_id"]])
        message.ack()

    deadline = time.monotonic() + timeout_s
    with app.connection_for_read() as conn, conn.Consumer([Queue(keys.queue(POOL))], callbacks=[on_message],
                                                          accept=["json"]) as consumer:
        consumer.qos(prefetch_count=prefetch)
        while len(seen) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"consumed {len(seen)} of {expected} job ids in {timeout_s} s")
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:  # socket.timeout
                pass
            flush_acks()
    return seen


def run_messages_bench(config: MessagesBenchConfig, log=print) -> dict:
    """Move ``config.jobs`` ids through the broker per mode and round; returns per-mode runs and
    medians of CPU milliseconds per job (publish, consume, redis-server, total) and messages sent.

    Raises:
        ValueError: a config value out of range.
        RuntimeError: a mode lost or repeated a job id.
    """
    from bench.farm.workload import load_average
    from infra.broker.app import make_celery
    from infra.broker.kombu_redis import install_cheap_acks
    from infra.localstack.services import RedisServer
    from infra.settings import Settings
    from pipeline.device import cpu_summary

    if not (1 <= config.jobs <= 100_000 and 2 <= config.group <= 1000 and config.prefetch >= 1
            and config.rounds >= 1):
        raise ValueError(f"jobs 1…100,000, group 2…1,000, prefetch ≥ 1 and rounds ≥ 1, got {config}")
    install_cheap_acks()
    load_before = load_average()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    server = RedisServer(name="bench-messages-redis")
    with server:
        app = make_celery(Settings(redis_url=server.url))
        client = server.client()
        for r in range(config.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                job_ids = [f"{mode}-{r}-{i:06d}" for i in range(config.jobs)]
                redis0, cpu0 = _redis_cpu_s(client), time.process_time()
                messages = _publish(app, mode, job_ids, config.group)
                cpu1 = time.process_time()
                seen = _consume(app, config.jobs, config.prefetch)
                cpu2, redis1 = time.process_time(), _redis_cpu_s(client)
                if sorted(seen) != job_ids:
                    raise RuntimeError(f"{mode}: {len(seen)} ids consumed, {len(set(seen))} distinct, of {config.jobs}")
                per_job = 1000 / config.jobs
                run = {"messages": messages, "publish_ms": round((cpu1 - cpu0) * per_job, 4),
                       "consume_ms": round((cpu2 - cpu1) * per_job, 4),
                       "redis_ms": round((redis1 - redis0) * per_job, 4)}
                run["total_ms"] = round(run["publish_ms"] + run["consume_ms"] + run["redis_ms"], 4)
                runs[mode].append(run)
                log(f"round {r + 1} {mode}: {messages} messages, CPU ms per job: publish {run['publish_ms']:.3f}, "
                    f"consume {run['consume_ms']:.3f}, redis {run['redis_ms']:.3f}")
    medians = {mode: {k: round(statistics.median(run[k] for run in runs[mode]), 4)
                      for k in ("publish_ms", "consume_ms", "redis_ms", "total_ms")} for mode in MODES}
    return {"benchmark": "messages", "config": asdict(config), "runs": runs, "medians": medians,
            "machine": {"cpu": cpu_summary(), "load_average_before": load_before,
                        "load_average_after": load_average(), "nproc": os.cpu_count()}}


def messages_table(result: dict):
    """A rich Table of a :func:`run_messages_bench` result: per mode, messages and the median CPU
    ms per job of each part, with the group mode's total as a ratio of the per-job mode's."""
    from rich.table import Table

    c, m = result["config"], result["machine"]
    table = Table(title=f"bench messages: {c['jobs']} jobs per mode and round, groups of {c['group']}, prefetch "
                        f"{c['prefetch']}, {c['rounds']} rounds (medians); load {m['load_average_before'][0]} → "
                        f"{m['load_average_after'][0]} on {m['nproc']} CPUs",
                  caption=f"{m['cpu']['name']} ({m['cpu']['isa']})")
    for column in ("mode", "messages", "publish CPU ms/job", "consume CPU ms/job", "redis-server CPU ms/job",
                   "total CPU ms/job", "vs per-job"):
        table.add_column(column, justify="right")
    base = result["medians"]["per-job"]["total_ms"]
    for mode in MODES:
        med = result["medians"][mode]
        table.add_row(mode, str(result["runs"][mode][0]["messages"]), f"{med['publish_ms']:.4f}",
                      f"{med['consume_ms']:.4f}", f"{med['redis_ms']:.4f}", f"{med['total_ms']:.4f}",
                      f"{med['total_ms'] / base:.2f}×" if base else "-")
    return table
