"""The reaper: puts back to work the jobs a dead worker held, and the jobs whose message is lost.

Data flow: job-state store (``rf:leases``, ``rf:pending``, each in 256 shards read in one round
trip, :mod:`infra.state.shards`) → **reaper** → the pool queues (fresh
Celery messages). It runs as a background thread of the status API (started in its lifespan)
and standalone as ``renderfarm reaper``; any number may run at once.

One sweep (every ``reaper_interval_s`` seconds):

1. **Expired leases.** A running job's lease is renewed by its worker's progress writes and
   heartbeat; a killed worker stops renewing. Every job in ``rf:leases`` whose lease ran out
   (Redis server clock) is moved back to ``queued`` (attempt number kept) and republished at
   ``high`` priority, since it had reached the head of its queue once already; when
   its attempts are spent it fails with a ``WorkerLost`` error into the dead-letter set.
   With the defaults (lease 20 s, sweep every 5 s) a killed worker's running jobs are back in
   the queue within 25 s.
2. **Lost messages.** A job recorded as ``queued`` whose message went missing (the publish
   failed after the records were written, or a killed worker had prefetched it) would wait
   forever. Every job in ``rf:pending`` last published more than ``republish_after_s`` ago is
   looked for in the pool's queue lists and in the ``reserved_jobs`` that live workers report
   in their heartbeats; those found nowhere are republished. A duplicate message is harmless:
   the start script runs a job only from ``queued`` (or from ``running`` with an expired
   lease), so a second message for a running or finished job is acknowledged and skipped.
3. **Orphaned unacked messages.** A killed worker's unacknowledged messages would sit in
   kombu's ``unacked`` hash until Celery's 12-hour visibility timeout and inflate the
   ``reserved`` count of ``/v1/queues`` meanwhile. Entries for jobs that are finished, unknown,
   or held by no live worker for longer than a lease are deleted (the reaper has already
   republished what still has to run).
4. **Gone workers' names.** Workers not heard from for ``heartbeat_ttl_s`` leave the registry's
   sorted set (:func:`infra.state.registry.prune`), so that reading it (``/healthz``,
   ``/v1/workers``, the dispatcher) never has to write.

Safety with several reapers: every state change is one Lua script per job that re-checks its
condition (a job is requeued at most once per expiry), and a short Redis lock
(``rf:reaper:lock``, :class:`infra.background.RedisLock`) lets one reaper sweep at a time, so two
reapers do not both republish the same lost message.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import redis
from celery import Celery

from infra import keys
from infra.background import PeriodicLoop, RedisLock
from infra.broker.kombu_redis import message_job_id
from infra.broker.publish import republish
from infra.broker.shards import BROKER_ERRORS, Brokers
from infra.settings import Settings
from infra.state import registry
from infra.state.connect import redis_client, state_client
from infra.state.job_store import JobStore
from infra.state.quota import Quotas

log = logging.getLogger("renderfarm.reaper")

_TERMINAL = {"succeeded", "failed", "canceled"}
#: Recovered jobs had reached the head of their queue once (or waited past republish_after_s):
#: they go back at the front, not behind everything submitted since.
RECOVERY_PRIORITY = "high"


def queued_job_ids(client: redis.Redis, chunk: int = 1000) -> set[str]:
    """Job ids of every message waiting in a pool queue (all priority levels)."""
    found: set[str] = set()
    for key in client.scan_iter(match=f"{keys.QUEUE_PREFIX}*", count=1000):
        if client.type(key) not in ("list", b"list"):
            continue
        start = 0
        while True:
            items = client.lrange(key, start, start + chunk - 1)
            found.update(j for j in map(message_job_id, items) if j)
            if len(items) < chunk:
                break
            start += chunk
    return found


@dataclass
class SweepReport:
    """What one sweep did: job ids requeued, failed (attempts spent), republished (lost
    messages), the number of orphaned unacked messages deleted, of quota reservations given
    back (their batch never recorded) and of gone workers' names pruned from the registry.
    ``skipped`` when another reaper held the lock."""

    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    republished: list[str] = field(default_factory=list)
    orphans_removed: int = 0
    quota_given_back: int = 0
    workers_pruned: int = 0
    skipped: bool = False


class Reaper:
    """Recovers jobs of dead workers and jobs with lost messages, and gives back the quota
    reservations of submissions that died before their batch was recorded.

    Args:
        store: the job-state store (its ``lease_s`` and ``max_attempts`` apply).
        app: the Celery app that republishes messages.
        interval_s: seconds between sweeps.
        republish_after_s: a queued job whose message was last published longer ago than this,
            seconds, and is in no queue nor held by a live worker, is republished.
        heartbeat_ttl_s: a worker not heard from for this long is dead (as in the registry).
        broker: the broker's Redis (its queue lists and ``unacked``); None: the store's.
        brokers: the farm's brokers when pools name broker shards (:mod:`infra.broker.shards`):
            every broker's queues and ``unacked`` are swept, and each job goes back to its pool's
            broker; None: ``app`` and ``broker`` serve every pool.
    """

    def __init__(self, store: JobStore, app: Celery, *, interval_s: float = 5.0,
                 republish_after_s: float = 30.0, heartbeat_ttl_s: float = 20.0, broker: redis.Redis | None = None,
                 brokers: Brokers | None = None):
        self.store = store
        self.r = store.r
        self.brokers = brokers or Brokers.single(app, broker if broker is not None else store.r)
        self.interval_s = interval_s
        self.republish_after_s = republish_after_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._locks = RedisLock(self.r)
        self._quotas = Quotas(self.r)
        self.loop = PeriodicLoop("renderfarm-reaper", self.sweep, interval_s, log)

    # ---- one sweep --------------------------------------------------------------------------
    def sweep(self) -> SweepReport:
        """One pass over expired leases, lost messages, orphaned unacked messages and gone workers.

        Raises:
            redis.RedisError: Redis is unreachable (the loop logs it and tries again).
        """
        with self._locks.hold(keys.REAPER_LOCK, int(max(2 * self.interval_s, 10.0) * 1000)) as held:
            if not held:
                return SweepReport(skipped=True)
            report = SweepReport()
            self._requeue_expired(report)
            self._republish_lost(report)
            self._remove_orphans(report)
            report.quota_given_back = self._quotas.reclaim_abandoned(lambda b: bool(self.store.batch_meta(b)))
            if report.quota_given_back:
                log.warning("gave back %d quota reservation(s) of batches never recorded", report.quota_given_back)
            report.workers_pruned = registry.prune(self.r, self.heartbeat_ttl_s)
            return report

    def _requeue_expired(self, report: SweepReport) -> None:
        expired = self.store.expired_leases()
        if not expired:
            return
        for job_id, (state, _pool) in self.store.requeue_expired(expired).items():
            (report.requeued if state == "queued" else report.failed).append(job_id)
        if report.requeued:
            republish(self.store, self.brokers, report.requeued, priority=RECOVERY_PRIORITY)
            log.warning("requeued %d job(s) whose worker stopped renewing its lease", len(report.requeued))
        if report.failed:
            log.error("%d job(s) failed after their last attempt's worker was lost: %s", len(report.failed),
                      report.failed[:10])

    def _held_by_live_workers(self) -> set[str]:
        held: set[str] = set()
        for worker in registry.live_workers(self.r, self.heartbeat_ttl_s):
            held.update(worker.get("reserved_jobs") or [])
            held.update(worker.get("current_jobs") or [])
        return held

    def _republish_lost(self, report: SweepReport) -> None:
        stale = self.store.stale_pending(self.republish_after_s)
        if not stale:
            return
        routes = {job_id: (state, pool) for job_id, state, pool, _ in self.store.routes(stale)}
        for job_id in stale:
            if job_id not in routes:
                self.store.forget(job_id)  # its record expired
        seen = self._held_by_live_workers()
        unreachable: set[str | None] = set()  # brokers whose queues cannot be read now: their jobs wait
        for broker in self.brokers.all():
            try:
                seen |= queued_job_ids(broker.client)
            except BROKER_ERRORS as exc:
                unreachable.add(broker.name)
                log.warning("broker %s cannot be reached; its lost messages wait: %s", broker.name or "(default)", exc)
        lost = [j for j in stale if routes.get(j, ("", ""))[0] == "queued" and j not in seen
                and self.brokers.for_pool(routes[j][1]).name not in unreachable]
        self.store.mark_published([j for j in stale if j in seen])
        if lost:
            republish(self.store, self.brokers, lost, priority=RECOVERY_PRIORITY)
            report.republished = lost
            log.warning("republished %d queued job(s) whose message was lost", len(lost))

    def _remove_orphans(self, report: SweepReport) -> None:
        live: tuple[set[str], float] | None = None  # held jobs and the delivery cutoff: read once a sweep
        for broker in self.brokers.all():
            try:
                entries = broker.client.hgetall(keys.UNACKED)
                delivered = dict(zip(entries, broker.client.zmscore(keys.UNACKED_INDEX, list(entries)))) \
                    if entries else {}
            except BROKER_ERRORS as exc:
                log.warning("broker %s cannot be reached; its unacked entries wait: %s", broker.name or "(default)",
                            exc)
                continue
            if not entries:
                continue
            if live is None:
                live = (self._held_by_live_workers(),
                        self.store.server_time() - max(self.store.lease_s, self.heartbeat_ttl_s))
            orphans = self._orphans(entries, delivered, *live)
            if not orphans:
                continue
            try:
                pipe = broker.client.pipeline(transaction=True)
                pipe.hdel(keys.UNACKED, *orphans)
                pipe.zrem(keys.UNACKED_INDEX, *orphans)
                pipe.execute()
            except BROKER_ERRORS as exc:
                log.warning("broker %s cannot be reached; its unacked entries wait: %s", broker.name or "(default)",
                            exc)
                continue
            report.orphans_removed += len(orphans)
        if report.orphans_removed:
            log.info("removed %d orphaned unacked message(s)", report.orphans_removed)

    def _orphans(self, entries: dict[str, str], delivered: dict[str, float | None], held: set[str],
                 old: float) -> list[str]:
        """The delivery tags of ``entries`` (one broker's ``unacked``) whose job ended or is gone,
        or was delivered before ``old`` (server epoch s) and is held by no live worker."""
        job_of = {tag: message_job_id(raw) for tag, raw in entries.items()}
        states = {job_id: state for job_id, state, _, _ in self.store.routes([j for j in job_of.values() if j])}
        orphans = []
        for tag, job_id in job_of.items():
            if job_id is None:
                continue
            state = states.get(job_id)
            if state is None or state in _TERMINAL:
                orphans.append(tag)
            elif job_id not in held and (delivered.get(tag) or 0) < old:
                orphans.append(tag)
        return orphans

    # ---- running ----------------------------------------------------------------------------
    def run(self) -> None:
        """Sweep every ``interval_s`` seconds until :meth:`stop` (blocks); errors are logged."""
        self.loop.run()

    def start(self) -> "Reaper":
        """Sweep in a daemon thread."""
        self.loop.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread started by :meth:`start` (waits at most ``timeout`` seconds)."""
        self.loop.stop(timeout)


def from_settings(settings: Settings, client: redis.Redis | None = None, app: Celery | None = None,
                  broker: redis.Redis | None = None) -> Reaper:
    """A reaper configured by :class:`infra.settings.Settings` (its own state-store client,
    broker client and Celery app unless given, and every broker shard a pool names)."""
    client = client or state_client(settings.state_url)
    if broker is None:
        broker = redis_client(settings.redis_url) if settings.state_redis_url else client
    store = JobStore(client, job_ttl_s=settings.job_ttl_s, lease_s=settings.lease_s,
                     max_attempts=settings.max_attempts)
    brokers = Brokers.from_settings(settings, app, broker)
    return Reaper(store, brokers.default.app, interval_s=settings.reaper_interval_s,
                  republish_after_s=settings.republish_after_s, heartbeat_ttl_s=settings.heartbeat_ttl_s,
                  brokers=brokers)


def run_reaper(args: argparse.Namespace) -> int:
    """``renderfarm reaper``: sweep until interrupted. Returns the exit status."""
    from infra.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    if args.interval is not None:
        settings = settings.model_copy(update={"reaper_interval_s": args.interval})
    reaper = from_settings(settings)
    log.info("reaper: every %.1fs, leases of %.0fs, republish after %.0fs", reaper.interval_s,
             reaper.store.lease_s, reaper.republish_after_s)
    try:
        reaper.run()
    except KeyboardInterrupt:
        pass
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm reaper`` to the CLI."""
    p = subparsers.add_parser("reaper", help="recover jobs of dead workers and lost messages (standalone)")
    p.add_argument("--interval", type=float, default=None, help="seconds between sweeps (default: setting)")
    p.set_defaults(func=run_reaper)
