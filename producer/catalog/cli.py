"""``renderfarm catalog``: the command, its exit statuses and its JSON report file.

Place in the data flow: the command line → plan (:mod:`producer.catalog.plan`) → run
(:mod:`producer.catalog.run`) → report.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from producer.catalog.items import CatalogError
from producer.catalog.plan import prepare_catalog
from producer.catalog.run import MAX_CHUNK, CatalogRun, StateDir
from producer.client import NotFoundError, RenderClient, RenderFarmError


def run_catalog(path: str | Path, template: str, *, client: RenderClient, model: str,
                params: Mapping[str, Any] | None = None, negative_template: str | None = None,
                input_format: str = "auto", **run_options: Any) -> dict[str, Any]:
    """Read, plan and run a catalog to the end; returns the report. ``run_options`` go to
    :class:`CatalogRun`. Raises :class:`CatalogError` as :func:`prepare_catalog` does."""
    plans, context = prepare_catalog(path, template, model=model, params=params,
                                     negative_template=negative_template, input_format=input_format)
    run = CatalogRun(client, plans, **run_options)
    context["started_at"] = datetime.now(timezone.utc).isoformat()
    run.run()
    return run.report(**context, finished_at=datetime.now(timezone.utc).isoformat())


def _write_report(path: str | None, report: dict[str, Any]) -> None:
    if path:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        tmp.replace(target)


def cmd_catalog(args: argparse.Namespace) -> int:
    """``renderfarm catalog``. Exit status: 0 all items rendered or skipped, 1 some failed, 2 the
    catalog, template or API could not be used, 130 interrupted (re-run to resume)."""
    from infra.settings import get_settings

    params = {k: v for k, v in {"width": args.width, "height": args.height, "num_inference_steps": args.steps,
                                "guidance_scale": args.guidance_scale, "scheduler": args.scheduler,
                                "upscale": args.upscale, "upscaler": args.upscaler,
                                "output_format": args.format, "num_frames": args.frames,
                                "fps": args.fps}.items() if v is not None}
    if args.video or args.frames is not None or args.fps is not None:
        params["kind"] = "video"
    if not 1 <= args.chunk_size <= MAX_CHUNK:
        print(f"error: --chunk-size must be 1…{MAX_CHUNK}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        plans, context = prepare_catalog(args.file, args.template, model=args.model or get_settings().default_model,
                                         params=params, negative_template=args.negative_template,
                                         input_format=args.input_format)
    except CatalogError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _write_report(args.report, {"catalog": args.file, "error": str(exc)})
        return 2
    context["started_at"] = datetime.now(timezone.utc).isoformat()
    with RenderClient() as client:
        run = CatalogRun(client, plans, chunk_size=args.chunk_size, poll_s=args.poll_interval,
                         timeout_s=args.timeout, priority=args.priority, progress=progress,
                         state=StateDir(args.state_dir) if args.state_dir else None, manifest=not args.no_manifest)
        try:
            run.run()
        except KeyboardInterrupt:
            report = run.report(**context, finished_at=datetime.now(timezone.utc).isoformat())
            _write_report(args.report, report)
            print(f"interrupted: {report['rendered']} rendered, {report['skipped']} skipped, {report['failed']} "
                  f"failed, {report['pending']} pending; jobs already submitted keep rendering, a re-run resumes",
                  file=sys.stderr)
            return 130
        except (RenderFarmError, NotFoundError, httpx.HTTPError) as exc:
            print(f"error: the API failed: {exc}", file=sys.stderr)
            _write_report(args.report, {**context, "error": f"{type(exc).__name__}: {exc}"})
            return 2
        report = run.report(**context, finished_at=datetime.now(timezone.utc).isoformat())  # its manifest asks the API
    _write_report(args.report, report)
    for failure in report["failures"][:20]:
        print(f"failed: item {failure['id']!r} (line {failure['line']}): {failure['error']['type']}: "
              f"{failure['error']['message']}", file=sys.stderr)
    if len(report["failures"]) > 20:
        print(f"… and {len(report['failures']) - 20} more failures (see the report)", file=sys.stderr)
    print(f"{report['items']} items: {report['rendered']} rendered, {report['skipped']} skipped, "
          f"{report['failed']} failed in {report['wall_seconds']:.1f} s ({report['images_per_second']:.2f} renders/s)",
          file=sys.stderr)
    return 1 if report["failed"] or report["pending"] else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm catalog`` to the CLI."""
    p = subparsers.add_parser("catalog", help="render a CSV / JSON Lines catalog; items already rendered are skipped")
    p.add_argument("file", help="the catalog: CSV with a header row, or JSON Lines")
    p.add_argument("--template", required=True, help='prompt template, e.g. "a photo of {name}, {color}"')
    p.add_argument("--negative-template", help="negative prompt template (an item's negative_prompt field wins)")
    p.add_argument("--model", help="model of every item without a model field (default: RENDERFARM_DEFAULT_MODEL)")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--guidance-scale", type=float)
    p.add_argument("--scheduler")
    p.add_argument("--format", choices=["png", "webp", "jpeg"], help="image format")
    p.add_argument("--upscale", type=int, choices=[2, 4], help="upscale every image by 2 or 4 (with --upscaler)")
    p.add_argument("--upscaler", help="an upscaler the pool declares, e.g. esrgan-x4-arch")
    p.add_argument("--video", action="store_true",
                   help="every item a video unless its video column says no (a video column or frames/fps "
                        "columns make single items videos without it)")
    p.add_argument("--frames", type=int, metavar="N", help="video frames of every video item (implies --video; "
                                                           "the family's rule: Wan 4k+1, LTX-Video 8k+1)")
    p.add_argument("--fps", type=int, metavar="N", help="video frames per second, 1…60 (implies --video)")
    p.add_argument("--input-format", choices=["auto", "csv", "jsonl"], default="auto",
                   help="catalog format (default: by extension, else sniffed)")
    p.add_argument("--report", help="write the JSON report here (with a manifest: item id, S3 key, presigned URL)")
    p.add_argument("--no-manifest", action="store_true",
                   help="leave the manifest out of the report (it takes one more lookup of the keys)")
    p.add_argument("--state-dir", help="also remember succeeded items here (a re-run still skips one only when "
                                       "the farm confirms its image)")
    p.add_argument("--chunk-size", type=int, default=1000, help=f"jobs per batch, 1…{MAX_CHUNK} (default 1000)")
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--timeout", type=float, help="seconds to wait in all; unfinished items count as failed")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between status polls")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal; else a line every 30 s)")
    p.set_defaults(func=lambda a: sys.exit(cmd_catalog(a)))
