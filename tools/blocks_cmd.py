"""`kvstore ls` and `kvstore evict`: look at and remove cached blocks, over the daemon's socket."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.client import KVClient
from kvstore.errors import KVStoreError


def register(sub: argparse._SubParsersAction) -> None:
    ls = sub.add_parser("ls", help="list cached blocks")
    ls.add_argument("--socket", help="Unix socket path (default: $KVSTORE_SOCKET or the per-user default)")
    ls.add_argument("--ns", help="only this namespace id")
    ls.add_argument("--limit", type=int, default=50)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=run_ls)
    ev = sub.add_parser("evict", help="remove blocks (and everything stored under them)")
    ev.add_argument("--socket")
    ev.add_argument("--ns", required=True, help="namespace id (see `kvstore ls`)")
    ev.add_argument("hashes", nargs="+", help="block hashes in hex")
    ev.set_defaults(run=run_evict)


def run_ls(args: argparse.Namespace) -> int:
    try:
        with KVClient(args.socket, name="kvstore-ls") as client:
            rows, total = client.list_blocks(args.ns, args.limit)
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    if args.json:
        keys = ("ns", "hash", "tier", "depth", "pins", "committed", "bytes")
        print(json.dumps({"total": total, "blocks": [dict(zip(keys, [r[0], r[1].hex(), *r[2:]])) for r in rows]}))
        return 0
    print(f"{'namespace':22} {'hash':32} {'tier':5} {'depth':>5} {'pins':>4} {'state':9} {'bytes':>10}")
    for ns, h, tier, depth, pins, committed, nbytes in rows:
        print(f"{ns:22} {h.hex():32} {tier:5} {depth:>5} {pins:>4} {'committed' if committed else 'writing':9} {nbytes:>10}")
    print(f"{len(rows)} of {total} blocks")
    return 0


def run_evict(args: argparse.Namespace) -> int:
    try:
        hashes = [bytes.fromhex(h) for h in args.hashes]
    except ValueError:
        print("kvstore: hashes must be hex", file=sys.stderr)
        return 2
    try:
        with KVClient(args.socket, name="kvstore-evict") as client:
            removed = client.remove(args.ns, hashes)
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    print(f"removed {removed} blocks")
    return 0
