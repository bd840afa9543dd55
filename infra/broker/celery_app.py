"""The farm's Celery app as a module, for Celery's own command-line tools and Flower.

Place in the data flow: beside it. ``celery -A infra.broker.celery_app inspect ping`` (or
``stats``, ``reserved``, ``active_queues``), ``celery -A infra.broker.celery_app control
enable_events`` and ``celery -A infra.broker.celery_app flower`` (Flower 2) reach the workers
through the broker in ``RENDERFARM_REDIS_URL`` (or the client settings file of ``renderfarm up``),
with the farm's broker options (JSON only, its queue separator and priorities). Importing it
builds the app and connects to nothing.

Broker shards (:mod:`infra.broker.shards`): Celery's tools see one broker at a time, so a pool
whose queue lives on a shard is reached with ``RENDERFARM_CELERY_BROKER=<shard name>`` (a name in
``RENDERFARM_BROKERS``), e.g. ``RENDERFARM_CELERY_BROKER=gpu-b celery -A infra.broker.celery_app
inspect ping``; one Flower per shard.
"""

from __future__ import annotations

import os

from infra.broker.app import make_celery
from infra.settings import get_settings

_settings = get_settings()
_shard = os.environ.get("RENDERFARM_CELERY_BROKER") or None
#: What ``celery -A infra.broker.celery_app`` finds: the default broker, or the shard named in
#: ``RENDERFARM_CELERY_BROKER`` (a KeyError naming it when undeclared).
app = make_celery(_settings, _settings.brokers[_shard] if _shard else None)
