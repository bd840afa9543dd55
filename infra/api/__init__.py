"""The status API: submission over HTTP, job and batch status, workers, queues, health, metrics
and the dashboard; with its auth, rate limits, webhooks and the Prometheus read side.

Place in the data flow: producers → **the API** → state and broker; state → **the API** →
polling clients and the dashboard. The top of ``infra``: it may import every other part of it.
"""
