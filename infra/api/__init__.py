"""The status API: submission over HTTP, job and batch status, workers, queues, health, metrics
and the dashboard; with its auth, rate limits and the Prometheus read side.

Place in the data flow: producers → **the API** → submission (:mod:`infra.submission`) → state
and broker; state → **the API** → polling clients and the dashboard. The top of ``infra``: it
may import every other part of it. Its rooms: the app (:mod:`~infra.api.server`) and its
handles and dependencies (:mod:`~infra.api.deps`) at the root with auth, limits, probes and
error bodies; the farm's own resources in :mod:`~infra.api.routes`; the compatible front doors
(AUTOMATIC1111, OpenAI) in :mod:`~infra.api.compat`; webhook delivery, signing and the secret
route in :mod:`~infra.api.webhooks`.
"""
