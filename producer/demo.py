"""``renderfarm demo``: the whole data flow once, end to end, on this machine.

It brings the local stack up (:class:`infra.localstack.LocalStack`), acts as the producer (prompts →
:class:`~infra.schemas.RenderRequest` → ``RenderClient.submit_batch``), waits for the workers
with a progress bar, downloads the images from S3 into ``--out``, prints a summary, and stops
the stack. Exit code 0 only when every job succeeded.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from infra.localstack import LocalStack, ProcessExited, patched_environ
from infra.localstack.cli import add_stack_arguments, foreground, stack_from_args
from infra.pools import OFFLINE_FAMILIES
from producer.prompts import DEFAULT_PROMPTS, PromptFileError, load_prompts

__all__ = ["demo_command", "register", "select_prompts"]


def select_prompts(prompts: Sequence[str], count: int, seed: int = 0, *, shuffle: bool = True) -> list[str]:
    """``count`` prompts from ``prompts``, the same for the same arguments.

    With ``shuffle``, a seeded random order (a sample without repeats while ``count`` allows);
    without, file order. Either order is cycled when ``count`` exceeds ``len(prompts)``.
    """
    if not prompts:
        raise ValueError("no prompts to select from")
    order = random.Random(seed).sample(list(prompts), len(prompts)) if shuffle else list(prompts)
    return list(itertools.islice(itertools.cycle(order), count))


def _build_requests(args: argparse.Namespace, prompts: list[str]) -> list[Any]:
    from infra.schemas import RenderRequest

    return [
        RenderRequest(
            prompt=prompt,
            model=args.model,
            width=args.width,
            height=args.height,
            num_inference_steps=args.steps,
            seed=args.seed + i,
            metadata={"source": "renderfarm-demo"},
        )
        for i, prompt in enumerate(prompts)
    ]


def demo_command(args: argparse.Namespace) -> int:
    """Run the demo; returns 0 when every job succeeded, 1 otherwise (2 for a bad prompt file)."""
    console = Console()
    if args.count < 1:
        console.print("[red]--count must be at least 1[/]")
        return 2
    if args.prompts:
        try:
            prompts = select_prompts(load_prompts(args.prompts), args.count, args.seed)
        except PromptFileError as exc:
            console.print(f"[red]{exc}[/]")
            return 2
        source = str(args.prompts)
    else:
        prompts = select_prompts(DEFAULT_PROMPTS, args.count, shuffle=False)
        source = "built-in prompts"
    try:
        requests = _build_requests(args, prompts)
    except ValidationError as exc:
        console.print(f"[red]invalid request:[/] {exc}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    stack = stack_from_args(args, console)
    console.print(f"starting the local stack in {stack.run_dir} …")
    started = time.monotonic()
    try:
        with foreground(stack), patched_environ(stack.env):
            return _run(console, stack, requests, args, out, source, time.monotonic() - started)
    except KeyboardInterrupt:
        console.print("interrupted; the stack is stopped.")
        return 130
    except (ProcessExited, TimeoutError, ConnectionError) as exc:
        console.print(f"[red]the stack did not start:[/] {exc}")
        return 1


def _run(console: Console, stack: LocalStack, requests: list[Any], args: argparse.Namespace,
         out: Path, source: str, startup_s: float) -> int:  # fmt: skip
    from producer import RenderClient

    with RenderClient(api_url=stack.api.url) as client:
        return _submit_and_report(console, client, stack, requests, args, out, source, startup_s)


def _submit_and_report(console: Console, client: Any, stack: LocalStack, requests: list[Any],
                       args: argparse.Namespace, out: Path, source: str, startup_s: float) -> int:  # fmt: skip
    console.print(f"submitting {len(requests)} jobs ({source}, {args.width}×{args.height}, "
                  f"{args.steps} steps, model {args.model}) …")  # fmt: skip
    t0 = time.monotonic()
    batch = client.submit_batch(requests)
    try:
        statuses = client.wait(batch.batch_id, timeout=args.timeout, progress=True)
    except TimeoutError:
        dead = ", ".join(p.name for p in stack.exited()) or "none"
        console.print(f"[red]batch {batch.batch_id} not done after {args.timeout:.0f} s[/] "
                      f"(exited services: {dead}; logs in {stack.run_dir})")  # fmt: skip
        return 1
    wall_s = time.monotonic() - t0

    succeeded = [s for s in statuses if s.state == "succeeded"]
    failed = [s for s in statuses if s.state != "succeeded"]
    for status in succeeded:
        client.download(status, out)
    for status in failed[:5]:
        reason = f"{status.error.type}: {status.error.message}" if status.error else status.state
        console.print(f"[red]job {status.job_id} {status.state}[/]: {reason}")

    table = Table(title=f"renderfarm demo — batch {batch.batch_id}")
    table.add_column("")
    table.add_column("result")
    rows = [
        ("jobs", str(len(statuses))),
        ("succeeded", str(len(succeeded))),
        ("failed", str(len(failed))),
        ("workers", f"{len(stack.workers)} × {args.model}"),
        ("stack start-up (s)", f"{startup_s:.1f}"),
        ("wall time, submit → done (s)", f"{wall_s:.1f}"),
        ("images/s", f"{len(succeeded) / wall_s:.2f}" if wall_s > 0 else "-"),
        ("bucket", f"s3://{stack.bucket} at {stack.s3.url}"),
        ("output dir", str(out.resolve())),
        ("logs", str(stack.run_dir)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if args.model in OFFLINE_FAMILIES:
        console.print(random_weights_note(args.model, out.resolve()))
    return 0 if len(succeeded) == len(requests) else 1


#: A real model for the demo, from the Hugging Face Hub (the Stable Diffusion 1.5 weights).
REAL_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"


def random_weights_note(model: str, out: Path) -> str:
    """What a demo of an offline build rendered (noise: its weights are random) and the commands
    that render a real model instead, on a machine that reaches the model hub."""
    real = f"renderfarm demo --model {REAL_MODEL} --width 512 --height 512 --steps 20 --count 8"
    return (f"[yellow]{model} is an offline build with random weights:[/] the images in {out} are coloured "
            "noise. They show the farm at work (queue, batches, workers, S3), not a model's pictures.\n"
            f"A real model, on a machine that reaches the Hugging Face Hub (the weights, about 4 GB, are "
            f"downloaded once):\n  {real}                 # a CPU: minutes an image on 2 cores\n"
            f"  {real} --device cuda   # a CUDA GPU: under a second an image")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``demo`` to the CLI's argparse subparsers; the handler is ``args.func(args) -> int``."""
    parser = subparsers.add_parser(
        "demo",
        help="bring the local stack up, render a prompt sample, summarize, shut down",
        description="Start the local stack, submit --count prompts (sampled from --prompts, or the "
        "built-in ones), wait with a progress bar, download the images to --out, print a summary.",
    )
    parser.add_argument("--prompts", type=Path, default=None,
                        help="text file (one prompt a line) or PartiPrompts-style TSV")  # fmt: skip
    parser.add_argument("--count", type=int, default=64, help="jobs to submit (default 64)")
    parser.add_argument("--width", type=int, default=256, help="pixels, multiple of 8 (default 256)")
    parser.add_argument("--height", type=int, default=256, help="pixels, multiple of 8 (default 256)")
    parser.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed; job i gets seed+i (default 0)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait (default 3600)")
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="image dir (default ./demo-output)")
    add_stack_arguments(parser)
    parser.set_defaults(func=demo_command)
    return parser
