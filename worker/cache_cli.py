"""``renderfarm cache ls|rm``: the operator's commands for the workers' shared compile cache.

Data flow: operator → **this CLI** → ``compile-cache/<key>.bin`` and ``compile-cache/<key>.ir/`` in the farm's bucket
(``infra.storage.compile_artifacts``; endpoint, bucket and credentials as the workers read them:
``RENDERFARM_S3_*``, ``AWS_*``). Workers save an artifact after a warm-up that compiled and load
it at their next start (``pipeline.ready``); ``rm`` only costs the next worker a compile.
Only the standard library is imported here; boto3 inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta, timezone


def _store():
    """The farm's compile-cache store; exits 2 with a message when no S3 credentials are found
    (boto3's chain, or the client settings file ``renderfarm up`` writes)."""
    import boto3

    from infra.settings import get_settings
    from infra.storage.compile_artifacts import CompileCacheStore
    from infra.storage.s3 import Storage

    settings = get_settings()
    if boto3.Session(**settings.s3_credentials()).get_credentials() is None:
        print("renderfarm cache: no S3 credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
              "RENDERFARM_S3_ENDPOINT_URL for a non-AWS S3), or run it where `renderfarm up` wrote .renderfarm/env "
              "once the stack is up", file=sys.stderr)
        raise SystemExit(2)
    return CompileCacheStore(Storage(settings, max_attempts=3))


def _age(modified: datetime, now: datetime) -> str:
    seconds = max(0, int((now - modified).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def ls_command(args: argparse.Namespace) -> int:
    """List the artifacts (key, kind, model, device, versions, size, age), oldest first, or JSON lines.
    Kinds: ``inductor`` (compiled graphs and kernels), ``openvino-ir:unet`` and ``openvino-ir:vae.decoder``
    (a converted model), ``sizing`` (a batch sizing record, ``pipeline.sizing``) and ``startup`` (a
    pool's last start-up times, the next start's estimates)."""
    from infra.storage.compile_artifacts import describe

    artifacts = _store().list()
    if args.json:
        for artifact in artifacts:
            print(describe(artifact))
        return 0
    now = datetime.now(timezone.utc)
    width = max([44, *(len(a.key) + 1 for a in artifacts)])
    print(f"{'KEY':<{width}}{'KIND':<25}{'MODEL':<20}{'DEVICE':<34}{'VERSIONS':<52}{'MiB':>8}{'AGE':>6}")
    for a in artifacts:
        meta = a.meta
        kind = f"{a.kind}:{meta['component']}" if meta.get("component") and a.kind != meta["component"] else a.kind
        print(f"{a.key:<{width}}{kind:<25}{meta.get('model', '')[:19]:<20}{meta.get('device', '')[:33]:<34}"
              f"{meta.get('versions', '')[:51]:<52}{a.bytes / 2**20:>8.1f}{_age(a.modified, now):>6}")
    print(f"{len(artifacts)} artifact(s), {sum(a.bytes for a in artifacts) / 2**20:.1f} MiB", file=sys.stderr)
    return 0


def rm_command(args: argparse.Namespace) -> int:
    """Delete the named artifacts, all of them, or those older than ``--older-than`` days.
    Exit 1 when a named key does not exist (the others are still deleted); 2 on no selection."""
    if bool(args.keys) + args.all + (args.older_than is not None) != 1:
        print("renderfarm cache rm: name KEYs, or --all, or --older-than DAYS (one of them)", file=sys.stderr)
        return 2
    store = _store()
    status = 0
    if args.keys:
        stored = {a.key for a in store.list()}
        chosen = []
        for key in args.keys:
            if key in stored:
                chosen.append(key)
            else:
                print(f"renderfarm cache rm: no artifact {key!r}", file=sys.stderr)
                status = 1
    else:
        cutoff = datetime.now(timezone.utc) - timedelta(days=args.older_than or 0)
        chosen = [a.key for a in store.list() if args.all or a.modified < cutoff]
    for key in chosen:
        store.delete(key)
        print(f"deleted {key}")
    print(json.dumps({"deleted": len(chosen)}), file=sys.stderr)
    return status


def _days(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"days must be >= 0, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm cache ls|rm`` to the CLI."""
    cache = subparsers.add_parser("cache", help="list and prune the workers' shared compile cache (S3)")
    sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    ls = sub.add_parser("ls", help="list the artifacts: key, kind, model, device, versions, size, age")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=lambda args: sys.exit(ls_command(args)))
    rm = sub.add_parser("rm", help="delete artifacts by key, all of them, or those older than DAYS")
    rm.add_argument("keys", nargs="*", metavar="KEY")
    rm.add_argument("--all", action="store_true", help="delete every artifact")
    rm.add_argument("--older-than", type=_days, default=None, metavar="DAYS",
                    help="delete the artifacts last written more than DAYS days ago")
    rm.set_defaults(func=lambda args: sys.exit(rm_command(args)))
