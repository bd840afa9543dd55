"""``renderfarm bench pipeline --video``: seconds per frame and peak memory of a video model, and
what VAE tiling and step caching change.

Place in the data flow: beside the pipeline. One warm video pipeline (the worker's recipe,
:func:`pipeline.video.prepare.prepare_video_renderer`, ``exact``), the same prompt, seed, size,
frame count and steps in every row; the rows toggle one knob each on that same pipeline:

* ``baseline``: the exact recipe (no tiling, no step cache);
* ``vae_tiling``: ``vae.enable_tiling()`` (diffusers' defaults: Wan tiles above 256 px, LTX-Video
  above 512 px; below that the decode is the same call, the ``tiled`` column says which);
* ``step_cache``: diffusers' First Block Cache on the transformer at ``cache_threshold``.

Rows are interleaved over ``repeats`` rounds (after one cold render of each), so drift on a shared
machine falls on every row alike; the table gives the median and the best round, and each row's
ratio to ``baseline`` (row ÷ baseline s/frame, medians, same process). Columns: seconds per frame
(wall time on CPUs, device time on CUDA: :class:`bench.pipeline.instruments.DeviceTimer`), peak
memory (:class:`bench.pipeline.instruments.MemoryWindow`: on CPUs the process's RSS high-water
mark, reset before each render, resident weights included; on CUDA the peak allocated), full
transformer passes (denoiser calls in which the last block ran: the cache skips all blocks after the
first when their residual is reused; the denoiser is called twice a step with Wan's guidance)
and the mean absolute pixel difference to ``baseline`` (0–255).

``embeds`` (the ``-arch`` builds): the UMT5-XXL / T5-XXL text encoders (5.7B / 4.8B parameters)
are not built; the pipeline gets random ``prompt_embeds`` of the real shape (Wan: 512 × 4096,
LTX-Video: 128 × 4096 with its attention mask) and renders from them. The table says so.
Random weights: the pixels mean nothing, the costs are the real ones.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from bench.pipeline.instruments import DeviceTimer, MemoryWindow, load_average, machine_caption, mib
from infra.schemas import RenderRequest
from infra.video import frames_of
from pipeline.device import cpu_summary, probe
from pipeline.models import OFFLINE_MODELS
from pipeline.models.build import construct_components
from pipeline.video.apply import apply_video_recipe, enable_step_cache
from pipeline.video.recipes import video_recipe
from pipeline.video.render import frames_to_uint8

PROMPT = "a red fox trotting through fresh snow at dawn, tracking shot"
#: Text sequence length the pipeline pads prompts to (WanPipeline 512, LTXPipeline 128), for ``embeds``.
TEXT_TOKENS = {"wan": 512, "ltx": 128}
ROWS = ("baseline", "vae_tiling", "step_cache")


@dataclass(frozen=True)
class VideoBenchConfig:
    """What to measure: ``model`` at ``width`` × ``height``, ``frames`` frames, ``steps`` steps,
    ``guidance_scale``; ``repeats`` timed rounds (≥ 2); ``cache_threshold`` the step cache's;
    ``embeds``: random ``prompt_embeds`` instead of a built text encoder (see the module docstring);
    ``overrides``: video recipe knobs (JSON) on top of ``exact``, e.g. ``{"compile_regional": false}``."""

    model: str = "tiny-wan"
    width: int = 256
    height: int = 256
    frames: int = 17
    steps: int = 4
    guidance_scale: float = 5.0
    repeats: int = 2
    device: str = "cpu"
    cache_threshold: float = 0.05
    embeds: bool = False
    overrides: str = ""


class _Subject:
    """The pipeline under test and one render of it (through the farm's renderer, or from embeds)."""

    def __init__(self, config: VideoBenchConfig):
        self.config = config
        spec = OFFLINE_MODELS.get(config.model)
        if spec is None:
            raise ValueError(f"bench pipeline --video: {config.model!r} is not an offline video model")
        self.family = spec.family
        profile = probe(config.device)
        self.device = profile.torch_device
        self.profile = profile.to_dict()
        recipe = video_recipe(profile, "exact", self.family, config.overrides)
        if config.embeds:
            import diffusers

            lean = replace(spec, components={k: v for k, v in spec.components.items()
                                             if k not in ("text_encoder", "tokenizer")},
                           pipeline_kwargs={**spec.pipeline_kwargs, "text_encoder": None, "tokenizer": None})
            from pipeline.video.apply import DTYPES

            self.pipe = getattr(diffusers, spec.pipeline)(**construct_components(lean, self.device,
                                                                                 DTYPES[recipe.dtype]))
            self.pipe.set_progress_bar_config(disable=True)
            apply_video_recipe(self.pipe, recipe, self.device)
            self.renderer = None
        else:
            from pipeline.video.prepare import prepare_video_renderer

            self.renderer, _ = prepare_video_renderer(config.model, config.device, "exact", config.overrides,
                                                      family=self.family)
            self.pipe = self.renderer.pipe
        self.recipe = recipe.name
        self.full_passes = 0
        # a linear layer inside the last block: it runs only when the block is computed (First Block
        # Cache replaces a skipped block's forward, so a hook on the block itself would still fire)
        blocks = getattr(self.pipe.transformer, "blocks", None) or self.pipe.transformer.transformer_blocks
        inner = next(m for m in blocks[-1].modules() if isinstance(m, torch.nn.Linear))
        inner.register_forward_hook(lambda *_: self._count())

    def _count(self) -> None:
        self.full_passes += 1

    def render(self) -> np.ndarray:
        """One clip, uint8 (frames, height, width, 3)."""
        c = self.config
        if self.renderer is not None:
            request = RenderRequest(prompt=PROMPT, model=c.model, seed=7, width=c.width, height=c.height,
                                    num_inference_steps=c.steps, guidance_scale=c.guidance_scale, kind="video",
                                    num_frames=c.frames)
            return frames_of(self.renderer.render([request])[0])[0]  # type: ignore[index]
        dtype = self.pipe.transformer.dtype
        gen = torch.Generator("cpu").manual_seed(7)
        shape = (1, TEXT_TOKENS[self.family], self.pipe.transformer.config.get("text_dim") or
                 self.pipe.transformer.config["caption_channels"])
        embeds = [torch.randn(shape, generator=gen).to(self.device, dtype) for _ in range(2)]
        kwargs: dict = {"prompt_embeds": embeds[0], "negative_prompt_embeds": embeds[1]}
        if self.family == "ltx":
            mask = torch.ones(shape[:2], dtype=torch.long, device=self.device)
            kwargs.update(prompt_attention_mask=mask, negative_prompt_attention_mask=mask)
        with torch.inference_mode():
            out = self.pipe(**kwargs, num_frames=c.frames, height=c.height, width=c.width,
                            num_inference_steps=c.steps, guidance_scale=c.guidance_scale, output_type="np",
                            generator=torch.Generator("cpu").manual_seed(7)).frames[0]
        return frames_to_uint8(np.asarray(out, dtype=np.float32))

    def set_row(self, row: str) -> None:
        """Turn the row's knob on and the others off."""
        vae, transformer = self.pipe.vae, self.pipe.transformer
        vae.enable_tiling() if row == "vae_tiling" else vae.disable_tiling()
        if getattr(transformer, "_cache_config", None) is not None:
            transformer.disable_cache()
        if row == "step_cache":
            enable_step_cache(transformer, self.config.cache_threshold)

    def tiled(self) -> bool:
        """Whether the VAE's tiling would split this size (diffusers' tile_sample_min_* defaults)."""
        vae, c = self.pipe.vae, self.config
        return c.width > vae.tile_sample_min_width or c.height > vae.tile_sample_min_height


def run_video_bench(config: VideoBenchConfig, log=print) -> dict:
    """Measure the rows (see the module docstring); returns ``{"config", "device", "machine", "recipe",
    "rows"}``, each row with its rounds and medians.

    Raises:
        ValueError: ``repeats`` < 2, a model that is not an offline video build, or a frame count
            off the family's rule (as the renderer refuses it).
    """
    if config.repeats < 2:
        raise ValueError("bench pipeline --video: --repeats must be at least 2 (median and best of rounds)")
    load_before = load_average()
    log(f"loading {config.model}" + (" (transformer and VAE; random prompt_embeds)" if config.embeds else ""))
    subject = _Subject(config)
    rounds: dict[str, list[dict]] = {row: [] for row in ROWS}
    reference: np.ndarray | None = None
    for index in range(config.repeats + 1):  # round 0: each row's cold render, not reported
        for row in ROWS:
            subject.set_row(row)
            subject.full_passes = 0
            with MemoryWindow(subject.device) as memory, DeviceTimer(subject.device) as timer:
                frames = subject.render()
            if row == "baseline" and reference is None:
                reference = frames.astype(np.int16)
            diff = float(np.abs(frames.astype(np.int16) - reference).mean()) if reference is not None else 0.0
            entry = {"s_per_frame": timer.seconds / config.frames, "peak_bytes": memory.peak_allocated,
                     "full_passes": subject.full_passes, "diff": diff, "shape": list(frames.shape)}
            log(f"  round {index} {row}: {entry['s_per_frame']:.3f} s/frame, {mib(memory.peak_allocated)} MiB, "
                f"{subject.full_passes} full passes")
            if index:
                rounds[row].append(entry)
    subject.set_row("baseline")
    rows = [_summary(row, rounds[row], subject.tiled()) for row in ROWS]
    base = rows[0]["s_per_frame_median"]
    for summary in rows:
        summary["ratio"] = round(summary["s_per_frame_median"] / base, 3) if base else None
    machine: dict = {"load_average_before": load_before, "load_average_after": load_average()}
    if subject.profile.get("kind") == "cpu":
        machine["cpu"] = cpu_summary()
    return {"benchmark": "pipeline-video", "config": asdict(config), "device": subject.profile, "machine": machine,
            "recipe": subject.recipe, "rows": rows}


def _summary(row: str, entries: list[dict], tiled: bool) -> dict:
    times = [e["s_per_frame"] for e in entries]
    return {"row": row, "s_per_frame_median": round(statistics.median(times), 4),
            "s_per_frame_best": round(min(times), 4),
            "peak_mib": mib(max(e["peak_bytes"] for e in entries)), "full_passes": entries[-1]["full_passes"],
            "diff_vs_baseline": round(statistics.median(e["diff"] for e in entries), 3),
            "tiled": tiled if row == "vae_tiling" else False, "rounds": entries}


def video_table(result: dict):
    """The rows as a rich table, the CPU (or device) in the caption."""
    from rich.table import Table

    c = result["config"]
    text = "random prompt_embeds (no text encoder built)" if c["embeds"] else "prompt through the text encoder"
    table = Table(title=f"bench pipeline --video: {c['model']}, {c['frames']} frames {c['width']}x{c['height']}, "
                        f"{c['steps']} steps, guidance {c['guidance_scale']}, {text}, recipe {result['recipe']}, "
                        f"median and best of {c['repeats']} rounds; peak = RSS high-water on CPUs (weights "
                        "included), peak allocated on CUDA", title_justify="left")
    columns = ("row", "s_per_frame_median", "s_per_frame_best", "ratio", "peak_mib", "full_passes",
               "diff_vs_baseline", "tiled")
    for col in columns:
        table.add_column(col.replace("_", " "), justify="left" if col == "row" else "right")
    for row in result["rows"]:
        label = row["row"] + (f" ({c['cache_threshold']})" if row["row"] == "step_cache" else "")
        table.add_row(label, *(str(row[col]) for col in columns[1:]))
    table.caption = machine_caption(result)
    return table
