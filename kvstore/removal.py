"""Taking blocks out: admin removal, clear, discarding lost or corrupt blocks (a part of TieredStore).

`Removal` holds the methods of `kvstore.store.TieredStore` that remove blocks
with their subtrees, so a chain never keeps a hole; the state they use
(`entries`, pins, reservations, `events`, counters) is the store's, and every
block goes through the store's `_drop` (policies, tiers, events, waits).
Admin removal (`remove`, `clear`) skips any subtree with a pinned or
uncommitted block; `discard` (the bytes are lost or fail to verify) takes the
subtree whatever its pins and turns those pins into ghost pins that `release`
accepts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from kvstore.block_events import held_tiers
from kvstore.entry import Entry, Key, children_of


class Removal:
    """Mixed into TieredStore; not used alone."""

    def remove(self, ns_id: str, hashes: Sequence[bytes]) -> int:
        """Admin removal of the given blocks and their subtrees, where nothing in them is pinned."""
        self.namespace(ns_id)
        removed = 0
        for h in hashes:
            entry = self.entries.get((ns_id, h))
            if entry is None or not entry.committed:
                continue
            subtree = self.subtree(entry.key)
            if any(self.entries[k].pins or not self.entries[k].committed for k in subtree):
                continue
            for key in sorted(subtree, key=lambda k: -self.entries[k].depth):
                self._drop(self.entries[key])
                removed += 1
        return removed

    def clear(self) -> int:
        """Drop every committed, unpinned block whose subtree is unpinned and committed.

        Reported to `events` as one `cleared` of every namespace, then `stored` for what survived."""
        roots: dict[str, list[bytes]] = defaultdict(list)
        for e in self.entries.values():
            if e.parent is None:
                roots[e.key[0]].append(e.key[1])
        events, self.events = self.events, None
        try:
            removed = sum(self.remove(ns_id, hashes) for ns_id, hashes in roots.items())
        finally:
            self.events = events
        if events is not None:
            events.cleared(list(self.namespaces))
            self.report_all()
        return removed

    def report_all(self) -> None:
        """Report every committed block as stored in each tier holding it (after a `cleared`: the
        daemon's start, or a resync). Tier by tier, each chain walked from its root, so a parent comes
        before its children and a chain's blocks come together (one BlockStored per chain)."""
        if self.events is None:
            return
        roots = [e for e in self.entries.values() if e.parent is None]
        for tier in self.chain:
            for root in roots:
                stack = [root]
                while stack:
                    e = stack.pop()
                    if e.committed and tier.name in held_tiers(e):
                        self.events.stored(e, tier.name)
                    stack.extend(self.entries[k] for k in children_of(e))

    def subtree(self, root: Key) -> list[Key]:
        """`root` and everything below it, in O(size of the subtree)."""
        entries = self.entries
        out, stack = [], [root]
        while stack:
            key = stack.pop()
            out.append(key)
            stack.extend(children_of(entries[key]))
        return out

    def discard(self, entry: Entry) -> None:
        """Remove a block and its subtree whatever their pins (corrupt or lost bytes)."""
        for key in sorted(self.subtree(entry.key), key=lambda k: -self.entries[k].depth):
            e = self.entries[key]
            for owner, pins in self.pins_by_owner.items():
                n = pins.pop(key, 0)
                if n:
                    self.ghost_pins[owner][key] += n
            e.pins = 0
            if not e.committed:
                self.reserved_by_owner[e.owner].discard(key)
            self._drop(e)
            self.counters[f"{entry.tier}_blocks_discarded"] += 1

    def _reap(self) -> None:
        """Discard the blocks whose write to a tier failed after it took their bytes."""
        for tier in self.chain:
            for key in tier.failed_writes():
                e = self.entries.get(key)
                if e is not None and e.tier == tier.name and tier.lost(e.location):
                    self.counters[f"{tier.name}_write_failures"] += 1
                    self.discard(e)
                elif e is not None and e.copies and tier.name in e.copies and tier.lost(e.copies[tier.name]):
                    self.counters[f"{tier.name}_write_failures"] += 1
                    self.drop_copy(e, tier.name)  # the block itself is safe in a faster tier
