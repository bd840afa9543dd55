"""``renderfarm download BATCH_ID [--dir D]``: a batch's images (and videos) onto the disk, with a progress bar.

Data flow: status API (the batch's jobs, each succeeded one with a presigned GET URL) → **here**
→ the images, fetched straight from the bucket through those URLs (no S3 credentials), a few
at a time, into ``D/<job id>.<ext>`` (a video: ``D/<job id>.mp4`` and its poster frame
``D/<job id>.poster.<ext>``). Jobs that did not succeed are listed, not fetched.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from infra.schemas import JobStatus
from producer.client import NotFoundError, RenderClient, RenderFarmError

#: Images fetched at once.
CONCURRENCY = 4


@dataclass
class Downloaded:
    """What :func:`download_batch` did: the files written, their total size in bytes, and the
    jobs without an image (failed, canceled, or not finished yet)."""

    paths: list[Path] = field(default_factory=list)
    bytes: int = 0
    without_image: list[JobStatus] = field(default_factory=list)


def download_batch(client: RenderClient, batch_id: str, dest: str | Path, *, progress: bool | None = None,
                   concurrency: int = CONCURRENCY) -> Downloaded:
    """Save every succeeded job's image (a video's MP4 and poster) of ``batch_id`` into ``dest`` (created if needed), in
    submission order of the jobs; a tqdm bar (images, with the bytes so far) on a terminal.

    Raises:
        NotFoundError: unknown batch id. RenderFarmError: the API refused.
        httpx.HTTPError: an image could not be fetched.
    """
    jobs = client.batch_jobs(batch_id)
    out = Downloaded(without_image=[j for j in jobs if j.state != "succeeded" or j.result is None])
    ready = [j for j in jobs if j.state == "succeeded" and j.result is not None]
    show = sys.stderr.isatty() if progress is None else progress
    with tqdm(total=len(ready), unit="img", desc=f"batch {batch_id[:8]}", disable=not show, file=sys.stderr) as bar, \
            ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="download") as pool:
        for path in pool.map(lambda job: client.download(job, dest, poster=True), ready):
            out.paths.append(path)
            out.bytes += path.stat().st_size
            bar.update(1)
            bar.set_postfix(MiB=f"{out.bytes / 2**20:.1f}", refresh=False)
    return out


def cmd_download(args: argparse.Namespace) -> int:
    """Exit 0 when every job's image was saved, 1 when some jobs have none, 2 when the batch or
    the API is unusable."""
    dest = Path(args.dir) if args.dir else Path(args.batch_id)
    try:
        with RenderClient() as client:
            done = download_batch(client, args.batch_id, dest)
    except (NotFoundError, RenderFarmError, httpx.HTTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for job in done.without_image:
        reason = f": {job.error.type}: {job.error.message}" if job.error else ""
        print(f"{job.job_id} {job.state}{reason}", file=sys.stderr)
    print(f"{len(done.paths)} image(s), {done.bytes / 2**20:.1f} MiB in {dest}"
          + (f"; {len(done.without_image)} job(s) without an image" if done.without_image else ""), file=sys.stderr)
    return 1 if done.without_image else 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm download`` to the CLI."""
    p = subparsers.add_parser("download", help="save a batch's images (progress bar)")
    p.add_argument("batch_id")
    p.add_argument("--dir", help="where to save them (default: ./BATCH_ID)")
    p.set_defaults(func=cmd_download)
