"""``renderfarm bench upload``: the worker's memory while it uploads a large file, multipart from
the file (:meth:`infra.storage.s3.Storage.put_file_once`) against the bytes in memory
(:meth:`~infra.storage.s3.Storage.put_once`, the image path's call).

Place in the data flow: beside it. A video's MP4 goes to the bucket from a temporary file; this
measures that doing so keeps the worker's memory flat in the file's size, on a private SeaweedFS
(``weed mini``, :class:`infra.localstack.SeaweedS3`).

**How memory is measured.** Each row runs in a fresh Python process (``python -m
bench.farm.upload --child …``), so no row inherits another's heap. The child imports everything,
opens the farm's :class:`~infra.storage.s3.Storage` and warms it with one small write-once PUT
and a HEAD (obstore's Tokio runtime and connection pool exist before the measurement); for
``put_once`` it then reads the file into a ``bytes`` object (the body a caller holds: reported as
*held*). Then it resets the kernel's peak-RSS mark by writing ``5`` to ``/proc/self/clear_refs``
(Linux ``proc(5)``: "reset the peak resident set size ("high water mark") to the process's
current resident set size"), uploads, and reads ``VmHWM`` from ``/proc/self/status``: *peak
increase* = VmHWM after − VmRSS before the call, in bytes, all threads (obstore's included). The
kernel's RSS counters are updated in batches per thread, so figures are good to a few hundred KiB.

The file is random bytes (``os.urandom``): incompressible, as an encoded video is, and written
in 1 MiB pieces so the parent's memory stays small too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import cast

METHODS = ("put_file_once", "put_once")
_MIB = 2**20
_REPO = Path(__file__).resolve().parents[2]  # the child imports this checkout's packages


@dataclass(frozen=True)
class UploadBenchConfig:
    """What ``bench upload`` measures: ``sizes_mb``, the file sizes in MiB (each uploaded by
    every method of :data:`METHODS`, each in a fresh process)."""

    sizes_mb: tuple[float, ...] = (50.0,)

    def __post_init__(self) -> None:
        if not self.sizes_mb or min(self.sizes_mb) <= 0:
            raise ValueError("--mb needs sizes > 0 (MiB)")


def _status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1])


def child(method: str, path: str, key: str) -> dict:
    """One row, in this (fresh) process: see the module docstring. The S3 settings come from the
    environment. Returns ``{"method", "bytes", "held_bytes", "peak_increase_bytes", "seconds",
    "written", "stored_bytes"}``."""
    from infra.settings import Settings
    from infra.storage.s3 import Storage

    storage = Storage(Settings(), max_attempts=3)
    storage.put_once(f"warm/{uuid.uuid4().hex}", b"warm", "application/octet-stream", {})
    storage.exists(key)
    before_body = _status_kib("VmRSS")
    body = Path(path).read_bytes() if method == "put_once" else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS now
    start_kib = _status_kib("VmRSS")
    started = time.perf_counter()
    if body is not None:
        written = storage.put_once(key, body, "video/mp4", {"bench": "upload"})
    else:
        written = storage.put_file_once(key, Path(path), "video/mp4", {"bench": "upload"})
    seconds = time.perf_counter() - started
    peak_kib = _status_kib("VmHWM")
    return {"method": method, "bytes": os.path.getsize(path), "held_bytes": (start_kib - before_body) * 1024,
            "peak_increase_bytes": (peak_kib - start_kib) * 1024, "seconds": seconds, "written": written,
            "stored_bytes": storage.size(key)}


def _write_random(path: Path, size: int) -> None:
    with path.open("wb") as f:
        for start in range(0, size, _MIB):
            f.write(os.urandom(min(_MIB, size - start)))


def run_upload_bench(config: UploadBenchConfig, log=print) -> dict:
    """Start SeaweedFS, write each size's file, upload it by each method in a fresh process.

    Returns:
        ``{"rows": [child's dict per size and method], "cpu", "cores", "load_average", "config"}``.
    Raises:
        RuntimeError: a child failed (its stderr in the message).
    """
    from bench.farm.s3_client import _cpu_model
    from bench.farm.workload import load_average
    from infra.localstack import SeaweedS3
    from infra.storage.s3 import MULTIPART_CHUNK_BYTES, MULTIPART_CONCURRENCY, MULTIPART_THRESHOLD_BYTES

    rows = []
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="bench-upload-") as tmp, SeaweedS3(run_dir=tmp) as server:
        s3 = cast(SeaweedS3, server.wait_ready(60))
        s3.client().create_bucket(Bucket="bench")
        env = {**os.environ, "RENDERFARM_S3_ENDPOINT_URL": s3.url, "RENDERFARM_S3_BUCKET": "bench",
               "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
               "AWS_DEFAULT_REGION": "us-east-1", "RENDERFARM_ENV_FILE": ""}
        log(f"seaweedfs at {s3.url}")
        for mb in config.sizes_mb:
            path = Path(tmp) / f"upload-{mb:g}.bin"
            _write_random(path, int(mb * _MIB))
            for method in METHODS:
                done = subprocess.run([sys.executable, "-m", "bench.farm.upload", "--child", method, str(path),
                                       f"bench/{uuid.uuid4().hex}.mp4"], env=env, capture_output=True, text=True,
                                      timeout=600, cwd=_REPO)
                if done.returncode != 0:
                    raise RuntimeError(f"bench upload child ({method}, {mb:g} MiB) failed: {done.stderr[-2000:]}")
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                log(f"{mb:g} MiB by {method}: done")
            path.unlink()
    return {"config": config.__dict__, "rows": rows, "cpu": _cpu_model(), "cores": os.cpu_count(),
            "load_average": [load_before, load_average()],
            "multipart": {"threshold_bytes": MULTIPART_THRESHOLD_BYTES, "chunk_bytes": MULTIPART_CHUNK_BYTES,
                          "concurrency": MULTIPART_CONCURRENCY}}


def upload_table(result: dict):
    """One rich table: per file size and method, the body held before the call, the peak RSS
    increase during it, their sum (MiB, and as a share of the file), seconds and MiB/s."""
    from rich.table import Table

    mp = result["multipart"]
    load = " → ".join(f"{x[0]:.2f}" for x in result["load_average"])
    table = Table(title=f"Upload memory — {result['cpu']}, {result['cores']} cores, load {load}")
    for col in ("method", "file MiB", "held before MiB", "peak RSS increase MiB", "held + increase MiB",
                "(held + increase) / file", "s", "MiB/s", "stored"):
        table.add_column(col, justify="right")
    for row in result["rows"]:
        size, extra = row["bytes"] / _MIB, row["held_bytes"] + row["peak_increase_bytes"]
        table.add_row(row["method"], f"{size:.1f}", f"{row['held_bytes'] / _MIB:.1f}",
                      f"{row['peak_increase_bytes'] / _MIB:.1f}", f"{extra / _MIB:.1f}", f"{extra / row['bytes']:.2f}",
                      f"{row['seconds']:.2f}", f"{size / row['seconds']:.0f}",
                      "ok" if row["stored_bytes"] == row["bytes"] and row["written"] else "NO")
    table.caption = (f"fresh process per row; peak = VmHWM after /proc/self/clear_refs reset; multipart above "
                     f"{mp['threshold_bytes'] / _MIB:g} MiB: {mp['chunk_bytes'] / _MIB:g} MiB parts, "
                     f"{mp['concurrency']} in flight; SeaweedFS on this host")
    return table


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], sys.argv[4])))
    else:
        sys.exit("usage: python -m bench.farm.upload --child METHOD PATH KEY (run by renderfarm bench upload)")
