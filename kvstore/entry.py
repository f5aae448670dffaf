"""The store's index entries and the prefix tree's bookkeeping on them.

An `Entry` is one block: where it sits (`tier`, `location`), its place in the
prefix tree (`parent`, `depth`, `kids`), how many of its children sit in each
tier (`children`, indexed by `RANK`), its pins and its write state, and the
copies it left in slower persistent tiers when it was promoted out of them
(`copies`; see kvstore/store.py, "Inclusive"), and what inspection tools and
KV events show of it (`hits`, `last_access`, `tokens`). The tree rule concerns
where a block sits, not its copies. The tree rule "a child never sits in a
faster tier than its parent" is kept with the per-tier child counts: a block
is a leaf *of tier t* when no child lives in t or a faster tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from tiers.base import TIER_ORDER

TIERS = TIER_ORDER  # fastest first
RANK = {name: i for i, name in enumerate(TIERS)}
Owner = Hashable
Key = tuple  # (namespace id, block hash)


@dataclass(slots=True)
class Entry:
    key: Key
    parent: Key | None
    depth: int
    nbytes: int
    tier: str
    location: object  # the tier's own handle: extents (host, gpu), a DiskSlot (disk)
    owner: Owner | None  # reserving owner while uncommitted
    committed: bool = False
    pins: int = 0
    children: list = field(default_factory=lambda: [0] * len(TIERS))  # resident children per tier rank
    attention: float | None = None
    kids: object = None  # the children's keys: None, one Key, or a set of Keys (see `link_child`)
    copies: dict | None = None  # tier name -> location of a copy kept in a slower, persistent tier
    hits: int = 0  # times acquired (for `kvstore inspect`)
    last_access: float = 0.0  # the store's clock at the commit or the latest hit
    tokens: bytes | None = None  # the block's token ids (<u4), when the writer sent them and KV events are on


def link_child(parent: Entry, key: Key) -> None:
    """Index `key` under `parent`. Most blocks have at most one child, so one child is
    stored bare (no set per chain link); a second one turns it into a set."""
    kids = parent.kids
    if kids is None:
        parent.kids = key
    elif isinstance(kids, set):
        kids.add(key)
    elif kids != key:
        parent.kids = {kids, key}


def unlink_child(parent: Entry, key: Key) -> None:
    kids = parent.kids
    if isinstance(kids, set):
        kids.discard(key)
        if len(kids) == 1:
            parent.kids = next(iter(kids))
    elif kids == key:
        parent.kids = None


def children_of(entry: Entry) -> tuple | set:
    kids = entry.kids
    return () if kids is None else kids if isinstance(kids, set) else (kids,)


def is_leaf_in(entry: Entry, tier: str) -> bool:
    """No child of `entry` sits in `tier` or a faster one."""
    return not any(entry.children[: RANK[tier] + 1])


@dataclass(frozen=True, slots=True)
class LookupResult:
    """`hits` leading blocks are present; `tiers` names the tier of each."""

    hits: int
    tiers: tuple[str, ...]


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    promotions_out: int = 0
    checksum_failures: int = 0
