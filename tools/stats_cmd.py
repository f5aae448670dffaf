"""`kvstore stats [--json]`: the daemon's stats, over its socket."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.client import KVClient
from kvstore.errors import KVStoreError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="show the daemon's stats")
    p.add_argument("--socket", help="Unix socket path (default: $KVSTORE_SOCKET or the per-user default)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(run=run)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def run(args: argparse.Namespace) -> int:
    try:
        with KVClient(args.socket, name="kvstore-stats") as client:
            stats = client.stats()
    except KVStoreError as exc:
        print(f"kvstore: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats))
        return 0
    print(f"policy {stats['policy']}  namespaces {stats['namespaces']}  blocks {stats['blocks']}  "
          f"reserved {stats['reserved_blocks']}  pinned {stats['pinned_blocks']}")
    print(f"  chain {' -> '.join(stats.get('chain', []))}")
    for tier, t in stats["tiers"].items():
        if "absent" in t:
            print(f"  {tier:6} absent: {t['absent']}")
            continue
        line = f"  {tier:6} blocks {t['blocks']:>8}  bytes {_mib(t['bytes']):>12}  hits {t['hits']:>8}  evictions {t['evictions']:>8}"
        if "capacity_bytes" in t:
            line += f"  capacity {_mib(t['capacity_bytes'])}"
        if "max_blocks" in t:  # (the disk tier's cap: each block it holds is indexed in the daemon's memory)
            line += f", {t['max_blocks']} blocks"
        print(line)
        for codec, row in t.get("compressed", {}).items():
            print(f"         compressed {codec}: {row['blocks']} blocks, {_mib(row['stored_bytes'])} stored for "
                  f"{_mib(row['logical_bytes'])} of KV ({row['ratio']}x)")
    c = stats["counters"]
    if "compaction" in stats:  # the disk tier compresses
        k = stats["compaction"]
        print(f"         stored exact while the encoders were busy: {c.get('disk_stored_exact_busy', 0)}; "
              f"compacted since: {k['compacted_blocks']}; waiting {k['waiting_blocks']}")
        print(f"         encoded copies of promoted blocks: {stats['tiers']['disk'].get('encoded_copies', 0)} kept; "
              f"{c.get('disk_encoded_copies_dropped', 0)} dropped for room")
    if "gpu_decode" in stats:  # a gpu tier and a tier that compresses
        g = stats["gpu_decode"]
        print("  gpu decode: " + (f"on; {c.get('gpu_expanded_blocks', 0)} blocks expanded on the GPU, "
                                   f"{c.get('gpu_decode_errors', 0)} launches failed" if g["on"] else f"off ({g['reason']})"))
    print(f"  lookups: {c.get('lookup_hit_blocks', 0)}/{c.get('lookup_blocks', 0)} blocks found; "
          f"puts {c.get('put_blocks', 0)}; misses {c.get('miss_blocks', 0)}")
    for line in namespace_lines(stats.get("by_namespace", {})):
        print(line)
    return 0


def namespace_lines(by_ns: dict[str, dict]) -> list[str]:
    """One line per namespace, a hybrid model's attachments on its spine's line (kvstore/connectors/hybrid.py)."""
    attached = {row["anchor"]: (ns, row) for ns, row in by_ns.items() if row.get("anchor")}
    lines = []
    for ns, row in by_ns.items():
        if row.get("anchor"):
            continue
        blocks, nbytes = sum(row["blocks"].values()), sum(row["bytes"].values())
        line = (f"  {ns}  {row['model']}  tp {row['tp_rank']}/{row['tp_size']}  {row['block_tokens']} tokens/block  "
                f"blocks {blocks}  bytes {_mib(nbytes)}")
        if ns in attached:
            _, att = attached[ns]
            line += (f"  + hybrid attachments {sum(att['blocks'].values())} ({_mib(sum(att['bytes'].values()))}: "
                     f"windows and states at kept boundaries)")
        lines.append(line)
    return lines
