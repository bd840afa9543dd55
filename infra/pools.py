"""Worker pools and their Celery queues.

Data flow: the producer side maps each request to a pool here and publishes to that pool's
queue; a worker consumes exactly one pool's queue. Both sides call :func:`queue_name`, so the
names cannot drift apart.

A pool is "model × device class". Until pools are declared in configuration, each model is
its own pool, named by a slug of the model spec.
"""

from __future__ import annotations

import re

QUEUE_PREFIX = "renderfarm."


def pool_for_model(model: str) -> str:
    """The pool name of a model spec: a lowercase slug, e.g. ``stabilityai/sd-turbo`` → ``stabilityai--sd-turbo``."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower().replace("/", "--")).strip("-.")
    return slug[:100] or "default"


def queue_name(pool: str) -> str:
    """The Celery queue a pool's workers consume: ``renderfarm.{pool}``."""
    return f"{QUEUE_PREFIX}{pool}"
