"""Capacity planning: how many replicas a pool needs, how fast it drains, what it costs.

Place in the data flow: beside the farm, for its operator. ``renderfarm plan`` (:mod:`~infra.capacity.cli`)
replays an arrival of jobs second by second against KEDA + HPA autoscaling as the chart deploys
it (:mod:`~infra.capacity.replay`), from the chart's values and a ``bench farm`` report
(:mod:`~infra.capacity.sources`). Nothing here connects to Redis or S3.
"""
