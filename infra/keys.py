"""Every Redis key and every kombu name the farm reads or writes, in one place.

Place in the data flow: beside it. Each stage names its keys through the functions here
(submission and the job-state store, the dispatcher's wait lanes, the broker lists, the worker
registry, metrics, API keys, rate limits, webhooks, the catalog index), so that a key is spelled
once and a reader can see the whole keyspace on one page.

Farm keys start with :data:`PREFIX` (``rf:``). The broker's own keys are kombu's Redis transport
names (``renderfarm.<pool>`` lists, ``unacked``, ``unacked_index``); kombu's other internals are
used only in :mod:`infra.broker.kombu_redis`.

=================================  ==========  =========================================================
key                                type        holds
=================================  ==========  =========================================================
rf:job:{s}:{id}                    hash        one job's record (:mod:`infra.state.job_records`)
rf:batch:{s}:{id}                  hash        a batch's created_at, total, priority, tenant, webhook_url
rf:batch:{s}:{id}:jobs             list        its job ids in submission order
rf:batch:{s}:{id}:counts           hash        one counter per state, and ``done`` = Σ progress
rf:batches:{tenant}:{s}            zset        a tenant's newest batch ids → created_at (one shard)
rf:leases:{s}                      zset        running job id → lease_until (server clock)
rf:pending:{s}                     zset        queued job id → when its message was last (re)published
rf:dead:{s}                        zset        failed job id → when it failed (the dead-letter set)
rf:dead:{tenant}:{s}               zset        the same, one tenant's jobs only (its dead-letter pages)
rf:quota:{tenant}                  hash        jobs, GPU-seconds, bytes a tenant reserved (:mod:`infra.state.quota`)
rf:quota:{tenant}:{s}              hash        what its ended jobs of shard s gave back (negative)
rf:idem:{s}:{tenant}:{key}         string      an idempotency key → its batch id, or "claim:{batch id}"
                                               while its submission is in flight (short expiry)
rf:ack                             string      durable-ack marker: INCR then WAITAOF on one connection
rf:wait:pools                      set         pools with waiting jobs (:mod:`infra.broker.lanes`)
rf:wait:lanes:{pool}               set         "{tenant}:{priority}" of the pool's non-empty lanes
rf:wait:{pool}:{tenant}:{p}        list        "{enqueued ms}:{job id}:{cost_s}", oldest first
rf:wait:popped:{pool}              zset        ids popped from the lanes, not yet in rf:pending
rf:wfq:{pool}                      hash        tenant → pass, "_vt" → virtual time (fair share)
rf:dispatch:lock:{pool}            string      one dispatcher per pool at a time
rf:reaper:lock                     string      one reaper sweep at a time
rf:{workers}                       zset        worker name → last heartbeat (:mod:`infra.state.registry`)
rf:{workers}:{name}                hash        a worker's self-description (JSON fields)
rf:{metrics}:pools                 set         pools that recorded metrics (:mod:`infra.state.metrics`)
rf:{metrics}:{pool}                hash        histogram buckets and sums, image counters
rf:{metrics}:tput:{pool}:{minute}  string      images succeeded in that epoch minute
rf:{metrics}:wtput:{w}:{minute}    string      the same, per worker
rf:catalog:{tenant}                hash        catalog key → job (:mod:`infra.state.catalog_index`)
rf:{auth}:apikey:{sha256}          hash        one API key's tenant, id, name (:mod:`infra.api.auth`)
rf:{auth}:apikeys                  hash        key id → sha256
rf:{auth}:tenant:{tenant}:keys     set         a tenant's key ids
rf:tenant:{tenant}:webhook_secret  string      its webhook signing secret (:mod:`infra.api.webhooks.signing`)
rf:rl:{tenant}:{kind}              hash        a token bucket (:mod:`infra.api.limits`)
rf:webhooks:pending                zset        batch id → when to look at its webhook next
rf:webhook:{batch}                 hash        a batch's webhook body and outcome
rf:webhook:{batch}:lock            string      the delivery claim
rf:test:renders / writes           hash        fault-injection counters (tests only, worker.faults)
rf:{stack}:down                    hash        ``renderfarm up``: service → JSON of its exit, while it is down
rf:{stack}:events                  stream      ``renderfarm up``: its supervisor's events, newest 200
renderfarm.{pool}[:{n}]            list        kombu: a pool's queued messages, one list per priority
unacked / unacked_index            hash/zset   kombu: delivered, unacknowledged messages
=================================  ==========  =========================================================

Redis Cluster: a name's part in braces is its hash tag (only it picks the slot). ``{s}`` is a
job's or batch's *shard*, two hex digits (:func:`shard`, 256 shards): a job id starts with its
batch id's shard, so a job, its batch and the shard ``s`` of every index it is listed in share a
slot, and each transition script (:mod:`infra.state.scripts`) runs in one slot. Readers of an
index iterate its :data:`SHARDS`. A pool's dispatch keys share the tag ``{pool}``; workers,
metrics, API keys and the local stack's keys each share one tag. The kombu lists live on the broker's own Redis.
In the table ``{x}`` stands for a value; the braces of ``{s}`` and ``{pool}`` (where it ends a
name or precedes ``:{tenant}``), ``{workers}``, ``{metrics}``, ``{auth}`` and ``{stack}`` are literal: hash tags.
"""

