"""``renderfarm bench pipeline --modes``: txt2img against img2img, inpainting and ControlNet, and adapter switches.

Place in the data flow: beside the pipeline. One warm renderer of the model (the worker's:
:func:`bench.pipeline.adapter.farm_renderer`), its img2img and inpainting pipelines made from the
same components (:mod:`pipeline.modes`); per row the same prompt, seeds, size and steps:

* ``txt2img``: ``steps`` denoising steps;
* ``img2img`` and ``inpaint`` at ``strength``: diffusers runs about ``steps × strength`` of them
  (the schedule's last part), so the denoiser is called about ``strength`` times as often;
* ``controlnet``: txt2img with one canny ControlNet unit (:mod:`pipeline.controlnet`, an offline
  ``tiny-controlnet`` build from the model's UNet: the real layout, random weights): the same
  denoiser calls, plus one ControlNet pass per denoiser call (the ControlNet is the UNet's encoder
  half, so about a third of a UNet's work, the ControlNet paper's estimate). The canny
  preprocessing of one image at the size is timed apart (``preprocess``);
* ``ip-adapter``: txt2img with one IP-Adapter unit (:mod:`pipeline.ip_adapter`, an offline
  ``tiny-ip-adapter`` build: the model's real cross-attention layout with the image tokens' key and
  value projections, random weights, and a tiny CLIP image encoder, so this row times the added
  attention and the adapter's load and unload around the call, not a full-size ViT encoder).

Columns: denoiser calls per image (counted by wrapping the denoiser:
:func:`bench.pipeline.render_probes.count_render`), hot seconds per image (median and best of
``repeats`` rounds, each round rendering every mode once, interleaved; wall time on CPUs, device
time on CUDA), and both as ratios of medians to txt2img. Then the adapter rows (with ``adapters``,
offline random-weight LoRAs, :mod:`pipeline.lora`): the first use of an adapter
(``load_lora_weights`` + ``set_adapters``), a switch to another loaded one, a switch to none, each
in seconds, and the TorchDynamo compilations they caused (:func:`pipeline.compile_count.compiles`).
A recipe that compiles the denoiser (``--recipe`` with ``compile_denoiser``) gets the worker's
hot-swap slot (:mod:`pipeline.lora`), the "how" column says which. Random weights: the pixels mean
nothing, the costs are the real ones.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import PIL.Image

from bench.pipeline.adapter import farm_renderer
from bench.pipeline.instruments import DeviceTimer, load_average, machine_caption
from bench.pipeline.render_probes import count_render
from infra.schemas import LoraRef, RenderRequest
from pipeline.device import cpu_summary
from pipeline.pool_options import PoolOptions

PROMPT = "a ceramic mug on a wooden table, product photography"


@dataclass(frozen=True)
class ModesConfig:
    """What to measure: ``model`` at ``width`` × ``height`` pixels, ``steps`` steps, img2img and
    inpainting at ``strength``, ``repeats`` hot rounds (median), ``adapters`` offline LoRAs for
    the switch rows (0: none), ``overrides`` a JSON object of recipe knobs (``{"compile_denoiser": true}``)."""

    model: str = "tiny"
    width: int = 256
    height: int = 256
    steps: int = 20
    strength: float = 0.5
    repeats: int = 3
    device: str = "auto"
    recipe: str = "exact"
    adapters: int = 2
    overrides: str = ""
    controlnet: bool = True
    ip_adapter: bool = True


def _inputs(width: int, height: int) -> dict[str, PIL.Image.Image]:
    rng = np.random.default_rng(0)
    mask = np.zeros((height, width), np.uint8)
    mask[:, width // 2:] = 255
    return {"photo": PIL.Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)),
            "mask": PIL.Image.fromarray(mask)}


def run_modes_bench(config: ModesConfig, log=print) -> dict:
    """Measure the rows (see the module docstring); returns ``{"config", "device", "machine",
    "rows", "adapters"}``.

    Raises:
        ValueError: as :func:`pipeline.warm.prepare_renderer`, or a model whose family has no
            img2img or inpainting pipeline in diffusers.
    """
    load_before = load_average()
    log(f"loading {config.model} (recipe {config.recipe})")
    # with adapters and ControlNets, as a worker of a pool that declares them (pipeline.recipes.fit_adapters)
    pool = PoolOptions(lora_adapters=bool(config.adapters), controlnets=config.controlnet)
    renderer, profile = farm_renderer(config.model, config.device, config.recipe, config.overrides, pool=pool)
    inputs = _inputs(config.width, config.height)
    renderer.input_loader = inputs.__getitem__
    base = {"prompt": PROMPT, "model": config.model, "width": config.width, "height": config.height,
            "num_inference_steps": config.steps, "seed": 1}
    plan = {"txt2img": RenderRequest(**base),
            "img2img": RenderRequest(**base, init_image="photo", strength=config.strength),
            "inpaint": RenderRequest(**base, init_image="photo", mask_image="mask", strength=config.strength)}
    preprocess: dict = {}
    if config.controlnet:
        from pipeline.controlnet import ControlNets

        renderer.controlnets = ControlNets(renderer.pipe, {"canny": "tiny-controlnet-bench"},
                                           prepare=renderer.prepare_controlnet)
        plan["controlnet"] = RenderRequest(**base, controls=[{"type": "canny", "image": "photo",
                                                              "preprocess": "canny"}])
        preprocess = _canny_seconds(plan["controlnet"], inputs["photo"], config.repeats)
        log(f"  canny preprocessing: {preprocess}")
    if config.ip_adapter:
        from infra.settings import get_settings
        from pipeline.ip_adapter import IPAdapters

        renderer.ip_adapters = IPAdapters(renderer.pipe, {"style": "tiny-ip-adapter-bench"},
                                          cache_dir=get_settings().cache_dir)
        plan["ip-adapter"] = RenderRequest(**base, controls=[{"type": "style", "image": "photo", "weight": 0.6}])
    rows = _mode_rows(renderer, plan, config.repeats, log)
    for row in rows:
        row["calls_vs_txt2img"] = round(row["denoiser_calls"] / rows[0]["denoiser_calls"], 3)
        row["time_vs_txt2img"] = round(row["s_per_img"] / rows[0]["s_per_img"], 3)
    adapters = _adapter_rows(renderer, config, base, log) if config.adapters else []
    machine: dict = {"load_average_before": load_before, "load_average_after": load_average()}
    if profile.get("kind") == "cpu":
        machine["cpu"] = cpu_summary()
    return {"config": asdict(config), "device": profile, "machine": machine, "recipe": renderer.recipe.get("name"),
            "rows": rows, "adapters": adapters, "preprocess": preprocess}


def _mode_rows(renderer, plan: dict[str, RenderRequest], repeats: int, log) -> list[dict[str, Any]]:
    """One row per mode of ``plan``: each warmed and its denoiser calls counted, then ``repeats``
    rounds timing every mode once per round, interleaved (so that a drifting machine load falls on
    every mode alike); median and best seconds per image."""
    calls: dict[str, int] = {}
    for mode, request in plan.items():
        renderer.render([request])  # warm: the mode's pipeline is made on first use
        if mode == "ip-adapter":  # txt2img's denoiser calls (the adapter works inside them); the counting
            calls[mode] = calls["txt2img"]  # wrapper would stand where the adapter sets its processors
            continue
        pipe = (renderer.controlnets.pipeline("txt2img", ["canny"]) if mode == "controlnet"
                else renderer.modes.for_mode(request.mode))
        calls[mode] = count_render(pipe, functools.partial(renderer.render, [request]), flops=False).denoiser_calls
    seconds: dict[str, list[float]] = {mode: [] for mode in plan}
    for r in range(repeats):
        for mode, request in plan.items():
            with DeviceTimer(renderer.device) as timer:
                renderer.render([request])
            seconds[mode].append(timer.seconds)
        log(f"  round {r + 1}: " + ", ".join(f"{mode} {s[-1]:.3f} s" for mode, s in seconds.items()))
    return [{"mode": mode, "strength": request.effective_strength, "steps": request.num_inference_steps,
             "denoiser_calls": calls[mode], "s_per_img": round(statistics.median(seconds[mode]), 4),
             "s_per_img_best": round(min(seconds[mode]), 4)} for mode, request in plan.items()]


def _canny_seconds(request: RenderRequest, image: PIL.Image.Image, repeats: int) -> dict:
    """Median wall seconds of one canny control map of ``image`` at the request's size (the worker's
    :func:`pipeline.preprocess.control_map`), over ``repeats`` × 5 runs."""
    from pipeline.preprocess import control_map

    unit = request.controls[0]
    control_map(unit, image, request.width, request.height)  # OpenCV's first call loads its kernels
    seconds = []
    for _ in range(max(1, repeats) * 5):
        started = time.perf_counter()
        control_map(unit, image, request.width, request.height)
        seconds.append(time.perf_counter() - started)
    return {"canny_s_per_img": round(statistics.median(seconds), 6), "width": request.width,
            "height": request.height}


def _adapter_rows(renderer, config: ModesConfig, base: dict, log) -> list[dict]:
    from pipeline import compile_count
    from pipeline.lora import AdapterCache, AdapterSource, denoiser_compiled

    compile_count.install()
    names = [f"bench-{i}" for i in range(config.adapters)]
    hotswap = denoiser_compiled(renderer.pipe)  # as the worker: a compiled denoiser hot-swaps one slot
    renderer.adapters = AdapterCache(renderer.pipe, {n: AdapterSource(f"tiny-lora-{n}") for n in names},
                                     hotswap_rank=8 if hotswap else None)
    for name in names:  # build the files first: the rows time loading, not building
        renderer.adapters._path(name)
    rows = []
    steps = [(f"first use of {n}", [n]) for n in names] + [(f"switch to {names[0]}", [names[0]])]
    steps += [("switch to none", []), (f"switch back to {names[-1]}", [names[-1]])]
    for label, active in steps:
        graphs = compile_count.compiles()
        started = time.perf_counter()
        renderer.adapters.apply([LoraRef(name=n, weight=0.8) for n in active])
        switch_s = time.perf_counter() - started
        renderer.render([RenderRequest(**base, loras=[{"name": n, "weight": 0.8} for n in active])])
        rows.append({"step": label, "how": "hot-swap" if hotswap else "set_adapters", "switch_s": round(switch_s, 4),
                     "recompiles": compile_count.compiles() - graphs})
        log(f"  {rows[-1]}")
    return rows


def modes_table(result: dict):
    """The rows as rich tables (modes, then adapter switches)."""
    from rich.console import Group
    from rich.table import Table

    c = result["config"]
    table = Table(title=f"bench pipeline --modes: {c['model']} {c['width']}x{c['height']}, {c['steps']} steps, "
                        f"recipe {result['recipe']}, median of {c['repeats']}", title_justify="left")
    columns = ("mode", "strength", "denoiser_calls", "calls_vs_txt2img", "s_per_img", "s_per_img_best",
               "time_vs_txt2img")
    for col in columns:
        table.add_column(col.replace("_", " "), justify="left" if col == "mode" else "right")
    for row in result["rows"]:
        table.add_row(*(str(row.get(col, "–")) for col in columns))
    table.caption = machine_caption(result)
    if result.get("preprocess"):
        p = result["preprocess"]
        table.caption = (f"{table.caption}; canny preprocessing {p['canny_s_per_img'] * 1000:.2f} ms per "
                         f"{p['width']}x{p['height']} image")
    if not result["adapters"]:
        return table
    switches = Table(title="adapter switches in the warm renderer (offline LoRAs, rank 4)", title_justify="left")
    for col in ("step", "how", "switch_s", "recompiles"):
        switches.add_column(col.replace("_", " "), justify="left" if col in ("step", "how") else "right")
    for row in result["adapters"]:
        switches.add_row(row["step"], row.get("how", "set_adapters"), str(row["switch_s"]), str(row["recompiles"]))
    return Group(table, switches)
