"""``renderfarm bench s3``: the S3 client's cost per operation, boto3 against obstore.

Place in the data flow: beside it. The worker's PUT of a job's image (write-once), the API's
presigned GET URL and its HEAD are the S3 calls made per job; this module times each through
the farm's own client (:class:`infra.storage.s3.Storage`, boto3) and through ``obstore`` (Python
bindings of the Rust ``object_store`` crate), against a private SeaweedFS (``weed mini``) that
checks signatures as AWS does.

For each operation, object size and thread count it reports the client's CPU per operation
(the process's CPU seconds, all threads, including obstore's Tokio runtime threads, divided by
the operations) and operations per second (wall clock). The two clients run interleaved in
``rounds``, alternating which goes first, so a change of load hits both. SeaweedFS's own CPU
is not counted (a production bucket is remote).

The objects are PNGs of :func:`pipeline.null.null_image` at each size, encoded as the worker
encodes them (:func:`infra.storage.images.encode_image`), so the bytes are those of a render.

It also checks what an adoption would have to keep, on the same server: a second write-once PUT
of a key is refused (boto3: ``If-None-Match: *`` → 412; obstore: ``mode="create"``), and the
presigned URL of each client fetches the object with a plain HTTP GET (as a browser does).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

OPERATIONS = ("put", "presign", "head")


@dataclass(frozen=True)
class S3BenchConfig:
    """What ``bench s3`` measures.

    Args:
        sizes: square image sides in pixels (objects are the PNG of each).
        threads: concurrent callers sharing one client (e.g. the worker's upload threads).
        ops: operations per (client, operation, size, threads) cell and round.
        rounds: interleaved repetitions; the table shows the median.
    """

    sizes: tuple[int, ...] = (64, 512)
    threads: tuple[int, ...] = (1, 8)
    ops: int = 200
    rounds: int = 2

    def __post_init__(self) -> None:
        if self.ops < 1 or self.rounds < 1 or not self.sizes or not self.threads:
            raise ValueError("ops and rounds must be >= 1, sizes and threads non-empty")


class Boto3Client:
    """boto3 as the farm used it before obstore: ``put_object(IfNoneMatch="*")`` (412 when the key
    exists), ``generate_presigned_url("get_object")``, ``head_object``, on the client that
    :class:`infra.storage.s3.Storage` configures (adaptive retries, a pool of ``pool`` + 2)."""

    name = "boto3"

    def __init__(self, storage):
        self.client, self.bucket, self.expires = storage.client, storage.bucket, storage.presign_expires_s

    def put(self, key: str, body: bytes, content_type: str, metadata: dict[str, str]) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType=content_type,
                                   Metadata=metadata, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412:
                return False
            raise

    def presign(self, key: str) -> str:
        return self.client.generate_presigned_url("get_object", Params={"Bucket": self.bucket, "Key": key},
                                                  ExpiresIn=self.expires)

    def head(self, key: str) -> int:
        return int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])


class ObstoreClient:
    """The farm's client (:class:`infra.storage.s3.Storage`, obstore): ``put_once`` (a conditional
    PUT, ``mode="create"``), ``presigned_url``, ``size`` (HEAD)."""

    name = "obstore"

    def __init__(self, storage):
        self.storage = storage

    def put(self, key: str, body: bytes, content_type: str, metadata: dict[str, str]) -> bool:
        return self.storage.put_once(key, body, content_type, metadata)

    def presign(self, key: str) -> str:
        return self.storage.presigned_url(key)

    def head(self, key: str) -> int:
        return self.storage.size(key)


def _payload(side: int) -> tuple[bytes, str, dict[str, str]]:
    from infra.schemas import RenderRequest
    from infra.storage.images import encode_image, format_parameters
    from infra.storage.s3 import object_metadata
    from pipeline.null import null_image

    request = RenderRequest(prompt="a lighthouse at dusk, 35mm", width=side, height=side, seed=7)
    parameters = format_parameters(request, model="null")
    body, content_type = encode_image(null_image(side, side, 7), "png", parameters)
    return body, content_type, object_metadata({"job-id": "bench"}, parameters)


def _put(client, payload: tuple[bytes, str, dict[str, str]], key: str) -> bool:
    return client.put(key, *payload)


def _timed(call: Callable[[str], object], keys: list[str], threads: int) -> tuple[float, float]:
    """(CPU s, wall s) of ``call`` over ``keys`` on ``threads`` threads."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if threads == 1:
        for key in keys:
            call(key)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(call, keys))
    return time.process_time() - cpu0, time.perf_counter() - wall0


