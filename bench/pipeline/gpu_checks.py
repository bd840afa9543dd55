"""``python -m bench.pipeline.gpu_checks --out DIR``: every CUDA-only check of the model-family work, in one process.

Place in the data flow: beside the pipeline, not in it; run once on a GPU machine (it also runs on
the CPU, where the CUDA parts are replaced by their CPU counterparts and say so). Writes
``DIR/gpu_checks.json`` and prints a short table.

1. **families**: every ``tiny-*`` family (and ``--models``) loads through the worker's path
   (:func:`pipeline.warm.prepare_renderer`) in its ``exact`` and ``fast`` recipes and renders a
   mixed batch on the device; the row says the recipe, dtype, what was applied and skipped, the
   seconds, and whether the pixels are finite and not flat.
2. **no sync**: the denoising loop of real renders with ``torch.cuda.set_sync_debug_mode("warn")``
   armed from the first denoiser call to the end of the last step, for every scheduler a request
   may name (UNet families) and the flow-matching ones; the count of synchronizations must be 0.
   On the CPU: the ``meta``-device spy of :mod:`pipeline.sync_free` instead.
3. **batch_invariant cost**: one model (``--invariance-model``, default ``sd15-arch`` at 512², 20
   steps, batch 8) rendered with and without ``batch_invariant``, interleaved rounds, medians; the
   cost in % and whether a batched image is bit-identical to the same request alone in each mode.
   The pool option is off by default on GPUs unless this cost is under 10 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.schemas import RenderRequest

TINY_MODELS = ("tiny", "tiny-sdxl", "tiny-sd3", "tiny-flux", "tiny-ernie-image")
PROMPTS = ("a red fox in the snow", "a lighthouse at dusk, dramatic sky", "an isometric city map", "x")


def _requests(renderer, n: int, size: int, steps: int, scheduler: str = "default") -> list[RenderRequest]:
    caps = renderer.capabilities
    guidance = 5.0 if caps.guidance_scale else 0.0
    return [RenderRequest(prompt=PROMPTS[i % len(PROMPTS)], negative_prompt="blurry" if caps.negative_prompt and i % 2
                          else "", seed=100 + i, model=renderer.model, width=size, height=size,
                          num_inference_steps=steps, guidance_scale=guidance, scheduler=scheduler) for i in range(n)]


#: Recipe overrides for every renderer of the run (``--overrides``; e.g. compile off for a quick pass).
OVERRIDES: dict = {}


def _renderer(model: str, device: str, recipe: str, batch_invariant: bool | None = None):
    from pipeline.warm import PoolOptions, prepare_renderer

    renderer, _ = prepare_renderer(model, device, recipe, json.dumps(OVERRIDES),
                                   pool=PoolOptions(batch_invariant=batch_invariant))
    return renderer


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def check_family(model: str, device: str, recipe: str) -> dict:
    """Load ``model`` in ``recipe`` on ``device`` and render a mixed batch of 4 at 64² … 128²."""
    t0 = time.perf_counter()
    try:
        renderer = _renderer(model, device, recipe)
        load_s = time.perf_counter() - t0
        size = max(64, renderer.capabilities.size_multiple * 4)
        t1 = time.perf_counter()
        images = renderer.render(_requests(renderer, 4, size, 2))
        _sync(device)
        pixels = [np.asarray(im, dtype=np.float32) for im in images]
        report = renderer.recipe["report"]
        return {"model": model, "recipe": renderer.recipe["name"], "family": renderer.family,
                "dtype": renderer.recipe["dtype"], "ok": all(np.isfinite(p).all() and p.std() > 1 for p in pixels),
                "load_s": round(load_s, 2), "render_s": round(time.perf_counter() - t1, 3),
                "applied": sorted(report["applied"]), "skipped": report["skipped"],
                "batch_invariant": renderer.invariance}
    except Exception as exc:  # report and go on: one family must not hide the others
        return {"model": model, "recipe": recipe, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}


def syncs_in_loop(model: str, scheduler: str = "default", cache_dir: Path | None = None, recipe: str = "exact",
                  renderer=None, steps: int = 3) -> int:
    """Host-device synchronizations counted by ``torch.cuda.set_sync_debug_mode("warn")`` from the
    first denoiser call to the end of the last denoising step of one CUDA render (batch 2)."""
    if cache_dir is not None:
        import os

        os.environ.setdefault("RENDERFARM_CACHE_DIR", str(cache_dir))
    renderer = renderer or _renderer(model, "cuda", recipe)
    denoiser = getattr(renderer.pipe, renderer.denoiser_name)
    requests = _requests(renderer, 2, max(64, renderer.capabilities.size_multiple * 4), steps, scheduler)
    renderer.render(requests)  # warm: first-call work (allocations, lazy init) is not the loop's

    def arm(module, args, kwargs):
        torch.cuda.set_sync_debug_mode("warn")

    def on_step(done: int, total: int) -> None:
        if done >= total:
            torch.cuda.set_sync_debug_mode("default")

    handle = denoiser.register_forward_pre_hook(arm, with_kwargs=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            renderer.render(requests, on_step=on_step)
    finally:
        handle.remove()
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def check_syncs(device: str, models: list[str]) -> list[dict]:
    """Per (model, scheduler): synchronizations in the loop (CUDA), or the meta-device spy's events (CPU)."""
    from pipeline.schedulers import SCHEDULERS

    rows = []
    if not device.startswith("cuda"):
        from diffusers import EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

        from pipeline.models import configs
        from pipeline.scheduling import precompute_scheduler, unsupported_reason
        from pipeline.sync_free import spy_scheduler_loop

        base = EulerDiscreteScheduler(**configs.EULER_TURBO).config
        for name, (cls, overrides) in SCHEDULERS.items():
            s = cls.from_config(base, **overrides)
            s = precompute_scheduler(s) if unsupported_reason(s) is None else s
            rows.append({"model": "(meta spy)", "scheduler": name, "syncs": len(spy_scheduler_loop(s, 4))})
        for fam, cfg, host in (("sd3/flux", configs.FLOW_SD3, False), ("ernie-image", configs.FLOW_ERNIE, True)):
            events = spy_scheduler_loop(FlowMatchEulerDiscreteScheduler(**cfg), 4, host_timesteps=host, channels=16)
            rows.append({"model": f"(meta spy) {fam}", "scheduler": "default", "syncs": len(events)})
        return rows
    for model in models:
        renderer = _renderer(model, device, "exact")
        names = ["default", *SCHEDULERS] if renderer.capabilities.schedulers != ("default",) else ["default"]
        for name in names:
            try:
                rows.append({"model": model, "scheduler": name, "syncs": syncs_in_loop(model, name, renderer=renderer)})
            except Exception as exc:
                rows.append({"model": model, "scheduler": name, "syncs": None, "error": f"{type(exc).__name__}: {exc}"})
        del renderer
        torch.cuda.empty_cache()  # between models of a one-off check, not between batches of a worker
    return rows


