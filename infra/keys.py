"""Every Redis key and every kombu name the farm reads or writes, in one place.

Place in the data flow: beside it. Each stage names its keys through the functions here
(submission and the job-state store, the dispatcher's wait lanes, the broker lists, the worker
registry, metrics, API keys, rate limits, webhooks, the catalog index), so that a key is spelled
once and a reader can see the whole keyspace on one page.

Farm keys start with :data:`PREFIX` (``rf:``). The broker's own keys are kombu's Redis transport
names (``renderfarm.<pool>`` lists, ``unacked``, ``unacked_index``); kombu's other internals are
used only in :mod:`infra.broker.kombu_redis`.

=============================  ==========  =============================================================
key                            type        holds
=============================  ==========  =============================================================
rf:job:{id}                    hash        one job's record (:mod:`infra.state.jobs`)
rf:batch:{id}                  hash        a batch's created_at, total, priority, tenant, webhook_url
rf:batch:{id}:jobs             list        its job ids in submission order
rf:batch:{id}:counts           hash        one counter per state, and ``done`` = Σ progress
rf:batches:{tenant}            zset        a tenant's newest batch ids → created_at
rf:leases                      zset        running job id → lease_until (server clock)
rf:pending                     zset        queued job id → when its message was last (re)published
rf:dead                        zset        failed job id → when it failed (the dead-letter set, farm-wide)
rf:dead:{tenant}               zset        the same, one tenant's jobs only (its dead-letter pages)
rf:ack                         string      durable-ack marker: INCR then WAITAOF on one connection
rf:migrations                  hash        one-time data migrations done → when (:mod:`infra.state.jobs`)
rf:idem:{tenant}:{key}         string      an idempotency key → its batch id, or "claim:{batch id}"
                                           while its submission is in flight (short expiry)
rf:wait:pools                  set         pools with waiting jobs (:mod:`infra.broker.dispatch`)
rf:wait:lanes:{pool}           set         "{tenant}:{priority}" of the pool's non-empty lanes
rf:wait:{pool}:{tenant}:{p}    list        "{enqueued ms}:{job id}", oldest first
rf:wfq:{pool}                  hash        tenant → pass, "_vt" → virtual time (fair share)
rf:dispatch:lock:{pool}        string      one dispatcher per pool at a time
rf:reaper:lock                 string      one reaper sweep at a time
rf:workers                     zset        worker name → last heartbeat (:mod:`infra.state.registry`)
rf:worker:{name}               hash        a worker's self-description (JSON fields)
rf:metrics:pools               set         pools that recorded metrics (:mod:`infra.state.metrics`)
rf:metrics:{pool}              hash        histogram buckets and sums, image counters
rf:tput:{pool}:{minute}        string      images succeeded in that epoch minute
rf:wtput:{worker}:{minute}     string      the same, per worker
rf:catalog:{tenant}            hash        catalog key → job (:mod:`infra.state.catalog`)
rf:apikey:{sha256}             hash        one API key's tenant, id, name (:mod:`infra.api.auth`)
rf:apikeys                     hash        key id → sha256
rf:tenant:{tenant}:keys        set         a tenant's key ids
rf:tenant:{tenant}:webhook_secret  string  its webhook signing secret (:mod:`infra.api.webhook_secrets`)
rf:rl:{tenant}:{kind}          hash        a token bucket (:mod:`infra.api.limits`)
rf:quota:{tenant}              hash        outstanding jobs and GPU-seconds (:mod:`infra.state.quota`)
rf:webhooks:pending            zset        batch id → when to look at its webhook next
rf:webhook:{batch}             hash        a batch's webhook body and outcome
rf:webhook:{batch}:lock        string      the delivery claim
rf:test:renders / writes       hash        fault-injection counters (tests only, worker.faults)
renderfarm.{pool}[:{n}]        list        kombu: a pool's queued messages, one list per priority
unacked / unacked_index        hash/zset   kombu: delivered, unacknowledged messages
=============================  ==========  =============================================================
"""

from __future__ import annotations

PREFIX = "rf:"

# ---- jobs and batches (infra.state.jobs) ---------------------------------------------------
LEASES = f"{PREFIX}leases"
PENDING = f"{PREFIX}pending"
DEAD = f"{PREFIX}dead"
JOB_PREFIX = f"{PREFIX}job:"
MIGRATIONS = f"{PREFIX}migrations"
#: A counter written just before a durable-ack wait, on the waiting connection (infra.state.durable).
DURABLE_ACK = f"{PREFIX}ack"


