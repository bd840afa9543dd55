"""A guard at the broker edge: a malformed message never crashes the worker.

Data flow: Redis queue → kombu's Redis channel → **here** → Celery's consumer → the batch task.

Celery already rejects what it can parse but does not accept: a pickle body (JSON only), an
unknown task name, a body that is not a task. Something that is not a kombu envelope at all,
though, such as a non-JSON string or a JSON value without ``properties`` pushed straight onto a
queue list, makes kombu's Redis channel raise inside the consumer's event loop, and Celery
ends the worker with "Unrecoverable error". This guard wraps the channel's two read paths
(``_brpop_read`` for the event loop, ``_get`` for polling): such a message, already popped from
the list, is logged with the start of its content and dropped, and the worker reads on.
Connection errors still propagate, since Celery's reconnection depends on them (all but
``KeyError``, which kombu lists among them but which here means a JSON value without
``properties``). Kombu's
Redis transport is used for ``redis://`` and ``rediss://`` alike, so one patch covers both.

Job ids inside well-formed messages are checked later, in ``worker.runner.job_ids_from_messages``.
"""

from __future__ import annotations

import functools
import logging

from kombu.transport import redis as kombu_redis

log = logging.getLogger("renderfarm.worker")
_MARK = "_renderfarm_guarded"


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
