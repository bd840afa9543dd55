"""Benchmarks of the pipeline package: ``renderfarm bench pipeline`` and ``renderfarm bench profile``.

Place in the data flow: beside the pipeline, not in it. The command line
(:mod:`producer.bench_cli`) builds a config; the modules here load the subjects, render, measure
and report:

* :mod:`~pipeline.bench.specs`: the ``--recipes`` syntax (``reference``, ``peer``,
  ``sdnq-uint4``, farm recipes, ``+batch_invariant``, overrides).
* :mod:`~pipeline.bench.adapter`: the only coupling to the rest of ``pipeline/``.
* :mod:`~pipeline.bench.public`: the public recipes measured against (diffusers' fast-diffusion
  tutorial, the SDNQ uint4 model card).
* :mod:`~pipeline.bench.knobs`: experiments on any row (SDPA backend, fp8, First Block Cache).
* :mod:`~pipeline.bench.subjects`: one loaded row and its render.
* :mod:`~pipeline.bench.measure` and :mod:`~pipeline.bench.probes`: timers, memory windows,
  GEMM rate, PSNR; denoiser-call and FLOP counts, profiler ranges.
* :mod:`~pipeline.bench.run` (the side-by-side table), :mod:`~pipeline.bench.modelcard` (the
  SDNQ model card's table), :mod:`~pipeline.bench.profile` and :mod:`~pipeline.bench.trace`
  (kernels, syncs and time by category per step), :mod:`~pipeline.bench.report` (tables, JSON).

Public names load lazily, so ``import pipeline.bench`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "PipelineBenchConfig": "pipeline.bench.run",
    "run_pipeline_bench": "pipeline.bench.run",
    "DEFAULT_RECIPES": "pipeline.bench.run",
    "ProfileConfig": "pipeline.bench.profile",
    "run_profile": "pipeline.bench.profile",
    "result_table": "pipeline.bench.report",
    "profile_tables": "pipeline.bench.report",
    "write_json": "pipeline.bench.report",
    "psnr": "pipeline.bench.measure",
    "parse_spec": "pipeline.bench.specs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pipeline.bench' has no attribute {name!r}")
