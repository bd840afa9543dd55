"""``renderfarm keys``: the operator's commands for tenants' API keys.

Data flow: operator → **this CLI** → :class:`infra.api.auth.KeyStore` in the farm's Redis
(``RENDERFARM_REDIS_URL``) → the API checks keys there on every request. ``create`` prints the
new key once, on stdout alone (so ``KEY=$(renderfarm keys create --tenant t)`` works), and its
id on stderr; ``list`` and ``revoke`` show key ids only, never secrets.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone

from infra.api.auth import KeyInfo, KeyStore
from infra.settings import get_settings
from infra.state.connect import state_client


def _store() -> KeyStore:
    return KeyStore(state_client(get_settings().state_url))


def _row(info: KeyInfo) -> dict:
    created = datetime.fromtimestamp(info.created_at, tz=timezone.utc).isoformat(timespec="seconds")
    return {"key_id": info.key_id, "tenant": info.tenant, "name": info.name, "created_at": created}


def create_command(args: argparse.Namespace) -> int:
    """Create a key; print it once. Exit 2 on an invalid tenant name."""
    try:
        info, key = _store().create(args.tenant, args.name)
    except ValueError as exc:
        print(f"renderfarm keys create: {exc}", file=sys.stderr)
        return 2
    print(key)
    print(f"created key {info.key_id} for tenant {info.tenant!r}; it is shown only this once",
          file=sys.stderr)
    return 0


def revoke_command(args: argparse.Namespace) -> int:
    """Revoke a key by id. Exit 1 when no such key exists."""
    info = _store().revoke(args.key_id)
    if info is None:
        print(f"renderfarm keys revoke: no key with id {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked key {info.key_id}" + (f" of tenant {info.tenant!r}" if info.tenant else ""))
    return 0


def list_command(args: argparse.Namespace) -> int:
    """List keys (all, or one tenant's) as a table or JSON lines."""
    rows = [_row(i) for i in _store().list(args.tenant)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"{'KEY ID':<14}{'TENANT':<24}{'CREATED (UTC)':<27}NAME")
    for row in rows:
        print(f"{row['key_id']:<14}{row['tenant']:<24}{row['created_at']:<27}{row['name']}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``renderfarm keys create|revoke|list`` to the CLI."""
    keys = subparsers.add_parser("keys", help="create, revoke and list tenants' API keys")
    sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a key for a tenant and print it once")
    create.add_argument("--tenant", required=True, help="tenant name: a-z, 0-9, '_', '.', '-'")
    create.add_argument("--name", default="", help="a label for the key, e.g. who holds it")
    create.set_defaults(func=create_command)
    revoke = sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", metavar="KEY_ID")
    revoke.set_defaults(func=revoke_command)
    listing = sub.add_parser("list", help="list keys (ids, tenants, names; never secrets)")
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(func=list_command)
