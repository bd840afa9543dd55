"""Benchmarks of the pipeline package: ``renderfarm bench pipeline|profile|ready|show``, the GPU checks.

Place in the data flow: beside the pipeline, not in it (nothing under ``pipeline/`` imports this
package). The command line (:mod:`bench.cli`) builds a config; the modules here load the
subjects, render, measure and report:

* :mod:`~bench.pipeline.specs`: the ``--recipes`` syntax (``reference``, ``peer``,
  ``sdnq-uint4``, farm recipes, ``+batch_invariant``, overrides).
* :mod:`~bench.pipeline.adapter`: the only coupling to the rest of ``pipeline/``.
* :mod:`~bench.pipeline.public_recipes`: the public recipes measured against (diffusers'
  fast-diffusion tutorial, the SDNQ uint4 model card).
* :mod:`~bench.pipeline.experiments`: experiments on any row (SDPA backend, fp8, First Block Cache).
* :mod:`~bench.pipeline.subjects`: one loaded row and its render.
* :mod:`~bench.pipeline.instruments` and :mod:`~bench.pipeline.render_probes`: timers, memory
  windows, GEMM rate, PSNR; denoiser-call and FLOP counts, profiler ranges.
* :mod:`~bench.pipeline.ran_with`: what a row actually ran with, read back from the loaded objects.
* :mod:`~bench.pipeline.side_by_side` (the side-by-side table), :mod:`~bench.pipeline.modelcard`
  (the SDNQ model card's table), :mod:`~bench.pipeline.profile` and :mod:`~bench.pipeline.trace`
  (kernels, syncs and time by category per step), :mod:`~bench.pipeline.summary` (medians over
  rounds), :mod:`~bench.pipeline.tables` (tables, JSON).
* :mod:`~bench.pipeline.time_to_ready` (``bench ready``: cold and cached start-up),
  :mod:`~bench.pipeline.image_modes` (``bench pipeline --modes``: img2img, inpainting, LoRA switches
  through the worker's renderer), :mod:`~bench.pipeline.twostage` (``bench pipeline --two-stage``: render and upscale).
* :mod:`~bench.pipeline.gpu_checks` (``python -m bench.pipeline.gpu_checks``: the CUDA-only checks
  in one process) and :mod:`~bench.pipeline.openvino_unet` (the UNet in OpenVINO against PyTorch;
  the JSON of the recipe-table runs is in ``bench/pipeline/results/``).

Public names load lazily, so ``import bench.pipeline`` stays cheap.
"""

from __future__ import annotations

from importlib import import_module

_EXPORTS = {
    "PipelineBenchConfig": "bench.pipeline.side_by_side",
    "run_pipeline_bench": "bench.pipeline.side_by_side",
    "DEFAULT_RECIPES": "bench.pipeline.side_by_side",
    "ProfileConfig": "bench.pipeline.profile",
    "run_profile": "bench.pipeline.profile",
    "result_table": "bench.pipeline.tables",
    "profile_tables": "bench.pipeline.tables",
    "write_json": "bench.pipeline.tables",
    "psnr": "bench.pipeline.instruments",
    "parse_spec": "bench.pipeline.specs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bench.pipeline' has no attribute {name!r}")