from __future__ import annotations

import zlib

PREFIX = "rf:"
#: Shards of every farm-wide index (:func:`shard`): 256, each a two-hex-digit hash tag.
SHARDS = tuple(f"{n:02x}" for n in range(256))
_SHARD_SET = frozenset(SHARDS)  # a set lookup: shard() runs several times per job of a submission


def shard(entity_id: str) -> str:
    """The shard of a job or batch id: its first two characters when they are lowercase hex (a
    farm id, :func:`infra.submission.submitter.new_id`, whose job ids start with their batch's shard),
    else two hex digits of its CRC-32 (ids written by hand in tests and tools)."""
    head = entity_id[:2]
    return head if head in _SHARD_SET else f"{zlib.crc32(entity_id.encode()) & 0xFF:02x}"


def idempotency_shard(tenant: str, key: str) -> str:
    """The shard a tenant's idempotency key lives in; the batch it creates gets an id in it."""
    return f"{zlib.crc32(f'{tenant}:{key}'.encode()) & 0xFF:02x}"


# ---- jobs and batches (infra.state.job_records) -------------------------------------------------
#: A counter written just before a durable-ack wait, on the waiting connection (infra.state.durable).
DURABLE_ACK = f"{PREFIX}ack"


def job(job_id: str) -> str:
    """A job's record hash, in its shard's slot."""
    return f"{PREFIX}job:{{{shard(job_id)}}}:{job_id}"


def batch(batch_id: str) -> str:
    """A batch's own hash, in its shard's slot."""
    return f"{PREFIX}batch:{{{shard(batch_id)}}}:{batch_id}"


def batch_jobs(batch_id: str) -> str:
    """A batch's job ids, in submission order."""
    return f"{batch(batch_id)}:jobs"


def batch_counts(batch_id: str) -> str:
    """A batch's per-state counters."""
    return f"{batch(batch_id)}:counts"


def leases(s: str) -> str:
    """Shard ``s`` of the running jobs' leases (job id → lease_until)."""
    return f"{PREFIX}leases:{{{s}}}"


def pending(s: str) -> str:
    """Shard ``s`` of the published, still queued jobs (job id → when last (re)published)."""
    return f"{PREFIX}pending:{{{s}}}"


def dead(s: str) -> str:
    """Shard ``s`` of the farm-wide dead-letter set (failed job id → when it failed)."""
    return f"{PREFIX}dead:{{{s}}}"


def dead_of(tenant: str, s: str) -> str:
    """Shard ``s`` of a tenant's own dead-letter index."""
    return f"{PREFIX}dead:{tenant}:{{{s}}}"


def recent_batches(tenant: str, s: str) -> str:
    """Shard ``s`` of a tenant's newest batch ids."""
    return f"{PREFIX}batches:{tenant}:{{{s}}}"


def idempotency(tenant: str, key: str) -> str:
    """A tenant's idempotency key → the batch it created (``IDEM_CLAIM`` + batch id while in flight),
    in the slot of :func:`idempotency_shard` (the batch's own shard)."""
    return f"{PREFIX}idem:{{{idempotency_shard(tenant, key)}}}:{tenant}:{key}"


#: Value prefix of an idempotency key whose submission is still being written.
IDEM_CLAIM = "claim:"


# ---- the wait lanes (infra.broker.lanes) and the dispatcher's (infra.broker.dispatch) --------
WAIT_POOLS = f"{PREFIX}wait:pools"


def lanes(pool: str) -> str:
    """The set of a pool's non-empty lanes (members ``{tenant}:{priority}``)."""
    return f"{PREFIX}wait:lanes:{{{pool}}}"


def lane_prefix(pool: str) -> str:
    """The common start of a pool's wait lanes' names (the pool is their hash tag)."""
    return f"{PREFIX}wait:{{{pool}}}:"


def lane(pool: str, member: str) -> str:
    """One wait lane of a pool; ``member`` is ``{tenant}:{priority}``."""
    return f"{lane_prefix(pool)}{member}"


def popped(pool: str) -> str:
    """Ids the dispatch script popped from a pool's lanes, not yet indexed in ``rf:pending``."""
    return f"{PREFIX}wait:popped:{{{pool}}}"


def wfq(pool: str) -> str:
    """A pool's fair-share state (tenant passes and virtual time)."""
    return f"{PREFIX}wfq:{{{pool}}}"


def dispatch_lock(pool: str) -> str:
    """The lock one dispatcher holds while it feeds a pool's queue."""
    return f"{PREFIX}dispatch:lock:{pool}"


REAPER_LOCK = f"{PREFIX}reaper:lock"

# ---- workers (infra.state.registry): one slot ----------------------------------------------
WORKERS = f"{PREFIX}{{workers}}"