def _checks(clients, payload) -> dict[str, dict[str, bool]]:
    """Write-once and a presigned URL that a plain HTTP GET can use, per client."""
    import httpx

    body, content_type, metadata = payload
    out = {}
    for client in clients:
        key = f"check/{client.name}/{uuid.uuid4().hex}.png"
        first = client.put(key, body, content_type, metadata)
        second = client.put(key, b"other bytes", content_type, metadata)
        got = httpx.get(client.presign(key), timeout=10)
        out[client.name] = {"write_once": first and not second,
                            "presigned_get": got.status_code == 200 and got.content == body}
    return out


def run_s3_bench(config: S3BenchConfig, log=print) -> dict:
    """Start SeaweedFS, then time PUT (write-once), presign (GET) and HEAD through both clients.

    Returns:
        ``{"cells": [{"op", "size", "threads", "client", "cpu_ms_per_op", "ops_per_s", "bytes"}],
        "checks": {client: {"write_once", "presigned_get"}}, "cpu", "load_average"}``; each
        cell's figures are the median over rounds.
    """
    from bench.farm.workload import load_average
    from infra.localstack import SeaweedS3, patched_environ
    from infra.settings import Settings
    from infra.storage.s3 import Storage

    with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp, SeaweedS3(run_dir=tmp) as server:
        s3 = cast(SeaweedS3, server.wait_ready(60))
        s3.client().create_bucket(Bucket="bench")
        env = {"RENDERFARM_S3_ENDPOINT_URL": s3.url, "RENDERFARM_S3_BUCKET": "bench",
               "AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
               "AWS_DEFAULT_REGION": "us-east-1"}
        with patched_environ(env):
            settings = Settings()
            pool = max(config.threads)
            storage = Storage(settings, max_attempts=3, max_pool_connections=pool + 2)
            clients: list[Boto3Client | ObstoreClient] = [Boto3Client(storage), ObstoreClient(storage)]
            payloads = {side: _payload(side) for side in config.sizes}
            log(f"seaweedfs at {s3.url}; objects {', '.join(f'{s}²: {len(p[0])} B' for s, p in payloads.items())}")
            checks = _checks(clients, payloads[config.sizes[0]])
            samples: dict[tuple, list[tuple[float, float]]] = {}
            for rnd in range(config.rounds):
                order = clients if rnd % 2 == 0 else clients[::-1]
                for side in config.sizes:
                    for threads in config.threads:
                        for client in order:
                            keys = [f"{client.name}/{side}/{uuid.uuid4().hex}.png" for _ in range(config.ops)]
                            calls: dict[str, Callable[[str], object]] = {
                                "put": functools.partial(_put, client, payloads[side]),
                                "presign": client.presign, "head": client.head}
                            for op in OPERATIONS:
                                cpu, wall = _timed(calls[op], keys, threads)
                                samples.setdefault((op, side, threads, client.name), []).append((cpu, wall))
                    log(f"round {rnd + 1}/{config.rounds}: {side}² done")
    cells = [{"op": op, "size": side, "threads": threads, "client": name, "bytes": len(payloads[side][0]),
              "cpu_ms_per_op": statistics.median(c for c, _ in runs) * 1000 / config.ops,
              "ops_per_s": config.ops / statistics.median(w for _, w in runs)}
             for (op, side, threads, name), runs in samples.items()]
    return {"config": config.__dict__, "cells": cells, "checks": checks, "cpu": _cpu_model(),
            "cores": os.cpu_count(), "load_average": load_average()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def s3_table(result: dict):
    """One rich table: per operation, size and threads, each client's CPU ms/op and ops/s, and
    obstore's ratio to boto3 (CPU: lower is better; ops/s: higher is better)."""
    from rich.table import Table

    load = ", ".join(f"{x:.2f}" for x in result["load_average"])
    table = Table(title=f"S3 client per operation — {result['cpu']}, {result['cores']} cores, load {load}")
    for col in ("op", "size", "threads", "boto3 CPU ms/op", "obstore CPU ms/op", "CPU ratio",
                "boto3 ops/s", "obstore ops/s", "ops/s ratio"):
        table.add_column(col, justify="right")
    by = {(c["op"], c["size"], c["threads"], c["client"]): c for c in result["cells"]}
    for op, side, threads, name in by:
        if name != "boto3":
            continue
        b, o = by[op, side, threads, "boto3"], by[op, side, threads, "obstore"]
        table.add_row(op, f"{side}² ({b['bytes'] // 1024} KiB)", str(threads),
                      f"{b['cpu_ms_per_op']:.3f}", f"{o['cpu_ms_per_op']:.3f}",
                      f"{o['cpu_ms_per_op'] / b['cpu_ms_per_op']:.2f}", f"{b['ops_per_s']:.0f}",
                      f"{o['ops_per_s']:.0f}", f"{o['ops_per_s'] / b['ops_per_s']:.2f}")
    checks = "; ".join(f"{name}: write-once {'yes' if c['write_once'] else 'NO'}, presigned GET "
                       f"{'yes' if c['presigned_get'] else 'NO'}" for name, c in result["checks"].items())
    table.caption = checks
    return table
