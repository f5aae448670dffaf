"""Restart recovery: rebuild the store's entries from the tiers that persist (TieredStore's start).

Each persistent tier, fastest first, reports its namespaces and block records
(`Tier.recover`). Namespaces are re-registered. Blocks are adopted
breadth-first from the roots, so a record whose parent is missing (an orphan,
e.g. a block whose ancestors lived only in host RAM before a kill -9) is never
adopted and its pages are freed; a record that does not match its namespace
is dropped the same way. Adopted blocks enter their tier's policy in the order
they reached the tier. A key already adopted from a faster persistent tier
(the re-adopted host arena) stays there; its record in a slower tier that keeps
copies (disk) becomes the block's copy (`Entry.copies`, inclusive tiers), as
if it had been promoted out of it. A slower shared tier, such as a remote
store, is not ours to free.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from kvstore.entry import RANK, Entry, Key, link_child
from kvstore.errors import NamespaceError
from kvstore.keys import ROOT_HASH, Namespace
from tiers.base import RecoveredBlock, Tier

if TYPE_CHECKING:
    from kvstore.store import TieredStore

log = logging.getLogger(__name__)


def recover(store: "TieredStore") -> None:
    for tier in store.chain:
        if tier.persistent:
            _recover_tier(store, tier)


def _recover_tier(store: "TieredStore", tier: Tier) -> None:
    namespaces, blocks = tier.recover()
    for ns_id, fields in namespaces:
        try:
            ns = Namespace.from_dict(fields)
            if ns.id != ns_id:
                raise ValueError("namespace id does not match its fields")
            store.register_namespace(ns)
        except (ValueError, TypeError, NamespaceError) as exc:
            log.warning("%s tier: namespace %r not restored: %s", tier.name, ns_id, exc)
    records: dict[Key, tuple[RecoveredBlock, Key | None]] = {}
    children: dict[Key | None, list[Key]] = defaultdict(list)
    copies: list[tuple[float, Entry, object]] = []
    for b in blocks:
        ns = store.namespaces.get(b.key[0])
        if ns is None or b.nbytes != ns.block_bytes:
            tier.free(b.location, b.key)
            store.counters[f"{tier.name}_records_dropped"] += 1
            continue
        if b.key in store.entries:
            e = store.entries[b.key]
            if tier.name in store.copies and RANK[e.tier] < RANK[tier.name]:
                copies.append((b.stamp, e, b.location))
            continue
        parent = None if b.parent in (None, b"", ROOT_HASH) else (b.key[0], b.parent)
        records[b.key] = (b, parent)
        children[parent].append(b.key)
    adopted: list[tuple[float, Entry]] = []
    # From the roots, and from blocks already adopted from a faster persistent tier.
    frontier = children.pop(None, []) + [k for p in list(children) if p in store.entries for k in children.pop(p)]
    while frontier:
        key = frontier.pop()
        b, parent_key = records.pop(key)
        parent = store.entries.get(parent_key) if parent_key is not None else None
        if parent is not None and RANK[parent.tier] > RANK[tier.name]:
            records[key] = (b, parent_key)  # it would sit faster than its parent: an orphan here
            continue
        e = Entry(key, parent_key, parent.depth + 1 if parent is not None else 0, b.nbytes, tier.name, b.location,
                  None, committed=True)
        e.attention = b.attention
        store.entries[key] = e
        if parent is not None:
            parent.children[RANK[tier.name]] += 1
            link_child(parent, key)
        adopted.append((b.stamp, e))
        frontier.extend(children.pop(key, ()))
    for b, _ in records.values():  # unreachable from a root: orphans
        tier.free(b.location, b.key)
        store.counters[f"{tier.name}_orphans_dropped"] += 1
    policy = store.policies[tier.name]
    for _, e in sorted(adopted, key=lambda t: t[0]):
        policy.on_insert(store.info(e))
    for _, e, location in sorted(copies, key=lambda t: t[0]):  # the copies index is oldest first
        e.copies = {**(e.copies or {}), tier.name: location}
        store.copies[tier.name][e.key] = None
    store.counters[f"{tier.name}_blocks_recovered"] = len(adopted)
    store.counters[f"{tier.name}_copies_recovered"] = len(copies)
    log.info("%s tier: recovered %d blocks and %d copies of blocks in faster tiers, dropped %d orphans; %s",
             tier.name, len(adopted), len(copies), len(records), tier.stats())
