"""The CLI's producer side: ``renderfarm submit`` (images, or videos with ``--video``/``--frames``/``--fps``),
``status`` and ``wait``.

Data flow: **CLI** → ``RenderClient`` → status API. Bad input is refused before anything is
sent, with the field and the rule named.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from infra.schemas import BatchStatus, RenderRequest
from producer.client import NotFoundError, RenderClient, RenderFarmError
from producer.local_inputs import is_local
from producer.prompts import load_prompts


def _lora(text: str) -> dict:
    """``name:weight`` (or ``name``: weight 1) → a ``loras`` entry. Raises ValueError naming the flag."""
    name, _, weight = text.rpartition(":") if ":" in text else (text, "", "1")
    try:
        return {"name": name, "weight": float(weight)}
    except ValueError:
        raise ValueError(f"--lora {text!r}: expected NAME:WEIGHT, e.g. brand:0.8") from None


def _control(text: str, client: RenderClient) -> dict:
    """``TYPE:IMAGE[:WEIGHT]`` → a ``controls`` unit (a local IMAGE uploaded first; a key or https
    URL as given, so the weight is the part after the last colon only when it is a number).
    Raises ValueError naming the flag."""
    kind, _, rest = text.partition(":")
    image: str = rest
    weight: float | None = None
    head, _, tail = rest.rpartition(":")
    if head and not head.endswith(("https", "http")):
        try:
            image, weight = head, float(tail)
        except ValueError:
            pass  # not a number: the colon belongs to the image reference
    if not kind or not image:
        raise ValueError(f"--control {text!r}: expected TYPE:IMAGE[:WEIGHT], e.g. canny:edges.png:0.8")
    unit: dict = {"type": kind, "image": client.upload(image) if is_local(image) else image}
    if weight is not None:
        unit["weight"] = weight
    return unit


def _inputs_from_args(args: argparse.Namespace, client: RenderClient) -> dict:
    """The image fields of ``--init-image``/``--mask`` (local files uploaded first, keys and https
    URLs as given), ``--strength``, ``--lora`` and ``--control``."""
    fields: dict = {}
    for flag, target in (("init_image", "init_image"), ("mask", "mask_image")):
        ref = getattr(args, flag, None)
        if ref is not None:
            fields[target] = client.upload(ref) if is_local(ref) else ref
    if getattr(args, "strength", None) is not None:
        fields["strength"] = args.strength
    if getattr(args, "lora", None):
        fields["loras"] = [_lora(x) for x in args.lora]
    if getattr(args, "control", None):
        fields["controls"] = [_control(x, client) for x in args.control]
    return fields


def _video_fields(args: argparse.Namespace) -> dict:
    """``kind: video`` (with ``--frames``/``--fps``) when ``--video``, ``--frames`` or ``--fps`` is given; else {}."""
    frames, fps = getattr(args, "frames", None), getattr(args, "fps", None)
    if not (getattr(args, "video", False) or frames is not None or fps is not None):
        return {}
    return {"kind": "video", "num_frames": frames, "fps": fps}


def _requests_from_args(args: argparse.Namespace, extra: dict | None = None) -> list[RenderRequest]:
    prompts = list(args.prompt or []) + list(getattr(args, "text", None) or [])
    if args.prompts:
        prompts.extend(load_prompts(args.prompts))
    if not prompts:
        raise SystemExit("error: give a prompt (PROMPT, --prompt TEXT or --prompts FILE)")
    common = {k: v for k, v in {
        "model": args.model, "width": args.width, "height": args.height, "num_inference_steps": args.steps,
        "guidance_scale": args.guidance_scale, "negative_prompt": args.negative_prompt,
        "scheduler": args.scheduler, "output_format": args.format, "upscale": args.upscale,
        "upscaler": args.upscaler, **_video_fields(args), **(extra or {})}.items() if v is not None}
    return [RenderRequest(prompt=p, seed=None if args.seed is None else args.seed + i, **common)
            for i, p in enumerate(prompts)]


def _print_error(exc: Exception) -> int:
    if isinstance(exc, ValidationError):
        for err in exc.errors():
            where = ".".join(str(x) for x in err["loc"])
            print(f"error: {where + ': ' if where else ''}{err['msg']}", file=sys.stderr)
        return 2
    print(f"error: {exc}", file=sys.stderr)
    return 2 if isinstance(exc, (RenderFarmError, NotFoundError)) else 1


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        with RenderClient() as client:
            requests = _requests_from_args(args, _inputs_from_args(args, client))
            accepted = client.submit_batch(requests, priority=args.priority)
            print(accepted.batch_id)
            if args.wait:
                return _report(client.wait(accepted.batch_id, timeout=args.timeout))
    except (ValidationError, RenderFarmError, NotFoundError, OSError, ValueError) as exc:
        return _print_error(exc)
    return 0


def _report(jobs) -> int:
    failed = [j for j in jobs if j.state != "succeeded"]
    for j in failed:
        print(f"{j.job_id} {j.state}" + (f": {j.error.type}: {j.error.message}" if j.error else ""), file=sys.stderr)
    print(f"{len(jobs) - len(failed)}/{len(jobs)} succeeded", file=sys.stderr)
    return 0 if not failed else 1


def cmd_status(args: argparse.Namespace) -> int:
    try:
        with RenderClient() as client:
            status = client.status(args.id)
    except (NotFoundError, RenderFarmError) as exc:
        return _print_error(exc)
    if args.json:
        print(status.model_dump_json(indent=2))
    elif isinstance(status, BatchStatus):
        print(f"batch {status.batch_id}: {status.total} jobs, progress {status.progress:.0%}, "
              + ", ".join(f"{k} {v}" for k, v in status.counts.items() if v))
    else:
        line = f"job {status.job_id}: {status.state}, progress {status.progress:.0%}, attempts {status.attempts}"
        if status.result:
            result = status.result
            video = f", {result.num_frames} frames at {result.fps} fps" if result.num_frames and result.fps else ""
            line += f"\n  {result.key} {result.width}x{result.height}{video}\n  {result.url}"
            if result.poster_url:
                line += f"\n  poster {result.poster_url}"
        if status.error:
            line += f"\n  {status.error.type}: {status.error.message}"
        print(line)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    try:
        with RenderClient() as client:
            jobs = client.wait(args.batch_id, timeout=args.timeout)
    except (NotFoundError, RenderFarmError) as exc:
        return _print_error(exc)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs], indent=2))
    return _report(jobs)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``submit``, ``status`` and ``wait`` to the CLI."""
    p = subparsers.add_parser("submit", help="submit renders (images or videos); prints the batch id",
                              epilog='e.g. renderfarm submit --video --frames 49 "a product turning on a table"')
    p.add_argument("text", nargs="*", metavar="PROMPT", help="prompts (one job each), beside --prompt/--prompts")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts", help="a text file (one prompt a line) or a PartiPrompts-style TSV")
    p.add_argument("--model")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--guidance-scale", type=float)
    p.add_argument("--negative-prompt")
    p.add_argument("--scheduler")
    p.add_argument("--format", choices=["png", "webp", "jpeg"])
    p.add_argument("--seed", type=int, help="seed of the first prompt; the next ones count up")
    p.add_argument("--upscale", type=int, choices=[2, 4],
                   help="upscale the rendered images by 2 or 4 (with --upscaler)")
    p.add_argument("--upscaler", help="an upscaler the pool declares, e.g. esrgan-x4-arch")
    p.add_argument("--video", action="store_true",
                   help="render videos (kind video: an MP4 with a poster and a WebP preview); a video model renders "
                        "video without it")
    p.add_argument("--frames", type=int, metavar="N",
                   help="video frames (implies --video); the family's rule applies: Wan 4k+1 (max 81), LTX-Video "
                        "8k+1 (max 257); default: the family's (Wan 81, LTX-Video 121)")
    p.add_argument("--fps", type=int, metavar="N",
                   help="video frames per second, 1…60 (implies --video); default: the family's (Wan 16, LTX-Video 25)")
    p.add_argument("--init-image", help="img2img/inpainting input, or a video's first frame (image-to-video): a "
                                        "local file (uploaded), an https URL or a key")
    p.add_argument("--mask", help="inpainting mask (white = repaint), the init image's size; a file, URL or key")
    p.add_argument("--strength", type=float, help="0 < strength ≤ 1: how much of the init image is re-noised")
    p.add_argument("--lora", action="append", metavar="NAME:WEIGHT", help="an adapter the pool declares (repeatable)")
    p.add_argument("--control", action="append", metavar="TYPE:IMAGE[:WEIGHT]",
                   help="a ControlNet unit: a type the pool declares, its control image (a local file, uploaded; an "
                        "https URL or a key) and its weight, 0…2, default 1 (repeatable)")
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--wait", action="store_true", help="wait for the batch with a progress bar")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait")
    p.set_defaults(func=lambda a: sys.exit(cmd_submit(a)))

    p = subparsers.add_parser("status", help="status of one job or one batch")
    p.add_argument("id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: sys.exit(cmd_status(a)))

    p = subparsers.add_parser("wait", help="wait for a batch; exit 0 only when all jobs succeeded")
    p.add_argument("batch_id")
    p.add_argument("--timeout", type=float, default=None, help="seconds")
    p.add_argument("--json", action="store_true", help="print the jobs as JSON")
    p.set_defaults(func=lambda a: sys.exit(cmd_wait(a)))
