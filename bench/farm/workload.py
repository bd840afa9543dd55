"""What ``renderfarm bench farm`` and its siblings run: the configuration (:class:`FarmBenchConfig`),
the requests (:func:`requests_for`), the pools of the broker-shard run and the load average every
farm bench records.

Place in the data flow: beside it; :mod:`bench.farm.farm` runs these on a private stack, and the
submission, saturation, per-core and submit benchmarks build on them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from infra.schemas import OutputFormat, RenderRequest

PROMPTS = (
    "a photograph of an astronaut riding a horse", "a red fox in the snow, golden hour",
    "an isometric city map, pastel colors", "a bowl of ramen, studio lighting",
    "portrait of an old sailor, oil on canvas", "a glass teapot on a wooden table",
    "a lighthouse in a storm, dramatic sky", "a field guide plate of botanical ferns",
)
NULL_MODEL = "null"


@dataclass(frozen=True)
class FarmBenchConfig:
    """What to measure. ``jobs``/``batch_size`` None = 2000/64 for null, 16/4 for a model;
    ``width``/``height`` (pixels) None = 64×64 for null (the size of the images behind its
    earlier figures), 256×256 for a model. ``--model null --render-ms-per-image 10 --width 512
    --height 512`` is a simulated H100 on sd-turbo at 512², encoding and uploading 512² images;
    ``output_format`` is every request's (png, webp or jpeg: what the workers encode)."""

    model: str
    jobs: int | None = None
    workers: int = 1
    batch_size: int | None = None
    width: int | None = None
    height: int | None = None
    steps: int = 4
    guidance_scale: float = 7.5
    recipe: str = "exact"
    submit_jobs: int = 10_000
    submit_repeats: int = 3
    rounds: int = 2
    bare: bool = True
    render_ms_per_image: float = 0.0
    output_format: OutputFormat = "png"
    timeout_s: float = 3600.0
    #: appendfsync policies to compare in the submission test (redis-server then runs with the AOF)
    submit_appendfsync: tuple[str, ...] = ()
    #: GPU speeds (ms per image) the per-core rows size a node for (bench/farm/core_figures.py)
    gpu_ms_per_image: tuple[float, ...] = (10.0, 30.0, 100.0)
    #: the job-state store on a redis-server of its own (``RENDERFARM_STATE_REDIS_URL``), so that
    #: Redis's CPU per job splits into the broker's (``redis``) and the state store's (``redis-state``)
    split_state: bool = False
    #: 2: two pools of null workers, the second on a broker shard of its own (a redis-server named
    #: ``redis-broker-2``, ``RENDERFARM_BROKERS``), the jobs alternating between them; 1: one broker
    broker_shards: int = 1

    @property
    def null(self) -> bool:
        return self.model == NULL_MODEL

    @property
    def simulated_rate(self) -> float | None:
        """Images/s the simulated GPUs' sleep alone allows (all workers), or None without one."""
        if not (self.null and self.render_ms_per_image):
            return None
        return self.workers * 1000.0 / self.render_ms_per_image

    def resolved(self) -> "FarmBenchConfig":
        """Defaults filled in."""
        from dataclasses import replace

        if (self.split_state or self.broker_shards > 1) and self.submit_jobs:
            raise ValueError("a split state store or broker shards are measured over the rounds only: "
                             "pass --submit-jobs 0")
        if self.broker_shards not in (1, 2) or (self.broker_shards == 2 and not self.null):
            raise ValueError("--broker-shards is 1 or 2, and 2 needs the null model")
        side = 64 if self.null else 256
        return replace(self, jobs=self.jobs or (2000 if self.null else 16),
                       batch_size=self.batch_size or (64 if self.null else 4),
                       width=self.width or side, height=self.height or side)


#: The pools of ``broker_shards=2``: ``null-b`` (its queue on the shard) takes the requests 8 pixels
#: wider than ``null-a``'s (routing picks the smallest pool that fits), every second request.
SHARD_POOLS = ("null-a", "null-b")
SHARD_NAME = "broker-2"


def shard_pools(config: FarmBenchConfig) -> list[dict]:
    """``RENDERFARM_POOLS`` of ``broker_shards=2`` (a resolved config)."""
    assert config.width is not None and config.height is not None, "expects a resolved config"
    a = config.width * config.height
    return [{"name": SHARD_POOLS[0], "model": config.model, "max_pixels": a},
            {"name": SHARD_POOLS[1], "model": config.model, "max_pixels": a + 8 * config.height,
             "broker": SHARD_NAME}]


def requests_for(config: FarmBenchConfig, n: int, offset: int = 0) -> list[RenderRequest]:
    """``n`` requests (prompt i ↔ seed i) of the configured size, steps and guidance (a resolved
    config); with two broker shards every odd one 8 pixels wider (pool ``null-b``'s)."""
    assert config.width is not None and config.height is not None, "expects a resolved config"
    wider = 8 if config.broker_shards > 1 else 0
    return [RenderRequest(prompt=PROMPTS[i % len(PROMPTS)], seed=i, model=config.model,
                          width=config.width + wider * (i % 2), height=config.height, num_inference_steps=config.steps,
                          guidance_scale=config.guidance_scale, output_format=config.output_format)
            for i in range(offset, offset + n)]


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01 (runnable processes; compare with
    ``nproc``): what every farm bench command records around its runs. The same figure as
    :func:`bench.pipeline.instruments.load_average`, kept here so that the farm's bench commands do
    not import torch."""
    return [round(x, 2) for x in os.getloadavg()]
