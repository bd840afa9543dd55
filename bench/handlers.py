"""The ``bench`` commands' handlers: each turns parsed arguments into a benchmark's config, runs
it and prints its tables (and writes its JSON with ``--json``).

Place in the data flow: beside it, called by :mod:`bench.cli`'s parsers. Like the parsers, this
module imports only the standard library at module level: the CLI root imports both at start, so
the heavy modules (torch, diffusers, celery) are imported inside the handlers. Each handler
returns the command's exit status: 0, or 2 for a refused config (a bad spec, recipe, override,
size or allocator setting).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _console():
    from rich.console import Console

    return Console(width=max(Console().width, 200))


def run_and_report(name: str, run, tables, json_path: str | None) -> int:
    """Run one benchmark and report it: ``run(log)`` returns the result dict; a ValueError (a bad
    spec, recipe, override, size or allocator setting) prints ``name: message`` and returns 2, no
    traceback; else ``tables(result)`` (one rich table or a list of them) is printed and the
    result is written to ``json_path`` when given. Returns the exit status."""
    from bench.pipeline import write_json

    console = _console()
    try:
        result = run(lambda msg: console.print(f"[dim]{msg}[/]", highlight=False))
    except ValueError as exc:
        console.print(f"[red]{name}: {exc}[/]", highlight=False)
        return 2
    printed = tables(result)
    for table in printed if isinstance(printed, list) else [printed]:
        console.print(table)
    if json_path:
        write_json(result, json_path)
        console.print(f"wrote {json_path}")
    return 0


def _two_stage(args: argparse.Namespace) -> int:
    from bench.pipeline.twostage import TwoStageConfig, run_two_stage_bench, two_stage_table

    config = TwoStageConfig(model=args.model, upscaler=args.upscaler, target=args.target, steps=args.steps,
                            batch=args.two_stage_batch, repeats=args.repeats, device=args.device,
                            diffusion_upscaler=args.diffusion_upscaler, upscale_steps=args.upscale_steps)
    return run_and_report("bench pipeline --two-stage", lambda log: run_two_stage_bench(config, log=log),
                          two_stage_table, args.json)


def _video(args: argparse.Namespace) -> int:
    from bench.pipeline.video import VideoBenchConfig, run_video_bench, video_table

    guidance = 5.0 if args.guidance_scale is None else args.guidance_scale
    config = VideoBenchConfig(model=args.model, width=args.width, height=args.height, frames=args.frames,
                              steps=args.steps, guidance_scale=guidance,
                              repeats=args.repeats, device=args.device, cache_threshold=args.cache_threshold,
                              embeds=args.embeds, overrides=args.video_overrides)
    return run_and_report("bench pipeline --video", lambda log: run_video_bench(config, log=log), video_table,
                          args.json)


def _modes(args: argparse.Namespace) -> int:
    from bench.pipeline.image_modes import ModesConfig, modes_table, run_modes_bench

    config = ModesConfig(model=args.model, width=args.width, height=args.height, steps=args.steps,
                         strength=args.strength, repeats=args.repeats, device=args.device,
                         adapters=args.adapters, overrides=args.modes_overrides or "",
                         controlnet=bool(args.controlnet), ip_adapter=bool(args.ip_adapter))
    return run_and_report("bench pipeline --modes", lambda log: run_modes_bench(config, log=log), modes_table,
                          args.json)


def pipeline(args: argparse.Namespace) -> int:
    """``bench pipeline``: the rows side by side (or ``--two-stage``, ``--modes``). Returns the exit status."""
    from bench.pipeline import PipelineBenchConfig, result_table, run_pipeline_bench, write_json

    if args.two_stage:
        return _two_stage(args)
    if args.modes:
        return _modes(args)
    if args.video:
        return _video(args)
    config = PipelineBenchConfig(
        model=args.model, width=args.width, height=args.height, steps=args.steps, batch_sizes=args.batch_sizes,
        recipes=args.recipes, repeats=args.repeats, guidance_scale=args.guidance_scale, device=args.device,
        cache_dir=args.cache_dir, count_flops=not args.no_flops, measure_gemm=not args.no_gemm,
        sequential=args.sequential, table=args.table)
    def checkpoint(result: dict) -> None:  # the JSON so far after every round: a run stopped from outside keeps it
        if args.json:
            write_json(result, args.json)

    return run_and_report("bench pipeline", lambda log: run_pipeline_bench(config, log=log, checkpoint=checkpoint),
                          result_table, args.json)


def show(args: argparse.Namespace) -> int:
    """A saved result's table: ``bench pipeline`` (summarized again from its rounds), ``bench ready``
    or ``bench farm``."""
    from bench.farm.farm_table import result_table as farm_table
    from bench.pipeline import result_table
    from bench.pipeline.tables import resummarize
    from bench.pipeline.time_to_ready import ready_table

    def load(_log) -> dict:
        try:
            with open(args.file, encoding="utf-8") as f:
                result = json.load(f)
        except OSError as exc:
            raise ValueError(f"cannot read {args.file}: {exc.strerror}") from None
        if result.get("benchmark") == "pipeline":
            return resummarize(result, args.skip_rounds)
        if result.get("benchmark") == "farm" or {"cold", "cached"} <= set(result):
            return result
        raise ValueError(f"{args.file}: not a bench pipeline, ready or farm result")

    def tables(result: dict):
        if result.get("benchmark") == "pipeline":
            return result_table(result)
        return farm_table(result) if result.get("benchmark") == "farm" else ready_table(result)

    return run_and_report("bench show", load, tables, args.json)


def profile(args: argparse.Namespace) -> int:
    """``bench profile``: one hot render under torch.profiler. Returns the exit status."""
    from bench.pipeline import ProfileConfig, profile_tables, run_profile

    config = ProfileConfig(model=args.model, recipe=args.recipe, width=args.width, height=args.height,
                           steps=args.steps, batch_size=args.batch_size, guidance_scale=args.guidance_scale,
                           device=args.device, cache_dir=args.cache_dir, trace=args.trace)
    return run_and_report("bench profile", lambda log: run_profile(config, log=log),
                          lambda result: list(profile_tables(result)), args.json)


def farm(args: argparse.Namespace) -> int:
    """``bench farm``: the whole path through a private local stack against a bare loop. Returns the exit status."""
    from bench.farm.farm import run_farm_bench
    from bench.farm.farm_table import result_table
    from bench.farm.workload import FarmBenchConfig

    config = FarmBenchConfig(
        model=args.model, jobs=args.jobs, workers=args.workers, batch_size=args.batch_size, width=args.width,
        height=args.height, steps=args.steps, guidance_scale=args.guidance_scale, recipe=args.recipe,
        submit_jobs=args.submit_jobs, submit_repeats=args.submit_repeats, rounds=args.rounds,
        bare=not args.no_bare, render_ms_per_image=args.render_ms_per_image, output_format=args.output_format,
        submit_appendfsync=tuple(args.submit_appendfsync), gpu_ms_per_image=args.gpu_ms)
    return run_and_report("bench farm", lambda log: run_farm_bench(config, log=log), result_table, args.json)


def submit(args: argparse.Namespace) -> int:
    """``bench submit``: one batch submission alone. Returns the exit status."""
    from bench.farm.submit import SubmitBenchConfig, run_submit_bench, submit_table

    config = SubmitBenchConfig(jobs=args.jobs, repeats=args.repeats)
    return run_and_report("bench submit", lambda log: run_submit_bench(config, log=log), submit_table, args.json)


def messages(args: argparse.Namespace) -> int:
    """``bench messages``: broker CPU per job, one message per job against one per group. Returns the exit status."""
    from bench.farm.messages import MessagesBenchConfig, messages_table, run_messages_bench

    config = MessagesBenchConfig(jobs=args.jobs, group=args.group, prefetch=args.prefetch, rounds=args.rounds)
    return run_and_report("bench messages", lambda log: run_messages_bench(config, log=log), messages_table,
                          args.json)


def redis(args: argparse.Namespace) -> int:
    """``bench redis``: jobs/s and redis-server CPU as null workers are added. Returns the exit status."""
    import os

    from bench.farm.saturation import run_saturation, saturation_table
    from bench.farm.workload import FarmBenchConfig

    def run(log) -> dict:  # a bad option is a ValueError here: run_and_report prints it, exit 2
        config = FarmBenchConfig(model="null", jobs=args.jobs, batch_size=args.batch_size, rounds=args.rounds,
                                 submit_jobs=0, bare=False, split_state=args.split_state,
                                 broker_shards=args.broker_shards).resolved()
        return run_saturation(config, args.workers, log=log)

    return run_and_report("bench redis", run, lambda result: saturation_table(result, os.cpu_count() or 0),
                          args.json)


def durable(args: argparse.Namespace) -> int:
    """``bench durable``: one batch's submission per durable-ack mode. Returns the exit status."""
    from bench.farm.durable_ack import DurableBenchConfig, durable_table, run_durable_bench

    def run(log) -> dict:  # a bad option is a ValueError here: run_and_report prints it, exit 2
        config = DurableBenchConfig(batch=args.batch, rounds=args.rounds, appendfsync=args.appendfsync)
        return run_durable_bench(config, log=log)

    return run_and_report("bench durable", run, durable_table, args.json)


