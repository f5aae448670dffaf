"""The types every part of the store core shares: index entries, the prefix tree's helpers, and
`Shared` (clocks, namespaces, counters and listeners, handed to each part at construction).

An `Entry` is one block: where it sits (`tier`, `location`), its place in the
prefix tree (`parent`, `depth`, `child_keys`), how many of its children sit in
each tier (`tier_children`: one int, a `CHILD_BITS`-bit count per tier rank),
its pins and whether it is committed, the copies
it left in slower persistent tiers when it was promoted out of them (`copies`),
and what inspection tools and KV events show of it (`hits`, `last_access`,
`tokens`). Its size is its namespace's (`nbytes`, read through the key's tag),
and the owner of a reservation is the index's to know (`reserved_by_owner`):
an entry of ten slots is 112 B, twelve took 128. Only the block index
(kvstore/index.py) creates, re-tiers or removes entries; the other parts read
them.

The tree rule "a child never sits in a faster tier than its parent" is kept
with the per-tier child counts: a block is a leaf *of tier t* when no child
lives in t or a faster tier (`is_leaf_in`: one mask). The counts are packed in
one int, not a list, because every block holds them: a list of five counts
cost 96 bytes a block, the int 0-32. It concerns where a block sits, not its copies.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Hashable

from kvstore.block_events import Listeners
from kvstore.keys import BLOCK_BYTES, TAG_BYTES, Key, Namespace  # noqa: F401  (Key: also this module's name)
from kvstore.wire import RANK, TIERS

Owner = Hashable
CHILD_BITS = 32  # one tier's count in `Entry.tier_children` (a block has far fewer than 2^32 children)
CHILD = {t: 1 << (CHILD_BITS * RANK[t]) for t in TIERS}  # one child in tier t, added to `tier_children`
UP_TO = {t: (1 << (CHILD_BITS * (RANK[t] + 1))) - 1 for t in TIERS}  # the counts of t and faster tiers
# The counts of a block with one child (nearly every block of a chain): one shared int per tier, kept
# by `add_children`, not an int object of 28-36 B in every block.
_ONE_CHILD = {c: c for c in CHILD.values()}


@dataclass(slots=True)
class Entry:
    key: Key
    parent: Key | None
    depth: int
    tier: str
    location: object  # the tier's own handle: extents (host, gpu), an int or a DiskSlot (disk), a RemoteRef
    pins: int = 0
    tier_children: int = 0  # resident children per tier: CHILD_BITS bits per tier rank (`CHILD[tier]` is one)
    child_keys: object = None  # the children's keys: None, one Key, or a set of Keys (see `link_child`)
    # The store's clock at the commit or the latest hit; None while reserved (`committed`), 0.0 for a block
    # adopted without one (recovery, a remote lookup).
    last_access: float | None = None
    rare: _Rare | None = None  # `attention`, `copies`, `tokens` and `hits` (properties, below), where one is set
    # What only some blocks have, in one object of theirs: a block holds none of the four unless the
    # engine sent an estimate, it was promoted out of a persistent tier, KV events follow tokens, or it
    # was read (32 B less of every other block):
    # - attention (float | None): the engine's attention estimate, as sent at the commit;
    # - copies (dict | None): tier name -> location of a copy kept in a slower, persistent tier;
    # - tokens (bytes | None): the block's token ids (<u4), when the writer sent them and KV events are on;
    # - hits (int): times acquired, for `kvstore inspect` (`count_hit`).

    @property
    def committed(self) -> bool:
        """Readable: committed, no longer a reservation (a commit is a block's first access)."""
        return self.last_access is not None

    @property
    def nbytes(self) -> int:
        """The block's size: its namespace's (noted under the key's tag when the store registered it)."""
        return BLOCK_BYTES[self.key[:TAG_BYTES]]


class _Rare:
    __slots__ = ("attention", "copies", "tokens", "hits")  # (four slots take what three would: 64 B)

    def __init__(self) -> None:
        self.attention = self.copies = self.tokens = None
        self.hits = 0


def _rare(name: str) -> property:
    """`Entry.<name>`, kept in the entry's `_Rare` (made when first set to something, dropped when all
    three are None again)."""

    def get(e: Entry) -> object:
        rare = e.rare
        return None if rare is None else getattr(rare, name)

    def put(e: Entry, value: object) -> None:
        rare = e.rare
        if rare is None:
            if value is None:
                return
            rare = e.rare = _Rare()
        setattr(rare, name, value)
        if value is None and rare.attention is None and rare.copies is None and rare.tokens is None and not rare.hits:
            e.rare = None

    return property(get, put)


Entry.attention, Entry.copies, Entry.tokens = _rare("attention"), _rare("copies"), _rare("tokens")  # type: ignore[misc]
Entry.hits = property(lambda e: 0 if e.rare is None else e.rare.hits)  # type: ignore[misc]


def count_hit(e: Entry, now: float) -> None:
    """An acquire read `e`: one more hit, and its latest access."""
    rare = e.rare
    if rare is None:
        rare = e.rare = _Rare()
    rare.hits += 1
    e.last_access = now


_DEPTHS: dict[int, int] = {}


def child_depth(parent: Entry) -> int:
    """`parent`'s depth + 1, one int object per depth: a block deeper than 256 (a prompt past 4k tokens
    in 16-token blocks) would hold an int of 28 B of its own."""
    d = parent.depth + 1
    return _DEPTHS.setdefault(d, d)


def add_children(parent: Entry, delta: int) -> None:
    """Add `delta` (a sum of +-`CHILD[tier]`) to `parent`'s packed child counts."""
    packed = parent.tier_children + delta
    parent.tier_children = _ONE_CHILD.get(packed, packed)


def link_child(parent: Entry, key: Key) -> None:
    """Index `key` under `parent`. Most blocks have at most one child, so one child is
    stored bare (no set per chain link); a second one turns it into a set."""
    kids = parent.child_keys
    if kids is None:
        parent.child_keys = key
    elif isinstance(kids, set):
        kids.add(key)
    elif kids != key:
        parent.child_keys = {kids, key}


def unlink_child(parent: Entry, key: Key) -> None:
    kids = parent.child_keys
    if isinstance(kids, set):
        kids.discard(key)
        if len(kids) == 1:
            parent.child_keys = next(iter(kids))
    elif kids == key:
        parent.child_keys = None


def children_of(entry: Entry) -> tuple | set:
    kids = entry.child_keys
    return () if kids is None else kids if isinstance(kids, set) else (kids,)


def is_leaf_in(entry: Entry, tier: str) -> bool:
    """No child of `entry` sits in `tier` or a faster one."""
    return not entry.tier_children & UP_TO[tier]


def child_counts(entry: Entry) -> list[int]:
    """`entry`'s children per tier, in `TIERS` order (inspection and `check`)."""
    packed, mask = entry.tier_children, (1 << CHILD_BITS) - 1
    return [(packed >> (CHILD_BITS * RANK[t])) & mask for t in TIERS]


def millisecond_clock() -> float:
    """`time.monotonic` in whole milliseconds: the store's default time for policies and hits. The
    blocks of one burst (a commit, the demotions one reserve makes) then share one reading, and the
    default policy one list of insert counts for them (eviction/attention.py `_first_freq`), not one a
    block (128 B a block demoted to disk). A millisecond is nothing to half-lives of 30 s and more."""
    return time.monotonic_ns() // 1_000_000 / 1000


class BurstClock:
    """A clock that reads one time for a burst: between `hold` and the matching `release` (nested holds
    count), every call returns the first reading since the outermost `hold`. The store holds it across a
    reserve and a `make_room`, so the blocks one reserve demotes share one reading (and the default
    policy one count of a first insert for them, eviction/attention.py `_first_freq`: one list of
    152 B a few blocks otherwise, in the milliseconds a burst of demotions takes)."""

    __slots__ = ("_clock", "_held", "_depth")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: float | None = None
        self._depth = 0

    def __call__(self) -> float:
        held = self._held
        if held is None:
            held = self._clock()
            if self._depth:
                self._held = held
        return held

    def hold(self) -> None:
        self._depth += 1

    def release(self) -> None:
        self._depth -= 1
        if not self._depth:
            self._held = None


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    promotions_out: int = 0
    checksum_failures: int = 0


@dataclass
class Shared:
    """What the store's parts share, made once by the store: they read the clocks and namespaces,
    add to the counters and report to the listeners; none of them owns these."""

    clock: Callable[[], float] = millisecond_clock  # policies' and hits' time (held as a `BurstClock`)
    wall_clock: Callable[[], float] = time.time  # stamps persistent tiers record
    namespaces: dict[str, Namespace] = field(default_factory=dict)  # registered by the store only
    counters: Counter = field(default_factory=Counter)  # store-wide event counts (stats()["counters"])
    ns_counters: defaultdict = field(default_factory=lambda: defaultdict(Counter))  # per namespace
    tier_stats: dict[str, TierStats] = field(default_factory=lambda: {t: TierStats() for t in TIERS})
    listeners: Listeners = field(default_factory=Listeners)

    def __post_init__(self) -> None:
        if not isinstance(self.clock, BurstClock):
            self.clock = BurstClock(self.clock)
