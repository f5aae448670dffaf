"""What the store's parts tell observers about blocks: the store's listeners.

A listener is any object with some of the methods below; `Listeners.add`
subscribes each one it has (the KV-event publisher, server/events.py, has the
first three; the waits, kvstore/waits.py, follow reservations; remote
publishing, kvstore/sharing.py, follows commits, hits and evictions). They are
called on the store's thread, inside its operations, so they must be quick
(append to a list, set a future) and must not call back into the store.

- `stored(entry, tier)`: a committed block is now held in `tier`: a commit,
  an adoption (restart recovery, a remote lookup), a demotion or promotion
  into it (unless the block kept a copy there, which was reported already);
- `removed(entry, tier)`: it no longer is: evicted from the last tier,
  demoted or promoted out of it (unless it keeps a copy there), dropped, or
  its copy there dropped;
- `cleared(ns_ids)`: every block of these namespaces is gone (admin clear);
  the store then reports `stored` for each block that survived (pinned ones);
- `reserved(entry)`: a block was reserved (it is in flight until committed or dropped);
- `committed(entries)`: these blocks became readable (one call per commit);
- `dropped(entry)`: an entry left the index (aborted, evicted from the last
  tier, removed, lost);
- `hit(entries)`: an acquire pinned these committed blocks;
- `evicting(entry)`: a victim is about to leave the host arena (its bytes are
  still there during the call).

"Held in a tier" counts the tier a block sits in and the persistent tiers it
kept a copy in (kvstore/placement.py, copies). Invariant, which the tests
check against the store after every step: per (block, tier) `stored` and
`removed` alternate, starting with `stored`, and the pairs reported stored and
not removed are exactly what the store holds. Blocks that were never
committed (reserved, then aborted) are never reported stored or removed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    from kvstore.entry import Entry

KINDS = ("stored", "removed", "cleared", "reserved", "committed", "dropped", "hit", "evicting")


def _ignore(*args: object) -> None:
    pass


def _fan_out(fns: list[Callable]) -> Callable:
    def call(*args: object) -> None:
        for fn in fns:
            fn(*args)
    return call


class Listeners:
    """The store's listeners, per kind; the parts call the method of the kind they report.

    Reporting happens several times per block on the hot paths, so each kind's method is bound,
    per instance, to what it has to call: nothing, the one subscriber's method itself, or a loop
    over several (`_bind`, after every change of the subscriptions)."""

    # one per kind (see the module docstring), bound by `_bind`
    stored: Callable[[Entry, str], None]
    removed: Callable[[Entry, str], None]
    cleared: Callable[[Iterable[str]], None]
    reserved: Callable[[Entry], None]
    committed: Callable[[Sequence[Entry]], None]
    dropped: Callable[[Entry], None]
    hit: Callable[[Sequence[Entry]], None]
    evicting: Callable[[Entry], None]

    def __init__(self) -> None:
        self._subs: dict[str, list[Callable]] = {kind: [] for kind in KINDS}
        for kind in KINDS:
            self._bind(kind)

    def _bind(self, kind: str) -> None:
        fns = self._subs[kind]
        setattr(self, kind, _ignore if not fns else fns[0] if len(fns) == 1 else _fan_out(list(fns)))

    def add(self, listener: object) -> None:
        """Subscribe each of `listener`'s methods named like a kind."""
        for kind in KINDS:
            fn = getattr(listener, kind, None)
            if callable(fn):
                self._subs[kind].append(fn)
                self._bind(kind)

    @property
    def follows_tiers(self) -> bool:
        """Someone follows which tiers hold which blocks (KV events): report_all and tokens are worth it."""
        return bool(self._subs["stored"])

    @contextmanager
    def muted(self) -> Iterator[None]:
        """No `stored`/`removed` inside (an admin clear: one `cleared` says it all)."""
        saved = self._subs["stored"], self._subs["removed"]
        self._subs["stored"], self._subs["removed"] = [], []
        self._bind("stored")
        self._bind("removed")
        try:
            yield
        finally:
            self._subs["stored"], self._subs["removed"] = saved
            self._bind("stored")
            self._bind("removed")


def held_tiers(entry: Entry) -> list[str]:
    """The tiers that hold `entry`: where it sits, then where it kept copies."""
    return [entry.tier, *(entry.copies or ())]
