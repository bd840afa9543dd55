"""``renderfarm bench pipeline --two-stage``: render small and upscale, against rendering large.

Place in the data flow: beside the pipeline. One warm renderer of the model (the worker's:
:func:`bench.pipeline.adapter.farm_renderer`) and the worker's upscaling stage; per row the same
prompt and seeds, the same steps:

* ``direct``: the model at the target size (default 1024²);
* ``base + ×4``: the model at target/4 (256²), then the upscaler ×4 (default ``esrgan-x4-arch``,
  the real ESRGAN size with random weights);
* ``base + ×2``: the model at target/2 (512²), then the upscaler ×2 (a ×4 network resized, as
  Real-ESRGAN's ``--outscale``);
* with ``diffusion_upscaler`` (e.g. ``sd-x4-upscaler-arch``, diffusers' SD ×4 upscaler's
  architecture with random weights): the model at target/4, then that upscaler ×4 with
  ``upscale_steps`` steps, the request's prompt and seed, in the stage's 128² input tiles: the
  diffusion alternative to ESRGAN.

This is the Rapid Diffusion path (Alibaba PAI with South China University of Technology, ACL 2023:
render at 256², upscale with a pre-trained ESRGAN instead of a second diffusion pass). Columns:
seconds per image for the diffusion stage, the upscale stage and both (wall time on CPUs, device
time on CUDA, from :class:`bench.pipeline.instruments.DeviceTimer`), peak memory of the row
(:class:`bench.pipeline.instruments.MemoryWindow`: CUDA's peak allocated; on CPUs the process RSS
high-water mark, resident model included), and the speed-up of each row over ``direct``
(direct s/img ÷ row s/img). Random weights: the pixels mean nothing, the costs are the real ones.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from bench.pipeline.adapter import farm_renderer
from bench.pipeline.instruments import DeviceTimer, MemoryWindow, load_average, machine_caption, mib
from infra.schemas import RenderRequest
from pipeline.device import cpu_summary
from pipeline.upscale import DiffusionSettings

PROMPT = "a bowl of braised pork belly on a wooden table, food photography"


@dataclass(frozen=True)
class TwoStageConfig:
    """What to measure: ``model`` rendered directly at ``target``² and at ``target``/factor² plus
    ``upscaler`` × factor, for each factor of ``factors``; ``steps`` denoising steps in every row;
    ``batch`` images per call; ``repeats`` timed rounds (median reported), after one warm-up at
    64² and the upscaler's first call; ``diffusion_upscaler`` adds a ×4 row of that upscaler
    run with ``upscale_steps`` denoising steps."""

    model: str = "sd15-arch"
    upscaler: str = "esrgan-x4-arch"
    target: int = 1024
    factors: tuple[int, ...] = (4, 2)
    steps: int = 4
    batch: int = 1
    repeats: int = 1
    device: str = "auto"
    recipe: str = "exact"
    diffusion_upscaler: str | None = None
    upscale_steps: int = 20


def _row(renderer, config: TwoStageConfig, factor: int, upscaler: str) -> dict:
    side = config.target // factor
    requests = [RenderRequest(prompt=PROMPT, model=config.model, seed=i, width=side, height=side,
                              num_inference_steps=config.steps) for i in range(config.batch)]
    stage = renderer.upscale_stage()
    diffusion: list[float] = []
    upscale: list[float] = []
    peaks: list[int] = []
    out_size: tuple[int, int] = (0, 0)
    for _ in range(config.repeats):
        with MemoryWindow(renderer.device) as memory:
            with DeviceTimer(renderer.device) as t_diff:
                images = renderer.render(requests)
            with DeviceTimer(renderer.device) as t_up:
                if factor > 1:
                    images = stage.upscale(images, upscaler, factor, prompts=[r.prompt for r in requests],
                                           seeds=[i for i, _ in enumerate(requests)])
        diffusion.append(t_diff.seconds / config.batch)
        upscale.append(t_up.seconds / config.batch if factor > 1 else 0.0)
        peaks.append(memory.peak_allocated or 0)
        out_size = images[0].size
    d, u = statistics.median(diffusion), statistics.median(upscale)
    label = "direct" if factor == 1 else f"{side}² + {upscaler} ×{factor}"
    return {"path": label, "diffusion_size": f"{side}x{side}", "output_size": f"{out_size[0]}x{out_size[1]}",
            "steps": config.steps, "diffusion_s_per_img": round(d, 3), "upscale_s_per_img": round(u, 3),
            "s_per_img": round(d + u, 3), "peak_mib": mib(max(peaks))}


def run_two_stage_bench(config: TwoStageConfig, log=print) -> dict:
    """Measure the rows (see the module docstring); returns ``{"config", "device", "rows"}`` with
    ``speedup`` per row (direct s/img ÷ its s/img).

    Raises:
        ValueError: ``target`` not divisible by a factor into a multiple of 8, or as
            :func:`pipeline.warm.prepare_renderer`.
    """
    for factor in config.factors:
        if config.target % factor or (config.target // factor) % 8:
            raise ValueError(f"target {config.target} / {factor} is not a multiple of 8")
    load_before = load_average()
    log(f"loading {config.model} (recipe {config.recipe})")
    renderer, profile = farm_renderer(config.model, config.device, config.recipe)
    renderer.warmup()
    stage = renderer.upscale_stage()
    stage.diffusion = DiffusionSettings(steps=config.upscale_steps)
    import PIL.Image

    plan = [(factor, config.upscaler) for factor in (1, *config.factors)]
    if config.diffusion_upscaler:
        plan.append((4, config.diffusion_upscaler))
    for upscaler in dict.fromkeys(name for factor, name in plan if factor > 1):
        log(f"loading {upscaler}")
        stage.upscale([PIL.Image.new("RGB", (64, 64))], upscaler, 4, prompts=[PROMPT])  # load and first call
    rows = []
    for factor, upscaler in plan:
        log(f"rendering {config.target // factor}² × {config.steps} steps" + (f" + {upscaler} ×{factor}"
                                                                              if factor > 1 else ""))
        rows.append(_row(renderer, config, factor, upscaler))
        log(f"  {rows[-1]}")
    direct = rows[0]["s_per_img"]
    for row in rows:
        row["speedup"] = round(direct / row["s_per_img"], 2) if row["s_per_img"] else None
    machine: dict = {"load_average_before": load_before, "load_average_after": load_average()}
    if profile.get("kind") == "cpu":
        machine["cpu"] = cpu_summary()
    return {"config": asdict(config), "device": profile, "machine": machine, "recipe": renderer.recipe.get("name"),
            "rows": rows}


def two_stage_table(result: dict):
    """The rows as a rich table."""
    from rich.table import Table

    c = result["config"]
    extra = (f", {c['diffusion_upscaler']} {c['upscale_steps']} steps" if c.get("diffusion_upscaler") else "")
    table = Table(title=f"bench pipeline --two-stage: {c['model']}, {c['steps']} steps, batch {c['batch']}, "
                        f"upscaler {c['upscaler']}{extra}, recipe {result['recipe']}, median of {c['repeats']}",
                  title_justify="left")
    columns = ("path", "diffusion_size", "output_size", "diffusion_s_per_img", "upscale_s_per_img", "s_per_img",
               "peak_mib", "speedup")
    for col in columns:
        table.add_column(col.replace("_", " "), justify="left" if col == "path" else "right")
    for row in result["rows"]:
        table.add_row(*(str(row[col]) for col in columns))
    table.caption = machine_caption(result)
    return table
