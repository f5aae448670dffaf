"""Restart recovery: rebuild the block index from the tiers that persist, while the store serves.

Each persistent tier, fastest first, reports its namespaces (re-registered at
once, anchors first) and its block records: at once (`Tier.recover`) or, for a
tier that reads them in the background (`Tier.scanned`: the host arena's
placement index and the disk's, millions of records each), once they are
read. The daemon adopts them in steps while it serves (`Recovery.step`, a
bounded number of records a call), unless there are only a few thousand;
`finish` does it in one go (those few, a store built without a loop, tools,
tests, `check`). Meanwhile a request adopts the records of the keys it names
before it looks at them (`adopt_now`): a block whose record is read is a hit
at once. A tier's free pages are known once its records are read, before they
are adopted, so the store takes new blocks meanwhile (before then, the tier
takes none: a put into it is refused, a demotion into it dropped).

Rules, either way:
- Blocks are adopted parents first, from the roots and from blocks already
  indexed, so a record whose parent is missing (an orphan, e.g. a block whose
  ancestors lived only in host RAM before a kill -9) is never adopted and its
  pages are freed; so is a record that does not match its namespace (a block
  of an anchored namespace hangs under its anchor namespace's block, so an
  attachment whose block is gone is an orphan too), and one that would sit in
  a faster tier than its parent.
- Adopted blocks enter their tier's policy in the order they reached the tier
  (within each step).
- A key already indexed in a faster tier keeps its record in a slower tier
  that keeps copies (disk) as its copy (`Entry.copies`, inclusive tiers), as
  if it had been promoted out of it.
- The store changes while a tier's records are adopted. A record whose key was
  written into the same tier again meanwhile (the newer record replaced it in
  the tier's index) only gives its pages back, and only once the newer record
  is durable; any other record that is not adopted is released (its pages and
  its index record). A slower shared tier, such as a remote store, is not ours
  to free.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvstore.entry import RANK, Entry, Key
from kvstore.errors import NamespaceError
from kvstore.index import BlockIndex
from kvstore.keys import ROOT_HASH, Namespace, block_key, key_ns
from kvstore.placement import Placement
from kvstore.tiers.base import RecoveredBlock, Tier

log = logging.getLogger(__name__)

STAGES = ("scan", "index", "adopt", "copies", "orphans")


@dataclass
class _TierRecovery:
    """One tier's recovery in progress, stage by stage (`STAGES`)."""

    tier: Tier
    kept_records: int = 0  # the block records the tier found at open
    stage: str = "scan"
    started: float = field(default_factory=time.monotonic)
    blocks: list = field(default_factory=list)  # read, not yet indexed
    pos: int = 0  # the next of `blocks` to index
    # What waits for adoption holds most of a restart's memory (10^7 disk records): a record is kept as its
    # RecoveredBlock alone (its parent's key is made again when it is adopted), and a parent's waiting
    # children as one key where there is one (a chain's), not a list.
    records: dict = field(default_factory=dict)  # key -> RecoveredBlock: indexed, not adopted
    children: dict = field(default_factory=dict)  # parent key -> the key, or a list of the keys, of `records`
    frontier: list = field(default_factory=list)  # keys of `records` whose parent was indexed
    copies: list = field(default_factory=list)  # records of keys indexed in a faster tier
    stale: list = field(default_factory=list)  # records a newer one replaced: pages freed once it is durable
    adopted: int = 0
    num_copies: int = 0
    orphans: int = 0
    dropped: int = 0