def invariance_cost(model: str, device: str, size: int, steps: int, batch: int, rounds: int) -> dict:
    """Seconds per image with and without ``batch_invariant`` (medians of interleaved rounds), the
    cost in %, and whether image 1 of the batch equals the same request rendered alone."""
    modes = {"off": _renderer(model, device, "exact", batch_invariant=False),
             "on": _renderer(model, device, "exact", batch_invariant=True)}
    requests = _requests(modes["off"], batch, size, steps)
    times: dict[str, list[float]] = {k: [] for k in modes}
    identical = {}
    for name, r in modes.items():  # cold calls (compile, autotune) out of the timing
        batched = np.asarray(r.render(requests)[1])
        identical[name] = bool(np.array_equal(batched, np.asarray(r.render([requests[1]])[0])))
    for i in range(rounds):
        for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
            _sync(device)
            t0 = time.perf_counter()
            modes[name].render(requests)
            _sync(device)
            times[name].append((time.perf_counter() - t0) / batch)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"model": model, "device": device, "size": size, "steps": steps, "batch": batch, "rounds": rounds,
            "s_per_img": {k: round(v, 4) for k, v in med.items()},
            "cost_pct": round(100 * (med["on"] / med["off"] - 1), 1),
            "identical_alone_and_batched": identical, "mode_on": modes["on"].invariance,
            "default_on": med["on"] / med["off"] - 1 < 0.10}


CHECKS = ("families", "syncs", "invariance")


def run(out: Path, models: list[str], invariance_model: str, size: int, steps: int, batch: int, rounds: int,
        device: str | None = None, only: tuple[str, ...] = CHECKS) -> dict:
    """The checks named in ``only`` (all by default); returns and writes the result (``out/gpu_checks.json``)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    result: dict[str, Any] = {"device": device, "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
              "families": [check_family(m, device, r) for m in models for r in ("exact", "fast")]
              if "families" in only else [],
              "syncs": check_syncs(device, models) if "syncs" in only else [], "batch_invariant": {}}
    if "invariance" in only:
        try:
            result["batch_invariant"] = invariance_cost(invariance_model, device, size, steps, batch, rounds)
        except Exception as exc:
            result["batch_invariant"] = {"model": invariance_model, "error": f"{type(exc).__name__}: {exc}"[:500]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_checks.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def print_tables(result: dict) -> None:
    """The result as three short tables (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    fam = Table(title=f"families on {result['device']} ({result.get('gpu') or 'no GPU'})")
    for col in ("model", "recipe", "dtype", "ok", "load s", "render s", "skipped"):
        fam.add_column(col)
    for row in result["families"]:
        fam.add_row(row["model"], row["recipe"], row.get("dtype", "-"), str(row["ok"]), str(row.get("load_s", "-")),
                    str(row.get("render_s", "-")), row.get("error") or "; ".join(sorted(row.get("skipped", {}))))
    console.print(fam)
    syncs = Table(title="host-device synchronizations in the denoising loop")
    for col in ("model", "scheduler", "syncs"):
        syncs.add_column(col)
    for row in result["syncs"]:
        syncs.add_row(row["model"], row["scheduler"], str(row["syncs"]) if row.get("error") is None else row["error"])
    console.print(syncs)
    inv = result["batch_invariant"]
    if inv:
        console.print(f"batch_invariant on {inv.get('model')}: {json.dumps(inv)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline.gpu_checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_checks.json")
    parser.add_argument("--models", default=",".join(TINY_MODELS), help="comma-separated models for checks 1 and 2")
    parser.add_argument("--invariance-model", default="sd15-arch")
    parser.add_argument("--invariance-size", type=int, default=512)
    parser.add_argument("--invariance-steps", type=int, default=20)
    parser.add_argument("--invariance-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--overrides", default="", help='recipe overrides for every renderer, JSON, e.g. '
                        '\'{"compile_denoiser": false, "compile_vae": false}\' for a quick pass')
    args = parser.parse_args(argv)
    OVERRIDES.clear()
    OVERRIDES.update(json.loads(args.overrides) if args.overrides.strip() else {})
    result = run(args.out, [m for m in args.models.split(",") if m], args.invariance_model, args.invariance_size,
                 args.invariance_steps, args.invariance_batch, args.rounds, args.device,
                 tuple(c for c in args.only.split(",") if c))
    print_tables(result)
    return 0 if all(r["ok"] for r in result["families"]) and not any(r.get("syncs") for r in result["syncs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
