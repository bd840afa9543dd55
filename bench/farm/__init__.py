"""Benchmarks of the farm as a whole and of its parts: ``renderfarm bench farm|submit|messages|redis|s3|encode|cores``.

Place in the data flow: beside it, never in it (nothing in ``producer``, ``worker``, ``pipeline``
or ``infra`` imports this package). The command line (:mod:`bench.cli`) builds a config; the
modules here start what they measure (a private local stack, redis-server or SeaweedFS) and
report:

* :mod:`~bench.farm.farm`: the whole path, producer → API → Redis → worker → S3 → job state,
  against a bare in-process loop; :mod:`~bench.farm.farm_table` prints its result.
* :mod:`~bench.farm.submit`: one ``POST /v1/batches`` alone; :mod:`~bench.farm.messages`: the
  broker's cost per job, one Celery message per job against one per group.
* :mod:`~bench.farm.saturation`: where one redis-server saturates as null workers are added;
  :mod:`~bench.farm.redis_stats`: one redis-server's command and byte counts between two reads.
* :mod:`~bench.farm.s3_client`: boto3 against obstore per S3 operation;
  :mod:`~bench.farm.encoders`: image encoders per image.
* :mod:`~bench.farm.cores`: host cores a GPU of a given speed needs;
  :mod:`~bench.farm.core_figures`: the per-core figures ``bench farm`` and ``bench cores`` print.
"""
