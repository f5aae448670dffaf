"""Restart recovery: rebuild the block index from the tiers that persist (at the store's construction).

Each persistent tier, fastest first, reports its namespaces and block records
(`Tier.recover`). Namespaces are re-registered. Blocks are adopted
breadth-first from the roots, so a record whose parent is missing (an orphan,
e.g. a block whose ancestors lived only in host RAM before a kill -9) is never
adopted and its pages are freed; a record that does not match its namespace
is dropped the same way (a block of an anchored namespace hangs under its anchor
namespace's block, so an attachment whose block is gone is an orphan too).
Adopted blocks enter their tier's policy in the order
they reached the tier. A key already adopted from a faster persistent tier
(the re-adopted host arena) stays there; its record in a slower tier that keeps
copies (disk) becomes the block's copy (`Entry.copies`, inclusive tiers), as
if it had been promoted out of it. A slower shared tier, such as a remote
store, is not ours to free.
"""

from __future__ import annotations

import gc
import logging
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterator

from kvstore.entry import RANK, Entry, Key
from kvstore.errors import NamespaceError
from kvstore.index import BlockIndex
from kvstore.keys import ROOT_HASH, Namespace
from kvstore.placement import Placement
from kvstore.tiers.base import RecoveredBlock, Tier

log = logging.getLogger(__name__)


def recover(index: BlockIndex, placement: Placement, register: Callable[[Namespace], str]) -> None:
    """Adopt what the persistent tiers of `placement`'s chain kept, fastest first; `register` is the
    store's namespace registration."""
    with _no_cyclic_gc():
        for tier in placement.chain:
            if tier.persistent:
                _recover_tier(index, placement, register, tier)


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Recovery makes several objects per block and frees none: the cyclic collector, left on, would
    walk every object made so far again and again (a full collection every few thousand blocks, so
    recovery time grows with the square of the blocks)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _recover_tier(index: BlockIndex, placement: Placement, register: Callable[[Namespace], str], tier: Tier) -> None:
    namespaces, blocks = tier.recover()
    # anchors before the namespaces anchored to them (registering one needs its anchor)
    for ns_id, fields in sorted(namespaces, key=lambda item: bool(isinstance(item[1], dict) and item[1].get("anchor"))):
        try:
            ns = Namespace.from_dict(fields)
            if ns.id != ns_id:
                raise ValueError("namespace id does not match its fields")
            register(ns)
        except (ValueError, TypeError, NamespaceError) as exc:
            log.warning("%s tier: namespace %r not restored: %s", tier.name, ns_id, exc)
    known, counters = placement.shared.namespaces, placement.counters
    records: dict[Key, tuple[RecoveredBlock, Key | None]] = {}
    children: dict[Key | None, list[Key]] = defaultdict(list)
    copies: list[tuple[float, Entry, object]] = []
    for b in blocks:
        ns = known.get(b.key[0])
        if ns is None or b.nbytes != ns.block_bytes:
            tier.free(b.location, b.key)
            counters[f"{tier.name}_records_dropped"] += 1
            continue
        e = index.get(b.key)
        if e is not None:
            if tier.name in index.copies and RANK[e.tier] < RANK[tier.name]:
                copies.append((b.stamp, e, b.location))
            continue
        parent = None if b.parent in (None, b"", ROOT_HASH) else (ns.anchor or b.key[0], b.parent)
        records[b.key] = (b, parent)
        children[parent].append(b.key)
    adopted: list[tuple[float, Entry]] = []
    # From the roots, and from blocks already adopted from a faster persistent tier.
    frontier = children.pop(None, []) + [k for p in list(children) if index.get(p) is not None
                                         for k in children.pop(p)]
    while frontier:
        key = frontier.pop()
        b, parent_key = records.pop(key)
        parent = index.get(parent_key) if parent_key is not None else None
        if parent is not None and RANK[parent.tier] > RANK[tier.name]:
            records[key] = (b, parent_key)  # it would sit faster than its parent: an orphan here
            continue
        adopted.append((b.stamp, index.adopt(key, parent, b.nbytes, tier.name, b.location, b.attention)))
        frontier.extend(children.pop(key, ()))
    for b, _ in records.values():  # unreachable from a root: orphans
        tier.free(b.location, b.key)
        counters[f"{tier.name}_orphans_dropped"] += 1
    placement.insert_in_policy([e for _, e in sorted(adopted, key=lambda t: t[0])])
    for _, e, location in sorted(copies, key=lambda t: t[0]):  # the copies index is oldest first
        index.add_copy(e, tier.name, location)
    counters[f"{tier.name}_blocks_recovered"] = len(adopted)
    counters[f"{tier.name}_copies_recovered"] = len(copies)
    log.info("%s tier: recovered %d blocks and %d copies of blocks in faster tiers, dropped %d orphans; %s",
             tier.name, len(adopted), len(copies), len(records), tier.stats())