def worker(name: str) -> str:
    """A worker's self-description hash (in the slot of :data:`WORKERS`)."""
    return f"{WORKERS}:{name}"


# ---- metrics (infra.state.metrics): one slot -----------------------------------------------
_METRICS = f"{PREFIX}{{metrics}}"
METRICS_POOLS = f"{_METRICS}:pools"


def metrics(pool: str) -> str:
    """A pool's histogram buckets, sums and image counters."""
    return f"{_METRICS}:{pool}"


def pool_throughput(pool: str, minute: int) -> str:
    """Images a pool finished in one epoch minute."""
    return f"{_METRICS}:tput:{pool}:{minute}"


def worker_throughput(worker_name: str, minute: int) -> str:
    """Images a worker finished in one epoch minute."""
    return f"{_METRICS}:wtput:{worker_name}:{minute}"


# ---- the catalog index (infra.state.catalog_index) -----------------------------------------------
def catalog(tenant: str) -> str:
    """A tenant's catalog index: catalog key → job."""
    return f"{PREFIX}catalog:{tenant}"


# ---- API keys and rate limits (infra.api.auth, infra.api.limits): keys in one slot ---------
_AUTH = f"{PREFIX}{{auth}}"
API_KEYS = f"{_AUTH}:apikeys"


def api_key(digest: str) -> str:
    """One stored API key, by the SHA-256 of the key."""
    return f"{_AUTH}:apikey:{digest}"


def tenant_keys(tenant: str) -> str:
    """A tenant's API key ids."""
    return f"{_AUTH}:tenant:{tenant}:keys"


def webhook_secret(tenant: str) -> str:
    """A tenant's webhook signing secret."""
    return f"{PREFIX}tenant:{tenant}:webhook_secret"


def quota(tenant: str) -> str:
    """What a tenant reserved: jobs, estimated GPU-seconds and bytes of job records (submission adds,
    a failed one takes back)."""
    return f"{PREFIX}quota:{tenant}"


def quota_holds(tenant: str) -> str:
    """Reservations waiting for their batch to be recorded (zset: ``batch|jobs|gpu_s|bytes`` → deadline,
    Redis seconds), tagged with the whole :func:`quota` key so both share its slot."""
    return f"{{{quota(tenant)}}}:holds"


#: Tenants that may have holds (set), swept by the reaper.
QUOTA_HOLDERS = f"{PREFIX}quota-holders"


def quota_returned(tenant: str, s: str) -> str:
    """What the tenant's jobs of shard ``s`` gave back when they ended (negative counts; a
    dead-letter retry takes it again). Outstanding = :func:`quota` + Σ over the shards."""
    return f"{PREFIX}quota:{tenant}:{{{s}}}"


def rate_bucket(tenant: str, kind: str) -> str:
    """A tenant's token bucket of one kind (``requests`` or ``jobs``)."""
    return f"{PREFIX}rl:{tenant}:{kind}"


# ---- webhooks (infra.api.webhooks.delivery) ---------------------------------------------------------
WEBHOOKS_PENDING = f"{PREFIX}webhooks:pending"


def webhook(batch_id: str) -> str:
    """A batch's webhook body and outcome."""
    return f"{PREFIX}webhook:{batch_id}"


def webhook_lock(batch_id: str) -> str:
    """The claim of a batch's webhook delivery."""
    return f"{webhook(batch_id)}:lock"


# ---- fault-injection counters (tests only: worker.faults) ----------------------------------
TEST_RENDERS = f"{PREFIX}test:renders"
TEST_WRITES = f"{PREFIX}test:writes"

# ---- the local stack's supervisor (infra.localstack.events; read by /healthz) ---------------
STACK_DOWN = f"{PREFIX}{{stack}}:down"
STACK_EVENTS = f"{PREFIX}{{stack}}:events"

# ---- kombu's Redis transport (infra.broker) ------------------------------------------------
QUEUE_PREFIX = "renderfarm."
#: Separator of a queue name and its priority level in kombu's list names.
PRIORITY_SEP = ":"
#: kombu: delivery tag → [message, exchange, routing key] of delivered, unacked messages.
UNACKED = "unacked"
#: kombu: delivery tag → when it was delivered.
UNACKED_INDEX = "unacked_index"


def queue(pool: str) -> str:
    """The Celery queue a pool's workers consume: ``renderfarm.{pool}``."""
    return f"{QUEUE_PREFIX}{pool}"


def broker_list(pool: str, level: int) -> str:
    """The kombu list of a pool's queue at one broker priority level (0 = the queue's own name)."""
    return queue(pool) if level == 0 else f"{queue(pool)}{PRIORITY_SEP}{level}"


def pool_of_broker_list(key: str) -> str | None:
    """The pool a kombu list name belongs to, or None for another key."""
    if not key.startswith(QUEUE_PREFIX):
        return None
    return key[len(QUEUE_PREFIX):].split(PRIORITY_SEP, 1)[0] or None
