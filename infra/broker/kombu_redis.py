"""Every use of kombu's Redis transport internals, in one module (kombu >=5.7,<5.8).

Place in the data flow: beside the broker. Celery and kombu are used through their public API
everywhere else; what their public API cannot do is done here, against the private attributes
of ``kombu.transport.redis.Channel`` as kombu 5.7 has them. ``pyproject.toml`` bounds kombu
below 5.8, so an upgrade is a deliberate step that re-checks this module (its tests in
``tests/unit/infra`` exercise each patch against a real redis-server).

1. **Reading messages** (:func:`message_job_id`): the job id of a raw message in a queue list or
   in the ``unacked`` hash, from its task id header (``publish_jobs`` makes the task id the job
   id). The reaper, the queue depths and the tests all parse messages through it.
2. **Publishing many messages fast** (:func:`publish_by_template`): Celery builds one message per
   pool (``send_task``: headers, properties, body, queue declaration); the others are that message
   with the job id and delivery tag substituted, LPUSHed in pipelines. ``send_task`` costs
   ~240 µs of Python per message (2.4 s for 10,000), the substitution a few µs.
3. **A malformed-message guard** (:func:`install_malformed_message_guard`): a worker survives a
   message that is not a kombu envelope at all.
4. **Cheap acks** (:func:`install_cheap_acks`, :func:`batched_acks`): kombu's Redis channel
   builds a new ``redis.Redis`` client (on its shared connection pool) for every ack and every
   received message (``Channel.conn_or_acquire``), and each ack is its own ZREM + HDEL round
   trip (``QoS.ack``). The patch keeps one client per channel (rebuilt when kombu replaces its
   pool after a reconnect), and an ack made inside Celery's event loop (celery-batches' acks_late
   acks of a batch all run in one loop iteration) does kombu's own bookkeeping at once but
   reaches Redis with the others of that iteration, as one ZREM + one HDEL for all their
   delivery tags, from a callback the loop runs next (:func:`flush_acks`). An ack that never
   reaches Redis (the process dies in between) leaves an entry in the unacked hash, which the
   reaper clears or restores (``infra/broker/reaper.py``), as it does for any lost worker.

The guard, in detail. Celery already rejects what it can parse but does not accept: a pickle
body (JSON only), an unknown task name, a body that is not a task. Something that is not a kombu
envelope at all, though, such as a non-JSON string or a JSON value without ``properties`` pushed
straight onto a queue list, makes kombu's Redis channel raise inside the consumer's event loop,
and Celery ends the worker with "Unrecoverable error". The guard wraps the channel's two read
paths (``_brpop_read`` for the event loop, ``_get`` for polling): such a message, already popped
from the list, is logged with the start of its content and dropped, and the worker reads on.
Connection errors still propagate, since Celery's reconnection depends on them (all but
``KeyError``, which kombu lists among them but which here means a JSON value without
``properties``). Kombu's Redis transport is used for ``redis://`` and ``rediss://`` alike, so
one patch covers both. Job ids inside well-formed messages are checked later, in
:func:`worker.batch.job_ids_from_messages`.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils import json as kombu_json

log = logging.getLogger("renderfarm.broker")
_MARK = "_renderfarm_guarded"
#: Messages per pipelined round trip of :func:`publish_by_template`.
PUBLISH_CHUNK = 1000


# ---- 1. reading messages ---------------------------------------------------------------------
def message_job_id(raw: str | bytes | dict | list | None) -> str | None:
    """The job id of a kombu message: raw JSON text, or an already decoded envelope, or an
    ``unacked`` entry (``[message, exchange, routing_key]``). It is the task id header, which
    :func:`infra.broker.publish.publish_jobs` sets to the job id. None for anything that is not
    one of ours (never raises)."""
    try:
        message: Any = json.loads(raw) if isinstance(raw, (str, bytes)) else raw
        if isinstance(message, list):
            message = message[0]
        job_id = message["headers"]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return job_id if isinstance(job_id, str) else None


# ---- 2. publishing by template -------------------------------------------------------------
def publish_by_template(producer: Any, send: Callable[[str], None], job_ids: Sequence[str]) -> bool:
    """Publish one message per job id on kombu's Redis channel: ``send(job_ids[0])`` is captured
    instead of sent, and copies of it with each job id (and a fresh delivery tag) substituted are
    LPUSHed to the same list, :data:`PUBLISH_CHUNK` per pipelined round trip.

    ``send(job_id)`` must publish that job's message through ``producer`` (Celery's
    ``send_task``). Returns False, having published nothing, when ``producer``'s channel is not
    kombu's Redis channel; True when every message was published (by copies, or, when the
    captured message is not of the expected shape or its queue expires, by ``send`` for each).
    """
    channel = producer.channel
    if not job_ids or not all(hasattr(channel, a) for a in ("_put", "_q_for_pri", "_get_message_priority",
                                                             "conn_or_acquire")):
        return False
    captured: list[tuple[str, dict]] = []
    channel._put = lambda queue, message, **kwargs: captured.append((queue, message))  # this one call only
    try:
        send(job_ids[0])
    finally:
        del channel._put
    if len(captured) != 1 or (getattr(channel, "_expires", None) and captured[0][0] in channel._expires):
        if captured:  # not the shape expected: publish every message the regular way
            for job_id in job_ids:
                send(job_id)
        return bool(captured)
    queue, message = captured[0]
    key = channel._q_for_pri(queue, channel._get_message_priority(message, reverse=False))
    template_id, body, tag = job_ids[0], message["body"], message["properties"]["delivery_tag"]
    raw, body_text = kombu_json.dumps(message), base64.b64decode(body).decode()
    with channel.conn_or_acquire() as client:
        for start in range(0, len(job_ids), PUBLISH_CHUNK):
            pipe = client.pipeline(transaction=False)
            for job_id in job_ids[start:start + PUBLISH_CHUNK]:
                new_body = base64.b64encode(body_text.replace(template_id, job_id).encode()).decode()
                message = raw.replace(body, new_body).replace(tag, str(uuid.uuid4()))
                pipe.lpush(key, message.replace(template_id, job_id))
            pipe.execute()
    return True


# ---- 3. the malformed-message guard --------------------------------------------------------


def _guard(read, connection_errors_of, on_reject):
    @functools.wraps(read)
    def guarded(self, *args, **kwargs):
        try:
            return read(self, *args, **kwargs)
        except connection_errors_of(self):
            raise
        except kombu_redis.Empty:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a garbage message makes kombu raise
            log.error("rejected malformed message from the broker (not a kombu envelope): %s: %.200s",
                      type(exc).__name__, exc)
            return on_reject()

    setattr(guarded, _MARK, True)
    return guarded


def _connection_errors(channel) -> tuple[type[BaseException], ...]:
    # kombu counts KeyError among the Redis transport's connection errors, yet a JSON value
    # without "properties" raises exactly that: treat it as the message's fault, not the link's
    return tuple(e for e in channel.connection_errors if e is not KeyError)


def install_malformed_message_guard() -> None:
    """Wrap kombu's Redis channel read paths (idempotent; call before the worker connects)."""
    def consumed() -> bool:  # _brpop_read: the item was popped; the event loop issues the next BRPOP
        return True

    def nothing():  # _get: as if the queue had been empty
        raise kombu_redis.Empty()

    channel = kombu_redis.Channel
    for name, on_reject in (("_brpop_read", consumed), ("_get", nothing)):
        read = getattr(channel, name)
        if not getattr(read, _MARK, False):
            setattr(channel, name, _guard(read, _connection_errors, on_reject))


