"""What the store tells an observer about blocks entering and leaving tiers (the source of KV events).

`TieredStore.events` is None (nothing is reported, nothing costs) or an object
with these methods, which the store calls on its own thread, inside its
operations, so they must be quick (append to a list; server/events.py does the
rest on another thread):

- `stored(entry, tier)`: a committed block is now held in `tier`: a commit,
  a demotion or promotion into it (unless the block kept a copy there, which
  was reported already);
- `removed(entry, tier)`: it no longer is: evicted from the last tier,
  demoted or promoted out of it (unless it keeps a copy there), dropped, or
  its copy there dropped;
- `cleared(ns_ids)`: every block of these namespaces is gone (admin clear);
  the store then reports `stored` for each block that survived (pinned ones).

"Held in a tier" counts the tier a block sits in and the persistent tiers it
kept a copy in (kvstore/store.py, "Inclusive"). Invariant, which the tests
check against the store after every step: per (block, tier) the calls
alternate stored, removed, stored, ..., starting with stored, and the pairs
reported stored and not removed are exactly what the store holds. Blocks that
were never committed (reserved, then aborted) are never reported.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from kvstore.entry import Entry


class BlockEvents(Protocol):
    def stored(self, entry: Entry, tier: str) -> None: ...

    def removed(self, entry: Entry, tier: str) -> None: ...

    def cleared(self, ns_ids: Iterable[str]) -> None: ...


def held_tiers(entry: Entry) -> list[str]:
    """The tiers that hold `entry`: where it sits, then where it kept copies."""
    return [entry.tier, *(entry.copies or ())]