def s3(args: argparse.Namespace) -> int:
    """``bench s3``: boto3 against obstore per S3 operation. Returns the exit status."""
    from bench.farm.s3_client import S3BenchConfig, run_s3_bench, s3_table

    config = S3BenchConfig(sizes=args.sizes, threads=args.threads, ops=args.ops, rounds=args.rounds)
    return run_and_report("bench s3", lambda log: run_s3_bench(config, log=log), s3_table, args.json)


def encode(args: argparse.Namespace) -> int:
    """``bench encode``: image encoders per image. Returns the exit status."""
    from bench.farm.encoders import EncodeBenchConfig, encode_tables, run_encode_bench

    config = EncodeBenchConfig(sizes=args.sizes, repeats=args.repeats, pool_images=args.pool_images)
    return run_and_report("bench encode", lambda log: run_encode_bench(config, log=log), encode_tables, args.json)


def upload(args: argparse.Namespace) -> int:
    """``bench upload``: memory during a large upload, from a file and from bytes. Returns the exit status."""
    from bench.farm.upload import UploadBenchConfig, run_upload_bench, upload_table

    return run_and_report("bench upload", lambda log: run_upload_bench(UploadBenchConfig(sizes_mb=args.mb), log=log),
                          upload_table, args.json)


def cores(args: argparse.Namespace) -> int:
    """``bench cores``: host cores a GPU of a given speed needs. Returns the exit status."""
    from bench.farm.cores import CoresConfig, cores_table, run_cores_bench

    config = CoresConfig(sizes=args.sizes, formats=args.formats, gpu_ms_per_image=args.gpu_ms, jobs=args.jobs,
                         batch_size=args.batch_size, rounds=args.rounds)
    return run_and_report("bench cores", lambda log: run_cores_bench(config, log=log), cores_table, args.json)


def ready(args: argparse.Namespace) -> int:
    """``bench ready``: time to ready, cold and cached; a refused config prints why and returns 2."""
    from bench.pipeline.time_to_ready import DEFAULT_OVERRIDES, ReadyConfig, ready_table, run_ready_bench

    try:
        config = ReadyConfig(model=args.model, device=args.device, recipe=args.recipe, buckets=args.buckets,
                             sizes=args.sizes, steps=args.steps, guidance_scale=args.guidance_scale,
                             overrides=args.overrides or json.dumps(DEFAULT_OVERRIDES), timeout_s=args.timeout,
                             size_batch=args.size_batch, controls=args.controls)
    except ValueError as exc:
        print(f"bench ready: {exc}", file=sys.stderr)
        return 2
    keep = Path(args.artifact_dir) if args.artifact_dir else None
    return run_and_report("bench ready", lambda log: run_ready_bench(config, log=log, keep_in=keep), ready_table,
                          args.json)
