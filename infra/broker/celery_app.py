"""The farm's Celery app as a module, for Celery's own command-line tools and Flower.

Place in the data flow: beside it. ``celery -A infra.broker.celery_app inspect ping`` (or
``stats``, ``reserved``, ``active_queues``), ``celery -A infra.broker.celery_app control
enable_events`` and ``celery -A infra.broker.celery_app flower`` (Flower 2) reach the workers
through the broker in ``RENDERFARM_REDIS_URL`` (or the client settings file of ``renderfarm up``),
with the farm's broker options (JSON only, its queue separator and priorities). Importing it
builds the app and connects to nothing.
"""

from __future__ import annotations

from infra.broker.app import make_celery
from infra.settings import get_settings

#: What ``celery -A infra.broker.celery_app`` finds.
app = make_celery(get_settings())
