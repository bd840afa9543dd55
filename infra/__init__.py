"""Shared foundation of renderfarm: settings, schemas, the job-state store, S3 storage,
the status API, metrics and the local stack.

Every other package may import from here; ``infra`` imports nothing of ``producer``,
``worker`` or ``pipeline`` and knows nothing of diffusers.
"""
