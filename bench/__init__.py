"""The benchmarks: ``renderfarm bench …`` and the measurements behind the documentation's tables.

Place in the data flow: beside the farm, never in it. The benchmarks drive the product's own code
(the client, the local stack, the worker's renderer) and measure it; the product (``producer``,
``worker``, ``pipeline``, ``infra``) imports nothing from here, a rule ``lint-imports`` checks
(the forbidden contract in ``pyproject.toml``), so a benchmark can be changed or left out without
touching what a farm runs.

* :mod:`bench.cli`: the ``bench`` commands (the ``renderfarm.commands`` entry point ``bench``;
  ``python -m bench.cli …`` runs them without the CLI root).
* :mod:`bench.pipeline`: one pipeline on one device: the recipes side by side against diffusers,
  the profiler's view of a step, time to ready, image modes, the GPU checks.
* :mod:`bench.farm`: the farm as a whole and its parts: the whole path against a bare loop,
  batch submission, broker messages, Redis, the S3 client, image encoders, CPU cores per GPU.
"""
