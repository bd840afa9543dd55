"""Shared foundation of renderfarm, knowing nothing of diffusers.

Root modules: :mod:`~infra.settings` (every ``RENDERFARM_*`` variable), :mod:`~infra.schemas` (the
public types), :mod:`~infra.pools` (pools and routing), :mod:`~infra.keys` (every Redis key and
kombu name), :mod:`~infra.background` (periodic loops, Redis locks, server time),
:mod:`~infra.cli` (the ``renderfarm`` root).
Packages: :mod:`infra.state` (job records, registry, catalog index, metrics write side),
:mod:`infra.broker` (Celery, dispatcher, reaper, queue depths), :mod:`infra.storage` (S3 and
image encoding), :mod:`infra.api` (the status API) and :mod:`infra.localstack` (the farm on one
machine).

Every other package may import from here; ``infra`` imports nothing of ``producer``, ``worker``
or ``pipeline`` (import-linter contracts in ``pyproject.toml``).
"""
