"""The queue side of the farm: the Celery app, publishing, the dispatcher that feeds the pool
queues in fair order, the reaper that recovers lost work, and the queue depths.

Place in the data flow: submission (job records, wait lanes) → **dispatcher → pool queues** →
workers; the reaper puts a dead worker's jobs back. Imports the ``infra`` root and
:mod:`infra.state`; every kombu internal it needs is in :mod:`infra.broker.kombu_redis`.
"""
