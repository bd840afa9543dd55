"""``renderfarm bench pipeline …`` and ``renderfarm bench farm …``: the benchmark commands.

Place in the data flow: beside it. ``bench pipeline`` measures the pipeline package alone
(:mod:`pipeline.bench`); ``bench farm`` measures the whole path, producer → Redis → worker →
S3 → job state (:mod:`producer.bench_farm`). This module only registers the arguments: the CLI
root imports it at start, so the heavy modules (torch, diffusers, celery) are imported inside
the handlers.
"""

from __future__ import annotations

import argparse
import sys


def _csv(cast):
    def parse(text: str):
        try:
            return tuple(cast(x) for x in text.split(",") if x.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _pipeline(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pipeline.bench import PipelineBenchConfig, result_table, run_pipeline_bench, write_json

    console = Console(stderr=False, width=max(Console().width, 180))
    config = PipelineBenchConfig(
        model=args.model, width=args.width, height=args.height, steps=args.steps, batch_sizes=args.batch_sizes,
        recipes=args.recipes, repeats=args.repeats, guidance_scale=args.guidance_scale, device=args.device,
        cache_dir=args.cache_dir, count_flops=not args.no_flops)
    result = run_pipeline_bench(config, log=lambda msg: console.print(f"[dim]{msg}[/]", highlight=False))
    console.print(result_table(result))
    if args.json:
        write_json(result, args.json)
        console.print(f"wrote {args.json}")
    return 0


def _farm(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pipeline.bench import write_json
    from producer.bench_farm import FarmBenchConfig, result_table, run_farm_bench

    console = Console(width=max(Console().width, 160))
    config = FarmBenchConfig(
        model=args.model, jobs=args.jobs, workers=args.workers, batch_size=args.batch_size, width=args.width,
        height=args.height, steps=args.steps, guidance_scale=args.guidance_scale, recipe=args.recipe,
        submit_jobs=args.submit_jobs, submit_repeats=args.submit_repeats, rounds=args.rounds,
        bare=not args.no_bare)
    result = run_farm_bench(config, log=lambda msg: console.print(f"[dim]{msg}[/]", highlight=False))
    console.print(result_table(result))
    if args.json:
        write_json(result, args.json)
        console.print(f"wrote {args.json}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench pipeline`` and ``bench farm`` to the CLI."""
    bench = subparsers.add_parser("bench", help="benchmarks: the pipeline's recipes, or the whole farm")
    sub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")

    p = sub.add_parser("pipeline", help="recipes against the diffusers baseline, one process, interleaved",
                       description="Load the model once per recipe and render the same prompts and seeds "
                                   "through each, interleaved over --repeats rounds. Prints the ERNIE-Image-Turbo SDNQ model card's columns, "
                                   "speed-up, PSNR against the baseline, and a roofline; --json writes it all.")
    p.add_argument("--model", required=True, help="offline name (tiny, sd15-arch, sd-turbo-arch, …), hub id or path")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the pipeline's (7.5)")
    p.add_argument("--batch-sizes", type=_csv(int), default=(1, 4), help="comma list (default 1,4); the baseline "
                   "always renders one image per call")
    p.add_argument("--recipes", type=_csv(str), default=("baseline", "exact", "fast"),
                   help="comma list of baseline, exact, fast or a recipe name, each optionally with overrides: "
                        "'exact:compile_unet=true' (several overrides: separate them with '+', e.g. "
                        "'exact:channels_last=false+fuse_qkv=false')")
    p.add_argument("--repeats", type=int, default=3, help="hot rounds (default 3)")
    p.add_argument("--device", default="auto")
    p.add_argument("--cache-dir", default=None, help="offline model cache (default RENDERFARM_CACHE_DIR)")
    p.add_argument("--no-flops", action="store_true", help="skip the FLOP count (one extra render per recipe)")
    p.add_argument("--json", default=None, help="write the result here")
    p.set_defaults(func=lambda args: sys.exit(_pipeline(args)))

    f = sub.add_parser("farm", help="end-to-end images/s through the local stack against a bare loop",
                       description="Start a private local stack (its own redis-server, SeaweedFS, the API, "
                                   "real workers), push --jobs renders through it, and compare with the same "
                                   "renders in a bare in-process loop. Also: seconds to submit --submit-jobs "
                                   "jobs, and the worker's per-job overhead beyond the render.")
    f.add_argument("--model", required=True, help="offline name, hub id, or null (a constant 64x64 image)")
    f.add_argument("--jobs", type=int, default=None, help="jobs to render (default: 2000 for null, 16 otherwise)")
    f.add_argument("--workers", type=int, default=1)
    f.add_argument("--batch-size", type=int, default=None, help="default: 64 for null, the recipe's otherwise")
    f.add_argument("--width", type=int, default=256)
    f.add_argument("--height", type=int, default=256)
    f.add_argument("--steps", type=int, default=4)
    f.add_argument("--guidance-scale", type=float, default=7.5)
    f.add_argument("--recipe", default="exact", help="the workers' recipe, and the bare loop's (default exact)")
    f.add_argument("--submit-jobs", type=int, default=10_000, help="jobs in the submission test (0 skips it)")
    f.add_argument("--submit-repeats", type=int, default=3, help="submissions timed (default 3; median)")
    f.add_argument("--rounds", type=int, default=2, help="farm and bare runs, alternating order (default 2)")
    f.add_argument("--no-bare", action="store_true", help="skip the bare in-process loop")
    f.add_argument("--json", default=None, help="write the result here")
    f.set_defaults(func=lambda args: sys.exit(_farm(args)))
    return bench
