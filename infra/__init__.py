"""Shared foundation of renderfarm and the farm's services and applications, knowing nothing of
diffusers.

Root modules, the foundation every package may import: :mod:`~infra.settings` (every
``RENDERFARM_*`` variable), :mod:`~infra.schemas` (the public types), :mod:`~infra.pools` (pools
and their capabilities), :mod:`~infra.routing` (request → pool), :mod:`~infra.keys` (every Redis
key and kombu name), :mod:`~infra.background` (periodic loops, Redis locks, server time),
:mod:`~infra.heap` and :mod:`~infra.cli` (the ``renderfarm`` root).
Subpackages, the services: :mod:`infra.state` (job records, registry, catalog index, quotas,
metrics write side), :mod:`infra.storage` (S3, input images, image encoding),
:mod:`infra.broker` (Celery, wait lanes, dispatcher, reaper, queue depths) and
:mod:`infra.submission` (validated requests → records → wait lanes, no HTTP); and the
applications: :mod:`infra.api` (the status API), :mod:`infra.localstack` (the farm on one
machine) and :mod:`infra.capacity` (``renderfarm plan``).

Every other package may import the root modules; ``pipeline`` imports nothing from a subpackage,
and ``infra`` imports nothing of ``producer``, ``worker`` or ``pipeline`` (import-linter
contracts in ``pyproject.toml``).
"""
