"""``renderfarm worker``'s command-line arguments.

Kept apart from :mod:`worker.main` so that building the CLI parser imports no torch or
diffusers: the CLI root imports every command module at start, and ``renderfarm status``
should not pay seconds for a pipeline it never loads.
"""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> None:
    from worker.main import exit_after, run_worker  # heavy: celery, torch, diffusers

    exit_after(run_worker(args))


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm worker`` to the CLI."""
    p = subparsers.add_parser("worker", help="run one worker that renders one pool's jobs")
    p.add_argument("--model", required=True, help="hub id, local path, an offline name (tiny, sd15-arch, …) or null")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N, mps, xpu or npu")
    p.add_argument("--recipe", default=None,
                   help="exact (default: RENDERFARM_RECIPE), fast (allows approximations: half precision, tiny VAE…), "
                        "baseline, or a named recipe")
    p.add_argument("--pool", default=None,
                   help="pool to serve: a declared pool of RENDERFARM_POOLS whose model must be "
                                                "--model (default: the one declared pool of the model, or, with "
                                                "none declared, derived from the model)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="jobs per batch (default: measured from device memory, capped by the recipe)")
    p.add_argument("--name", default=None, help="worker name (default: pool@host-pid)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=_run)