# ---- 4. cheap acks ---------------------------------------------------------------------------

_PENDING: dict[Any, list] = {}  # QoS → delivery tags acked in kombu's bookkeeping, not yet in Redis
_PENDING_LOCK = threading.Lock()
_CHEAP = "_renderfarm_cheap"


def flush_acks() -> int:
    """Send the deferred acks: one pipelined ZREM + HDEL per channel for all their delivery tags.
    Returns the number of tags sent. Called by the event loop (see :func:`install_cheap_acks`)
    and at the worker's exit.

    Never raises: this runs inside Celery's event loop, where an exception stops the worker. Acks
    of a channel that closed meanwhile (the connection to Redis was lost, and Celery reconnects on
    a new channel) or that Redis refused are dropped with a warning: their entries stay in kombu's
    unacked hash, where the reaper finds them orphaned (their jobs are running or done under
    their fenced attempts, so nothing renders twice)."""
    with _PENDING_LOCK:
        pending = dict(_PENDING)
        _PENDING.clear()
    sent = 0
    for qos, tags in pending.items():
        channel = qos.channel
        if getattr(channel, "connection", None) is None or getattr(channel, "closed", False):
            log.warning("dropping %d deferred ack(s) of a closed channel", len(tags))
            continue
        try:
            with channel.conn_or_acquire() as client:
                pipe = client.pipeline()
                pipe.zrem(qos.unacked_index_key, *tags)
                pipe.hdel(qos.unacked_key, *tags)
                pipe.execute()
        except Exception as exc:  # Redis down or restarting: see the docstring
            log.warning("dropping %d deferred ack(s): %s: %s", len(tags), type(exc).__name__, exc)
            continue
        sent += len(tags)
    return sent


def _cheap_ack(ack):
    @functools.wraps(ack)
    def cheap(self, delivery_tag):
        from kombu.asynchronous import get_event_loop

        hub = get_event_loop()
        if hub is None:  # no event loop to flush from: kombu's own ack, one round trip
            return ack(self, delivery_tag)
        with _PENDING_LOCK:
            first = not _PENDING
            _PENDING.setdefault(self, []).append(delivery_tag)
        kombu_redis.virtual.QoS.ack(self, delivery_tag)  # kombu's in-memory bookkeeping, at once
        if first:  # after the other acks that this loop iteration runs
            hub.call_soon(flush_acks)
        return None

    setattr(cheap, _CHEAP, True)
    return cheap


def _one_client(conn_or_acquire):
    @functools.wraps(conn_or_acquire)
    @contextlib.contextmanager
    def reuse(self, client=None):
        if client is not None:
            yield client
            return
        cached = self.__dict__.get("_renderfarm_client")
        if cached is None or cached.connection_pool is not self.pool:  # kombu replaced its pool
            cached = self.__dict__["_renderfarm_client"] = self._create_client()
        yield cached

    setattr(reuse, _CHEAP, True)
    return reuse


def install_cheap_acks() -> None:
    """One Redis client per kombu channel, and acks deferred to one pipelined round trip per
    event-loop iteration (idempotent; call before the worker connects)."""
    qos, channel = kombu_redis.QoS, kombu_redis.Channel
    if not getattr(qos.ack, _CHEAP, False):
        qos.ack = _cheap_ack(qos.ack)
    if not getattr(channel.conn_or_acquire, _CHEAP, False):
        channel.conn_or_acquire = _one_client(channel.conn_or_acquire)