def job(job_id: str) -> str:
    """A job's record hash."""
    return f"{JOB_PREFIX}{job_id}"


def batch(batch_id: str) -> str:
    """A batch's own hash."""
    return f"{PREFIX}batch:{batch_id}"


def batch_jobs(batch_id: str) -> str:
    """A batch's job ids, in submission order."""
    return f"{batch(batch_id)}:jobs"


def batch_counts(batch_id: str) -> str:
    """A batch's per-state counters."""
    return f"{batch(batch_id)}:counts"


def dead_of(tenant: str) -> str:
    """A tenant's own dead-letter index (its failed job ids → when they failed)."""
    return f"{DEAD}:{tenant}"


def recent_batches(tenant: str) -> str:
    """A tenant's newest batch ids."""
    return f"{PREFIX}batches:{tenant}"


def idempotency(tenant: str, key: str) -> str:
    """A tenant's idempotency key → the batch it created (``IDEM_CLAIM`` + batch id while in flight)."""
    return f"{PREFIX}idem:{tenant}:{key}"


#: Value prefix of an idempotency key whose submission is still being written.
IDEM_CLAIM = "claim:"


# ---- the dispatcher's wait lanes (infra.broker.dispatch) -----------------------------------
WAIT_POOLS = f"{PREFIX}wait:pools"
WAIT_PREFIX = f"{PREFIX}wait:"


def lanes(pool: str) -> str:
    """The set of a pool's non-empty lanes (members ``{tenant}:{priority}``)."""
    return f"{WAIT_PREFIX}lanes:{pool}"


def lane(pool: str, member: str) -> str:
    """One wait lane of a pool; ``member`` is ``{tenant}:{priority}``."""
    return f"{WAIT_PREFIX}{pool}:{member}"


def wfq(pool: str) -> str:
    """A pool's fair-share state (tenant passes and virtual time)."""
    return f"{PREFIX}wfq:{pool}"


def dispatch_lock(pool: str) -> str:
    """The lock one dispatcher holds while it feeds a pool's queue."""
    return f"{PREFIX}dispatch:lock:{pool}"


REAPER_LOCK = f"{PREFIX}reaper:lock"

# ---- workers (infra.state.registry) --------------------------------------------------------
WORKERS = f"{PREFIX}workers"


def worker(name: str) -> str:
    """A worker's self-description hash."""
    return f"{PREFIX}worker:{name}"


# ---- metrics (infra.state.metrics) ---------------------------------------------------------
METRICS_POOLS = f"{PREFIX}metrics:pools"


def metrics(pool: str) -> str:
    """A pool's histogram buckets, sums and image counters."""
    return f"{PREFIX}metrics:{pool}"


def pool_throughput(pool: str, minute: int) -> str:
    """Images a pool finished in one epoch minute."""
    return f"{PREFIX}tput:{pool}:{minute}"


def worker_throughput(worker_name: str, minute: int) -> str:
    """Images a worker finished in one epoch minute."""
    return f"{PREFIX}wtput:{worker_name}:{minute}"


# ---- the catalog index (infra.state.catalog) -----------------------------------------------
def catalog(tenant: str) -> str:
    """A tenant's catalog index: catalog key → job."""
    return f"{PREFIX}catalog:{tenant}"


# ---- API keys and rate limits (infra.api.auth, infra.api.limits) ---------------------------
API_KEYS = f"{PREFIX}apikeys"


def api_key(digest: str) -> str:
    """One stored API key, by the SHA-256 of the key."""
    return f"{PREFIX}apikey:{digest}"


def tenant_keys(tenant: str) -> str:
    """A tenant's API key ids."""
    return f"{PREFIX}tenant:{tenant}:keys"


def webhook_secret(tenant: str) -> str:
    """A tenant's webhook signing secret."""
    return f"{PREFIX}tenant:{tenant}:webhook_secret"


def quota(tenant: str) -> str:
    """A tenant's outstanding jobs and estimated GPU-seconds."""
    return f"{PREFIX}quota:{tenant}"


def rate_bucket(tenant: str, kind: str) -> str:
    """A tenant's token bucket of one kind (``requests`` or ``jobs``)."""
    return f"{PREFIX}rl:{tenant}:{kind}"


# ---- webhooks (infra.api.webhooks) ---------------------------------------------------------
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