class Recovery:
    """Adopts what the persistent tiers of `placement`'s chain kept, fastest tier first; `register` is the
    store's namespace registration. The constructor registers the namespaces; the blocks are adopted by
    `step` or `finish`."""

    def __init__(self, index: BlockIndex, placement: Placement, register: Callable[[Namespace], str]) -> None:
        self.index, self.placement = index, placement
        self._pending: deque[_TierRecovery] = deque()
        self.num_records = 0  # the block records the tiers reported at open
        for tier in placement.chain:
            if not tier.persistent:
                continue
            kept = tier.num_kept_records  # (before `recover` hands them over)
            self.num_records += kept
            namespaces, blocks = tier.recover()
            _register(tier, namespaces, register)
            r = _TierRecovery(tier, kept)
            if not tier.scanning:
                r.blocks, r.stage = blocks, "index"
            self._pending.append(r)

    @property
    def active(self) -> bool:
        return bool(self._pending)

    @property
    def scanning(self) -> bool:
        """The tier being recovered still reads its records (a step has nothing to adopt yet)."""
        return bool(self._pending) and self._pending[0].stage == "scan"

    def step(self, budget: int = 1000) -> bool:
        """Work through up to `budget` records of each tier being recovered; True while work is left.

        The tiers go on together (the disk's scan and sort while the host arena's blocks are adopted),
        but a tier adopts only once every faster one has sorted its records (a key held by both is the
        faster tier's block, and the slower record its copy), and it ends (frees what it could not
        adopt) only once the faster ones have ended: a record whose parent a faster tier has yet to
        adopt is not an orphan."""
        for r in list(self._pending):
            self._release_stale(r)
            if not self._advance(r, budget, first=r is self._pending[0]):
                self._pending.remove(r)
        return bool(self._pending)

    def finish(self) -> None:
        """Everything left, now (waiting for the scans)."""
        with _no_cyclic_gc():
            while self._pending:
                r = self._pending[0]
                if r.stage == "scan":
                    r.blocks, r.stage = r.tier.scanned(wait=True) or [], "index"
                while self._advance(r, None):
                    pass
                if r.stale:
                    r.tier.flush()  # the newer records are durable now
                    self._release_stale(r)
                self._pending.popleft()

    def adopt_now(self, keys: list[Key]) -> None:
        """Adopt the records of `keys` (and of their ancestors) read but not adopted yet, fastest tier first."""
        for r in self._pending:
            if not self._may_adopt(r):
                return
            if not r.records:
                continue
            adopted: list[tuple[float, Entry]] = []
            for key in keys:
                chain = []
                while key in r.records and key not in chain:
                    chain.append(key)
                    key = self._parent_key(r.records[key])
                for k in reversed(chain):
                    if not self._adopt_one(r, k, adopted):
                        break
            self._enter_policy(adopted)

    def _may_adopt(self, r: _TierRecovery) -> bool:
        """`r` has sorted its records and so has every faster tier being recovered."""
        for other in self._pending:
            if other.stage in ("scan", "index"):
                return False
            if other is r:
                return True
        return False

    def stats(self) -> dict:
        """Per tier being recovered: its stage, the records it kept, those read and waiting, the blocks adopted
        so far, seconds since it began."""
        return {r.tier.name: {"stage": r.stage, "kept_records": r.kept_records,
                              "waiting_records": len(r.blocks) - r.pos + len(r.records),
                              "adopted_blocks": r.adopted, "elapsed_s": round(time.monotonic() - r.started, 3)}
                for r in self._pending}

    # -- the stages ---------------------------------------------------------------------------
    def _advance(self, r: _TierRecovery, budget: int | None, first: bool = True) -> bool:
        """Run `r`'s current stage for up to `budget` records (None: all); False once `r` is done. Only
        the `first` tier being recovered gets past adopting (see `step`)."""
        if r.stage == "scan":
            blocks = r.tier.scanned()
            if blocks is not None:
                r.blocks, r.stage = blocks, "index"
            return True
        if r.stage == "index":
            if self._index(r, budget):
                r.blocks, r.pos, r.stage = [], 0, "adopt"
            return True
        if r.stage == "adopt":
            if not self._may_adopt(r):
                return True
            adopted: list[tuple[float, Entry]] = []
            n = 0
            while r.frontier and (budget is None or n < budget):
                self._adopt_one(r, r.frontier.pop(), adopted)
                n += 1
            self._enter_policy(adopted)
            if not r.frontier and first:
                r.copies.sort(key=lambda b: b.stamp)  # the copies index is oldest first
                r.copies.reverse()
                r.stage = "copies"
            return True
        if r.stage == "copies":
            self._take_copies(r, budget)
            if not r.copies:
                r.blocks, r.stage = list(r.records.values()), "orphans"
                r.records, r.children = {}, {}
            return True
        for b in self._take(r, budget):  # orphans: unreachable from a root
            self._release(r, b)
            r.orphans += 1
        if r.blocks:
            return True
        self._done(r)
        return False

    def _take(self, r: _TierRecovery, budget: int | None) -> list[RecoveredBlock]:
        """The next `budget` of `r.blocks` (all: None)."""
        end = len(r.blocks) if budget is None else min(len(r.blocks), r.pos + budget)
        out, r.pos = r.blocks[r.pos : end], end
        if r.pos >= len(r.blocks):
            r.blocks, r.pos = [], 0
        return out

    def _index(self, r: _TierRecovery, budget: int | None) -> bool:
        """Sort the next records: adoptable (`records`), copies, or released. True once all are."""
        tier, index = r.tier, self.index
        known = self.placement.shared.namespaces
        keeps_copies = tier.name in index.copies
        end = len(r.blocks) if budget is None else min(len(r.blocks), r.pos + budget)
        for b in r.blocks[r.pos : end]:
            ns_id = key_ns(b.key)
            ns = known.get(ns_id)
            if ns is None or b.nbytes != ns.block_bytes:
                self._release(r, b)
                r.dropped += 1
                continue
            e = index.get(b.key)
            if e is not None:
                if keeps_copies and RANK[e.tier] < RANK[tier.name] and tier.name not in (e.copies or ()):
                    r.copies.append(b)
                else:
                    self._release(r, b)
                continue
            parent = None if b.parent in (None, b"", ROOT_HASH) else block_key(ns.anchor or ns_id, b.parent)
            r.records[b.key] = b
            if parent is None or index.get(parent) is not None:
                r.frontier.append(b.key)
            else:
                kids = r.children.get(parent)
                if kids is None:
                    r.children[parent] = b.key
                elif type(kids) is list:
                    kids.append(b.key)
                else:
                    r.children[parent] = [kids, b.key]
        r.pos = end
        return r.pos >= len(r.blocks)

    def _adopt_one(self, r: _TierRecovery, key: Key, adopted: list[tuple[float, Entry]]) -> bool:
        """Adopt the record of `key` if it still can be (its parent indexed, no faster than it); False
        when it cannot now."""
        b = r.records.get(key)
        if b is None:
            return False  # adopted already (on demand)
        parent_key = self._parent_key(b)
        tier, index = r.tier, self.index
        parent = index.get(parent_key) if parent_key is not None else None
        if parent_key is not None and (parent is None or RANK[parent.tier] > RANK[tier.name]):
            return False  # it stays in `records`: an orphan unless its parent comes back
        del r.records[key]
        e = index.get(key)
        if e is not None or any(key in other.records for other in self._faster(r)):
            # Indexed meanwhile (written again, or adopted from a faster tier), or about to be adopted from
            # a faster tier: this record is its copy where this tier keeps copies (checked when copies are
            # taken, after the faster tiers), else it goes.
            if tier.name in index.copies and (e is None or RANK[e.tier] < RANK[tier.name]):
                r.copies.append(b)
            else:
                self._release(r, b)
            if e is not None:
                self._indexed(key)
            return False
        e = index.adopt(key, parent, tier.name, b.location, b.attention)
        adopted.append((b.stamp, e))
        self.placement.adopted(e)
        self._indexed(key)
        r.adopted += 1
        return True

    def _parent_key(self, b: RecoveredBlock) -> Key | None:
        """The key of `b`'s parent (None: a root); its namespace is registered (`_index` checked)."""
        if b.parent in (None, b"", ROOT_HASH):
            return None
        ns_id = key_ns(b.key)
        return block_key(self.placement.shared.namespaces[ns_id].anchor or ns_id, b.parent)

    def _faster(self, r: _TierRecovery) -> list[_TierRecovery]:
        out = []
        for other in self._pending:
            if other is r:
                return out
            out.append(other)
        return out

    def _indexed(self, key: Key) -> None:
        """`key` is in the index: the records waiting for it as their parent, in any tier, may be adopted."""
        for other in self._pending:
            kids = other.children.pop(key, None)
            if type(kids) is list:
                other.frontier.extend(kids)
            elif kids is not None:
                other.frontier.append(kids)

    def _enter_policy(self, adopted: list[tuple[float, Entry]]) -> None:
        if adopted:
            adopted.sort(key=lambda t: t[0])  # (stable: equal stamps keep their order)
            self.placement.insert_in_policy([e for _, e in adopted])

    def _take_copies(self, r: _TierRecovery, budget: int | None) -> None:
        """Records of blocks indexed in a faster tier become their copies, oldest first."""
        tier, index, n = r.tier, self.index, 0
        while r.copies and (budget is None or n < budget):
            b = r.copies.pop()
            n += 1
            e = index.get(b.key)
            if e is not None and RANK[e.tier] < RANK[tier.name] and tier.name not in (e.copies or ()):
                index.add_copy(e, tier.name, b.location)
                r.num_copies += 1
            else:
                self._release(r, b)

    # -- records not adopted ----------------------------------------------------------------
    def _release(self, r: _TierRecovery, b: RecoveredBlock) -> None:
        """Give back the pages of a record that is not adopted, and its index record, unless a newer
        record of the same key lives in the tier now: then only the pages, once that one is durable."""
        if self._newer(r.tier, b) is None:
            r.tier.free(b.location, b.key)
        else:
            r.stale.append(b)
            self._release_stale(r)

    def _newer(self, tier: Tier, b: RecoveredBlock) -> object | None:
        """The location of the record that replaced `b`'s in `tier` (None: none did)."""
        e = self.index.get(b.key)
        if e is None:
            return None
        location = e.location if e.tier == tier.name else (e.copies or {}).get(tier.name)
        return location if location is not None and location is not b.location else None

    def _release_stale(self, r: _TierRecovery) -> None:
        if not r.stale:
            return
        waiting = []
        for b in r.stale:
            newer = self._newer(r.tier, b)
            if newer is not None and not r.tier.durable(newer):
                waiting.append(b)
            else:  # the newer record is durable (or gone, its deletion queued): no record points here
                r.tier.free(b.location)
        r.stale = waiting

    def _done(self, r: _TierRecovery) -> None:
        counters, name = self.placement.counters, r.tier.name
        counters[f"{name}_blocks_recovered"] = r.adopted
        counters[f"{name}_copies_recovered"] = r.num_copies
        if r.orphans:
            counters[f"{name}_orphans_dropped"] += r.orphans
        if r.dropped:
            counters[f"{name}_records_dropped"] += r.dropped
        log.info("%s tier: recovered %d blocks and %d copies of blocks in faster tiers, dropped %d orphans in "
                 "%.2f s; %s", name, r.adopted, r.num_copies, r.orphans, time.monotonic() - r.started,
                 r.tier.stats())


def _register(tier: Tier, namespaces: list, register: Callable[[Namespace], str]) -> None:
    """Re-register a tier's namespaces, anchors before the namespaces anchored to them."""
    for ns_id, fields in sorted(namespaces, key=lambda item: bool(isinstance(item[1], dict) and item[1].get("anchor"))):
        try:
            ns = Namespace.from_dict(fields)
            if ns.id != ns_id:
                raise ValueError("namespace id does not match its fields")
            register(ns)
        except (ValueError, TypeError, NamespaceError) as exc:
            log.warning("%s tier: namespace %r not restored: %s", tier.name, ns_id, exc)


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
